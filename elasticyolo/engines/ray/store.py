"""The process-group store of a Ray job: a c10d `TCPStore` served by the job's controller actor
(`controller.py`), which every training actor joins as a client.

Why a `TCPStore` and not Ray's GCS key-value store: Gloo's connection setup, on every world a
worker enters, is a chain of blocking store reads (each rank's address, then its peers'). A
`TCPStore` wait returns when the key is written (the server answers it); the GCS KV has no
blocking read, so every read would be a poll (`EtcdStore` on etcd needs a watch for the same
reason). The store lives in the controller, on the head node with the GCS: losing a training node
never loses it, and a head node lost is a Ray cluster lost anyway.

`AbortableStore` is the store a worker hands to `init_process_group`: the `TCPStore` client with
the `abort_check` hook of `EtcdStore` (`engines/torch/worker.py` sets it while entering a world:
a wait for a key of a world that can no longer form ends as soon as a newer world is out).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

ABORT_CHECK_S = 0.5  # a wait with an abort check asks it this often


def serve(host: str, timeout_s: float = 60.0) -> dist.TCPStore:
    """The store's server, on a free port (`.port`), in the controller's process."""
    return dist.TCPStore(host, 0, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def client(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class AbortableStore(dist.Store):
    """A `TCPStore` client whose blocking reads also end when `abort_check(key)` gives a reason."""

    def __init__(self, host: str, port: int, timeout: timedelta) -> None:
        super().__init__()  # required by the pybind trampoline
        self.inner = client(host, port, timeout.total_seconds())
        self.abort_check: Callable[[str], str | None] | None = None
        self.set_timeout(timeout)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key], self.timeout)
        return self.inner.get(key)

    def add(self, key: str, num: int) -> int:
        return self.inner.add(key, num)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self.inner.compare_set(key, expected_value, desired_value)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    # The C++ trampoline looks these two up by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(keys, timeout if timeout is not None else self.timeout)

    def _wait(self, keys: list[str], timeout: timedelta) -> None:
        if self.abort_check is None:
            self.inner.wait(keys, timeout)
            return
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = deadline - time.monotonic()
            try:
                self.inner.wait(keys, timedelta(seconds=max(0.001, min(ABORT_CHECK_S, left))))
                return
            except dist.DistStoreError:
                if time.monotonic() >= deadline:
                    raise LookupError(f"timed out waiting for keys {keys} in the job's store") from None
            check = self.abort_check
            reason = check(keys[0]) if check is not None else None
            if reason is not None:
                raise LookupError(f"gave up waiting for {keys} in the job's store: {reason}")
