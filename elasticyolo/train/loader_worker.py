"""The loader's processes, and the batch building they share with the training process.

A request names a dataset ("train", "val"), the sample indices and a transform variant ("" or
"closed_mosaic"). The variant travels with each request instead of being switched in the
dataset once, so a prefetch that crosses into the epoch where mosaic closes, followed by a
rollback to before it, still gets each batch's transforms right.

Process layout: the training process starts one *host* from the fork server (`elasticyolo.mp`)
and hands it the datasets once; the host (single-threaded, so forking it is safe) forks the
workers, which share the datasets copy-on-write (as torch's fork workers do) instead of each
unpickling its own copy. The host watches its workers and reports a death to the training
process, which then replaces the whole pool (fresh queues: a worker killed while holding a
queue's lock must not stall the others).

Imported by the fork server, so it imports what unpickling a dataset needs.
"""

from __future__ import annotations

import copy
import os
import pickle
import queue
import random
import signal
import traceback
import zlib
from typing import Any, Mapping, Sequence

import elasticyolo.train  # noqa: F401  (offline Ultralytics before it is imported)
import numpy as np
import torch

import ultralytics.data.dataset  # noqa: F401  (the classes a pickled dataset needs, imported once)

CLOSED_MOSAIC = "closed_mosaic"


class BatchBuilder:
    """Builds the batch for one request: `dataset.collate_fn([dataset[i] ...])` plus the indices.

    With a seed, each sample's augmentation draws are seeded by (request seed, sample index). The
    training plan's seed depends on the epoch only (`TrainCore._train_plan`), so a sample is
    augmented the same way whichever process builds it, at any world size, rank or position in
    the epoch, and again after a rollback: an elastic run trains what an uninterrupted one
    would. Except for one draw without `cache=ram`: Ultralytics' mosaic then picks its partner
    images from the dataset's buffer of recently loaded images (they are in memory; decoding
    random ones would cost 3 more image reads per sample), whose content depends on history.
    With `cache=ram` it picks them from the whole dataset. `keep_rng` (the training process)
    restores the global RNGs afterwards."""

    def __init__(self, datasets: Mapping[str, Any], hyp: Any, keep_rng: bool = False) -> None:
        self.datasets = dict(datasets)
        self.hyp = hyp
        self.keep_rng = keep_rng
        self._transforms: dict[tuple[str, str], Any] = {}
        self._variant: dict[str, str] = {name: "" for name in self.datasets}

    def add(self, name: str, dataset: Any) -> None:
        self.datasets[name] = dataset
        self._variant[name] = ""

    def build(self, dataset: str, indices: Sequence[int], variant: str = "", seed: int | None = None
              ) -> dict[str, Any]:
        ds = self.datasets[dataset]
        self._use(dataset, ds, variant)
        if seed is None:
            batch = ds.collate_fn([ds[i] for i in indices])
        elif self.keep_rng:
            py, npy = random.getstate(), np.random.get_state()
            try:
                with torch.random.fork_rng(devices=[]):
                    batch = ds.collate_fn(self._seeded(ds, indices, seed))
            finally:
                random.setstate(py)
                np.random.set_state(npy)
        else:
            batch = ds.collate_fn(self._seeded(ds, indices, seed))
        batch["indices"] = list(indices)
        return batch

    @staticmethod
    def _seeded(ds: Any, indices: Sequence[int], seed: int) -> list[Any]:
        items = []
        for i in indices:
            seed_everything(request_seed(seed, i))
            items.append(ds[i])
        return items

    def _use(self, name: str, ds: Any, variant: str) -> None:
        current = self._variant[name]
        if current == variant:
            return
        self._transforms.setdefault((name, current), ds.transforms)
        if (name, variant) not in self._transforms:
            if variant != CLOSED_MOSAIC:
                raise ValueError(f"unknown transform variant {variant!r}")
            ds.close_mosaic(copy.copy(self.hyp))  # rebuilds ds.transforms; the copy leaves our hyp as is
            self._transforms[(name, variant)] = ds.transforms
        ds.transforms = self._transforms[(name, variant)]
        self._variant[name] = variant


def request_seed(base: int, key: Any) -> int:
    """A seed for one request, the same in every process (not Python's salted str hash)."""
    return zlib.crc32(repr((base, key)).encode()) ^ (base & 0xFFFFFFFF)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)  # the CPU generator only (never a CUDA one)


# ---- the worker --------------------------------------------------------------------------------
def worker_loop(worker_id: int, builder: BatchBuilder, tasks: Any, results: Any, floors: Any, seed: int,
                watch: Any) -> None:
    """Serve requests until told to stop (None) or orphaned.

    A task is (seq, stream, dataset, indices, variant, seed). `floors[stream]` is the lowest sequence
    number the training process still wants for that stream: anything below it was discarded
    (a reset, rollback or resize restarted the plan), so it is skipped without being built."""
    seed_everything(seed)
    results.put(("ready", worker_id, os.getpid()))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if not watch.alive():
                return
            continue
        if task is None:
            return
        seq, stream, dataset, indices, variant, batch_seed = task
        if seq < floors[stream]:
            continue  # stale: the plan it belonged to was replaced
        try:
            batch = builder.build(dataset, indices, variant, batch_seed)
        except Exception:  # noqa: BLE001 - reported to the training process, which raises it
            results.put(("batch", seq, stream, None,
                         f"loader worker {worker_id} (pid {os.getpid()}):\n{traceback.format_exc()}"))
            continue
        results.put(("batch", seq, stream, batch, None))


# ---- the host ----------------------------------------------------------------------------------
def host_main(payload: bytes, workers: int, tasks: Any, results: Any, floors: Any, seed: int, conn: Any) -> None:
    """Unpickle the datasets once, fork `workers` workers, report any that dies, stop on "stop"."""
    from elasticyolo.mp import ParentWatch, single_threaded

    single_threaded()
    watch = ParentWatch()  # polled: the host stays single-threaded, it forks
    datasets, hyp = pickle.loads(payload)
    builder = BatchBuilder(datasets, hyp)
    children: dict[int, int] = {}  # pid -> worker id

    def stop_children(*_: Any) -> None:
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        children.clear()

    def on_term(*_: Any) -> None:
        stop_children()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    for wid in range(workers):
        pid = os.fork()  # this process has no threads: a plain fork is safe here
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = 0
            try:
                watch = ParentWatch()  # the owner (the training process) and the host
                watch.exit_with_owner()
                worker_loop(wid, builder, tasks, results, floors, seed + wid * 7_919, watch)
            except BaseException:  # noqa: BLE001 - the host reports the exit code
                traceback.print_exc()
                code = 1
            finally:
                try:
                    results.close()
                    results.join_thread()  # flush what this worker put
                finally:
                    os._exit(code)
        children[pid] = wid
    try:
        while True:
            if conn.poll(0.5):
                try:
                    if conn.recv() == "stop":
                        return
                except EOFError:
                    return
            if not watch.alive():
                return
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                wid = children.pop(pid, -1)
                conn.send(("died", wid, pid, os.waitstatus_to_exitcode(status)))
    finally:
        stop_children()
