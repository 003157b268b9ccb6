"""CheckpointManager: background uploads, latest pointer, retries through an S3 outage, bounded
memory, retention, restore with fallback. Real S3 API (moto_server on 127.0.0.1) where it matters."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
from structlog.testing import capture_logs

from elasticyolo.checkpoint import CheckpointManager, list_manifests, open_store, read_latest, restore_latest
from elasticyolo.checkpoint.adaptive import YoungDaly
from support.checkpoint_faults import CrashingSerializer, CrashingStore, GatedSerializer, TruncatingStore
from elasticyolo.local_cluster.servers import S3Server, free_port
from elasticyolo.local_cluster.wait import wait_for

torch = pytest.importorskip("torch")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def fake_ckpt(step: int, *, nbytes: int = 64 * 1024, epoch: int = 0, epoch_end: bool = False) -> dict[str, Any]:
    """Same top-level shape as a real checkpoint, small tensors (fast)."""
    g = torch.Generator().manual_seed(step)
    return {
        "epoch": epoch - 1, "model": None, "optimizer": {"state": {0: {"exp_avg": torch.randn(8, generator=g)}},
                                                         "param_groups": [{"lr": 0.01, "params": [0]}]},
        "version": "8.4.test",
        "elasticyolo": {"global_step": step, "epoch": epoch, "epoch_step": step, "epoch_end": epoch_end,
                        "world_size": 2, "policy": "linear", "torch_version": torch.__version__,
                        "payload": torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g)},
    }


@pytest.fixture
def s3env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def bucket(s3env: S3Server, request: pytest.FixtureRequest) -> str:
    name = "mg-" + re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def fast_manager(store: Any, job: str, **kw: Any) -> CheckpointManager:
    opts: dict[str, Any] = dict(save_period_steps=10, save_period_s=0, keep_last=3, retry_initial_s=0.1,
                                retry_max_s=0.5)
    opts.update(kw)
    return CheckpointManager(store, job, **opts)


def steps_of(store: Any, job: str) -> list[int]:
    return [m.step for m in list_manifests(store, job)]


def test_round_trip_s3_and_layout(bucket: str) -> None:
    store = open_store(f"s3://{bucket}/runs")
    with fast_manager(store, "job1") as mgr:
        assert not mgr.maybe_save(5, 0, lambda: fake_ckpt(5))  # not due
        assert mgr.maybe_save(10, 0, lambda: fake_ckpt(10))
        assert not mgr.maybe_save(10, 0, lambda: fake_ckpt(10))  # never twice for one step
        assert mgr.wait(20)
        assert mgr.maybe_save(13, 0, lambda: fake_ckpt(13, epoch_end=True), epoch_end=True)
        assert mgr.wait(20)
        st = mgr.status()
        assert st["last"]["step"] == 13 and st["last"]["size"] > 64 * 1024 and st["consecutive_failures"] == 0
    keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"])
    assert "runs/job1/latest.json" in keys and len(keys) == 5
    assert all(re.match(r"runs/job1/(ckpt/\d{12}-\d{13}-[0-9a-f]{8}\.pt|manifests/\d{12}-\d{13}-[0-9a-f]{8}\.json"
                        r"|latest\.json)$", k) for k in keys)
    latest = read_latest(store, "job1")
    assert latest is not None and latest.step == 13 and latest.epoch_end and latest.world_size == 2
    assert latest.policy == "linear" and latest.ultralytics_version == "8.4.test" and len(latest.sha256) == 64
    restored = restore_latest(store, "job1")
    assert restored is not None
    ckpt, manifest = restored
    assert manifest.step == 13
    assert torch.equal(ckpt["optimizer"]["state"][0]["exp_avg"], fake_ckpt(13)["optimizer"]["state"][0]["exp_avg"])
    assert restore_latest(store, "other-job") is None


class TcpProxy:
    """Loopback TCP proxy in front of moto: stop() makes S3 unreachable (and cuts uploads in
    flight) while moto keeps its data; start() brings it back on the same port."""

    def __init__(self, target: int) -> None:
        self.target, self.port = target, free_port()
        self.bytes_per_s: float | None = None
        self.sent = 0  # bytes forwarded towards S3 (uploads)
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self._sock = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def stop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() thread, frees the port
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self._conns.clear()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                client, _ = s.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, throttle: bool) -> None:
        try:
            while data := src.recv(65536):
                if throttle and self.bytes_per_s:
                    time.sleep(len(data) / self.bytes_per_s)  # the bandwidth limit itself
                dst.sendall(data)
                if throttle:
                    self.sent += len(data)
        except OSError:
            pass
        finally:
            for c in (src, dst):
                try:
                    c.close()
                except OSError:
                    pass


@pytest.fixture
def proxy(s3env: S3Server) -> Iterator[TcpProxy]:
    p = TcpProxy(s3env.port)
    p.start()
    yield p
    p.stop()


def test_s3_outage_during_upload(bucket: str, proxy: TcpProxy) -> None:
    direct = open_store(f"s3://{bucket}")  # straight to moto, for looking at the bucket during the outage
    store = open_store(f"s3://{bucket}", endpoint_url=proxy.url, retries=2, retry_max_delay_s=2,
                       connect_timeout=1, read_timeout=3)
    mgr = fast_manager(store, "job")
    assert mgr.maybe_save(10, 0, lambda: fake_ckpt(10)) and mgr.wait(20)

    proxy.bytes_per_s = 2e6  # ~2 s for the next upload, so the outage hits it mid-way
    t0 = time.perf_counter()
    assert mgr.maybe_save(20, 0, lambda: fake_ckpt(20, nbytes=4_000_000))
    assert time.perf_counter() - t0 < 0.5  # the caller only paid for the snapshot
    wait_for(lambda: mgr.status()["uploading_step"] == 20, 15, "the step-20 upload to start")
    sent = proxy.sent
    wait_for(lambda: proxy.sent - sent >= 500_000, 15, "the step-20 upload to be part-way through")
    proxy.stop()  # S3 gone, upload in flight
    wait_for(lambda: mgr.failures >= 2, 15, "two failed upload attempts")
    t0 = time.perf_counter()
    for step in range(21, 30):  # training goes on, never waits
        assert not mgr.maybe_save(step, 0, lambda: fake_ckpt(step))
    assert time.perf_counter() - t0 < 0.1
    latest = read_latest(direct, "job")
    assert latest is not None and latest.step == 10  # still the previous good checkpoint
    assert steps_of(direct, "job") == [10]
    assert "uploading_step" in mgr.status() and mgr.status()["last"]["step"] == 10

    proxy.bytes_per_s = None
    proxy.start()  # S3 back: the retry lands
    assert mgr.wait(30)
    assert read_latest(direct, "job").step == 20  # type: ignore[union-attr]
    assert mgr.maybe_save(30, 0, lambda: fake_ckpt(30)) and mgr.wait(20)  # and the next one too
    assert steps_of(direct, "job") == [10, 20, 30] and mgr.failures == 0
    restored = restore_latest(direct, "job")
    assert restored is not None and restored[1].step == 30
    mgr.close()


def test_s3_server_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 server process itself stops and a new one comes up on the same port."""
    first = S3Server().start()
    for k, v in first.env().items():
        monkeypatch.setenv(k, v)
    boto3.client("s3").create_bucket(Bucket="restart")
    store = open_store("s3://restart", retries=2, retry_max_delay_s=2, connect_timeout=1)
    mgr = fast_manager(store, "job")
    try:
        assert mgr.maybe_save(10, 0, lambda: fake_ckpt(10)) and mgr.wait(20)
        first.stop()
        assert mgr.maybe_save(20, 0, lambda: fake_ckpt(20))
        wait_for(lambda: mgr.failures >= 1, 15, "a failed upload attempt")
        second = S3Server(port=first.port).start()
        try:
            boto3.client("s3").create_bucket(Bucket="restart")  # a fresh moto has no data
            assert mgr.wait(30)
            assert read_latest(store, "job").step == 20  # type: ignore[union-attr]
        finally:
            mgr.close(5)
            second.stop()
    finally:
        first.stop()


