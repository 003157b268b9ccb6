"""`EtcdProgress` (worker_runtime/progress.py): of one key's records, an older one never overwrites a
newer one, whichever of its writers (the publisher thread, the final flush, checkpoint threads)
gets to etcd last. A fake client: this is the sink's own ordering, not etcd's."""

from __future__ import annotations

import json
import threading
import time

from elasticyolo.cluster.keys import JobKeys
from elasticyolo.worker_runtime.progress import EtcdProgress
from elasticyolo.local_cluster.wait import wait_for


class SlowFirstPut:
    """The first progress put hangs until released (a slow etcd request in flight)."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, dict]] = []
        self.release = threading.Event()
        self.first_started = threading.Event()
        self._first = True

    def put(self, key: str, value: str, lease: int | None = None) -> int:
        if self._first and key.endswith("progress"):
            self._first = False
            self.first_started.set()
            self.release.wait(10)
        self.puts.append((key, json.loads(value)))
        return 1


def step(n: int) -> dict:
    return {"kind": "step", "step": n, "world_size": 1, "samples_per_s": 1.0}


def test_the_final_flush_is_not_overwritten_by_an_older_put_in_flight() -> None:
    client = SlowFirstPut()
    keys = JobKeys("j")
    sink = EtcdProgress(client, keys, rate=1000.0)  # type: ignore[arg-type]
    sink(step(399))
    assert client.first_started.wait(10)  # the publisher is putting 399
    sink(step(400))
    flushing = threading.Thread(target=sink.flush)
    flushing.start()  # the job ends: 400 is flushed while 399's put is still in flight
    wait_for(lambda: sink._latest is None, 10, "the flush to take 400")
    client.release.set()
    flushing.join(10)
    wait_for(lambda: any(rec["step"] == 399 for _, rec in client.puts), 10, "399's put to return")
    progress = [rec["step"] for key, rec in client.puts if key == keys.progress]
    assert progress[-1] == 400, progress


def test_checkpoint_records_land_newest_last() -> None:
    class Recording:
        def __init__(self) -> None:
            self.puts: list[tuple[str, dict]] = []
            self.lock = threading.Lock()
            self.slow_started, self.slow_returned = threading.Event(), threading.Event()

        def put(self, key: str, value: str, lease: int | None = None) -> int:
            rec = json.loads(value)
            if rec.get("step") == 4:
                self.slow_started.set()
                time.sleep(0.3)  # the older checkpoint's put is the slow one: it lasts while the newer one comes
            with self.lock:
                self.puts.append((key, rec))
            if rec.get("step") == 4:
                self.slow_returned.set()
            return 1

    client, keys = Recording(), JobKeys("j")
    sink = EtcdProgress(client, keys)  # type: ignore[arg-type]
    sink({"kind": "checkpoint", "step": 4, "uri": "file:///a"})
    assert client.slow_started.wait(10)  # the older put is in flight
    sink({"kind": "checkpoint", "step": 8, "uri": "file:///b"})
    wait_for(lambda: client.slow_returned.is_set() and any(r["step"] == 8 for _, r in client.puts), 10,
             "the slow older put to return and the newer one to land")
    landed = [rec["step"] for key, rec in client.puts if key == keys.checkpoint_latest]
    assert landed and landed[-1] == 8, landed