def test_corrupt_newest_falls_back(bucket: str) -> None:
    store = open_store(f"s3://{bucket}/p")
    with fast_manager(store, "job") as mgr:
        for step in (10, 20):
            assert mgr.maybe_save(step, 0, lambda: fake_ckpt(step)) and mgr.wait(20)
    newest = list_manifests(store, "job")[-1]
    s3 = boto3.client("s3")
    body = bytearray(s3.get_object(Bucket=bucket, Key=f"p/{newest.key}")["Body"].read())
    body[len(body) // 2] ^= 0xFF  # flip bytes in the stored object
    body[100] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=f"p/{newest.key}", Body=bytes(body))
    with capture_logs() as logs:
        restored = restore_latest(store, "job")
    assert restored is not None and restored[1].step == 10
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0]["step"] == 20 and "sha256" in skipped[0]["reason"]
    assert any(e["event"] == "checkpoint_restored" and e["fallback"] and e["step"] == 10 for e in logs)
    # a missing object is skipped the same way
    s3.delete_object(Bucket=bucket, Key=f"p/{newest.key}")
    with capture_logs() as logs:
        assert restore_latest(store, "job")[1].step == 10  # type: ignore[index]
    assert any("missing" in e.get("reason", "") for e in logs)


def test_half_written_never_becomes_latest(tmp_path: Path) -> None:
    store = TruncatingStore(tmp_path / "store", tmp_path / "bad")
    mgr = fast_manager(store, "job", retry_initial_s=0.3)
    assert mgr.maybe_save(10, 0, lambda: fake_ckpt(10)) and mgr.wait(10)
    store.set_bad(2)
    assert mgr.maybe_save(20, 0, lambda: fake_ckpt(20))
    wait_for(lambda: mgr.failures >= 1, 15, "a failed upload attempt")
    assert read_latest(store, "job").step == 10 and steps_of(store, "job") == [10]  # type: ignore[union-attr]
    assert "VerifyError" in (mgr.last_error or "")
    assert mgr.wait(20)
    assert read_latest(store, "job").step == 20  # type: ignore[union-attr]
    assert restore_latest(store, "job")[1].step == 20  # type: ignore[index]
    mgr.close()


def test_at_most_one_pending(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    store = open_store(f"file://{tmp_path}/store")
    mgr = fast_manager(store, "job", serializer=GatedSerializer(gate))
    for step in (10, 20, 30, 40, 50):
        assert mgr.maybe_save(step, 0, lambda: fake_ckpt(step))
        wait_for(lambda: mgr.status()["uploading_step"] == 10, 15, "the step-10 upload to start")
    st = mgr.status()
    assert st["uploading_step"] == 10 and st["pending_step"] == 50 and st["superseded"] == 3
    gate.touch()
    assert mgr.wait(20)
    assert steps_of(store, "job") == [10, 50]
    mgr.close()


def test_uploader_dying_mid_serialization(tmp_path: Path) -> None:
    # The uploader serializes straight from the shared-memory slot, so a snapshot survives its
    # death until serialized: sent again once, dropped if the new uploader dies on it too.
    counter = tmp_path / "crashes"
    store = open_store(f"file://{tmp_path}/store")
    with fast_manager(store, "job", serializer=CrashingSerializer(counter)) as mgr:
        counter.write_text("1")
        assert mgr.maybe_save(10, 0, lambda: fake_ckpt(10))
        assert mgr.wait(30) and steps_of(store, "job") == [10] and counter.read_text() == "0"
        counter.write_text("2")
        assert mgr.maybe_save(20, 0, lambda: fake_ckpt(20))
        wait_for(lambda: mgr.superseded == 1, 15, "the crashed snapshot to be let go")
        assert counter.read_text() == "0" and steps_of(store, "job") == [10]  # died twice, then let go
        assert mgr.maybe_save(30, 0, lambda: fake_ckpt(30))
        assert mgr.wait(30) and steps_of(store, "job") == [10, 30]


def test_uploader_dying_mid_upload(tmp_path: Path) -> None:
    # The upload reads the tensors' bytes from the slot, so the uploader holds it until the
    # upload is over: a snapshot whose upload it died in is still there, sent again and lands.
    counter = tmp_path / "crashes"
    store = CrashingStore(tmp_path / "store", counter)
    with fast_manager(store, "job") as mgr:
        counter.write_text("1")
        assert mgr.maybe_save(10, 0, lambda: fake_ckpt(10))
        assert mgr.wait(30) and counter.read_text() == "0" and steps_of(store, "job") == [10]
    got = restore_latest(store, "job")  # the whole object, its sha256 checked
    payload = fake_ckpt(10)["elasticyolo"]["payload"]
    assert got is not None and got[1].step == 10 and torch.equal(got[0]["elasticyolo"]["payload"], payload)


def test_retention_goes_by_names_and_asks_only_about_victims() -> None:
    from elasticyolo.checkpoint.catalog import retention_victims

    n10, n20, n30, n40 = (f"{s:012d}-{1000 + s:013d}-aaaaaaaa" for s in (10, 20, 30, 40))
    assert retention_victims([n30, n10, n40, n20], 2) == [n10, n20]  # names sort in training order
    asked: list[str] = []

    def epoch_end(name: str) -> bool:
        asked.append(name)
        return name == n10

    assert retention_victims([n30, n10, n40, n20], 2, epoch_end, protect={n20}) == []
    assert asked == [n10]  # the newest two and the latest pointer's are never read


def test_retention(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    orphan = tmp_path / "job" / "ckpt" / "000000000001-0000000000000-deadbeef.pt"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"half")
    os.utime(orphan, (time.time() - 7200, time.time() - 7200))
    with fast_manager(store, "job", keep_last=2, keep_epochs=True) as mgr:
        for step in range(10, 80, 10):
            end = step in (20, 40)
            assert mgr.maybe_save(step, step // 20, lambda: fake_ckpt(step, epoch=step // 20, epoch_end=end),
                                  epoch_end=end)
            assert mgr.wait(10)
    assert steps_of(store, "job") == [20, 40, 60, 70]
    assert len(list(store.list("job/ckpt/"))) == 4 and not orphan.exists()
    assert json.loads((tmp_path / "job" / "latest.json").read_text())["step"] == 70


def test_prune_after_an_upload_skips_what_the_uploader_knows(tmp_path: Path) -> None:
    """The uploader's prune after each checkpoint: the latest pointer's name comes from the
    upload (latest.json is not read again) and orphans are looked for only now and then."""
    from elasticyolo.checkpoint import catalog

    store = open_store(f"file://{tmp_path}")
    with fast_manager(store, "job", keep_last=5) as mgr:
        for step in (10, 20, 30):
            assert mgr.maybe_save(step, 0, lambda: fake_ckpt(step), force=True) and mgr.wait(10)
    names = [m.name for m in list_manifests(store, "job")]
    orphan = tmp_path / "job" / "ckpt" / "000000000001-0000000000000-deadbeef.pt"
    orphan.write_bytes(b"half")
    os.utime(orphan, (time.time() - 7200, time.time() - 7200))
    (tmp_path / "job" / "latest.json").unlink()  # would protect nothing if it were read

    got = catalog.prune(store, "job", keep_last=1, keep_epochs=False, latest_name=names[0], orphans=False)
    assert sorted(got.manifests) == [f"job/manifests/{names[1]}.json"] and orphan.exists()
    assert [m.name for m in list_manifests(store, "job")] == [names[0], names[2]]
    catalog.prune(store, "job", keep_last=1, keep_epochs=False, latest_name=names[0])
    assert not orphan.exists()


def test_due_and_adaptive() -> None:
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    store = open_store("file:///nonexistent-never-written")
    mgr = CheckpointManager(store, "j", save_period_steps=100, save_period_s=60, start_step=250, clock=clock)
    assert mgr.due(299) is None and mgr.due(300) == "period_steps"  # multiples of the period
    assert mgr.due(260, epoch_end=True) == "epoch_end" and mgr.due(251, force=True) == "forced"
    now[0] += 61
    assert mgr.due(251) == "period_s"
    off = CheckpointManager(store, "j", save_period_steps=0, save_period_s=0, clock=clock)
    now[0] += 1e6
    assert off.due(10**6) is None

    yd = YoungDaly(mtbf_prior_s=3600, min_s=1, max_s=10_000, upload_share=0.0, clock=clock)
    assert yd.interval_s() == 1  # no cost measured yet: checkpoint early
    yd.observe_cost(snapshot_s=0.5, upload_s=2.0)
    assert yd.interval_s() == pytest.approx((2 * 0.5 * 3600) ** 0.5)  # sqrt(2 C MTBF) = 60 s
    yd2 = YoungDaly(mtbf_prior_s=100, prior_weight=1, min_s=1, upload_share=0.0, clock=clock)
    now[0] += 900  # 900 s observed with 4 losses: MTBF = (100 + 900) / 5 = 200 s
    yd2.observe_preemption(4)
    assert yd2.mtbf_s() == pytest.approx(200)
    yd2.observe_cost(snapshot_s=0.05, upload_s=30.0)
    assert yd2.interval_s() == pytest.approx(30.0)  # never faster than an upload takes


def test_latest_never_moves_back_for_a_stale_writer(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    store = open_store(f"file://{tmp_path}/store")
    stale = fast_manager(store, "job", serializer=GatedSerializer(gate))  # an old rank 0, still uploading
    assert stale.maybe_save(20, 0, lambda: fake_ckpt(20))
    with fast_manager(store, "job", start_step=40) as new:  # the new rank 0 after a resize
        assert new.maybe_save(50, 0, lambda: fake_ckpt(50)) and new.wait(10)
    with capture_logs() as logs:
        gate.touch()
        assert stale.wait(10)
    assert read_latest(store, "job").step == 50  # type: ignore[union-attr]
    assert steps_of(store, "job") == [20, 50] and any(e["event"] == "checkpoint_latest_kept" for e in logs)
    stale.close()
    # A pointer older than the snapshot (e.g. at a corrupt checkpoint we restored around) does move.
    with fast_manager(store, "job", start_step=20) as again:
        assert again.maybe_save(30, 0, lambda: fake_ckpt(30)) and again.wait(10)
    assert read_latest(store, "job").step == 30  # type: ignore[union-attr]


def test_failed_snapshot_skips_one_checkpoint(tmp_path: Path) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("CUDA out of memory (pinned)")

    with fast_manager(open_store(f"file://{tmp_path}"), "job") as mgr:
        assert not mgr.maybe_save(10, 0, broken)  # logged, training goes on
        assert "out of memory" in (mgr.last_error or "")
        assert not mgr.maybe_save(11, 0, lambda: fake_ckpt(11))  # not retried every step
        assert mgr.maybe_save(20, 0, lambda: fake_ckpt(20)) and mgr.wait(10)
