"""CUDA graphs for the model's forward and backward (`train/graphs.py`), stepped on a CPU through a
stand-in capture with the real one's buffer semantics (`tests/support/static_graphs.py`): the training
it gives equals eager training, gradients accumulate across micro-batches, BatchNorm's statistics
survive the capture, a layout change captures again, and a capture that fails or disagrees with
the eager model leaves training eager. What a CPU can say about the real capture: the captured
part makes no host-synchronising call (one would make capture fail, and training eager). Whether
real graphs pay is `bench/throughput.py`'s question, on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs
from torch.utils._python_dispatch import TorchDispatchMode

torch = pytest.importorskip("torch")

import elasticyolo.train  # noqa: E402,F401  (offline Ultralytics)
from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.errors import UserError  # noqa: E402
from elasticyolo.spec import TrainSpec  # noqa: E402
from support.static_graphs import static_buffer_capture  # noqa: E402
from elasticyolo.train.core import TrainCore  # noqa: E402
from elasticyolo.train.graphs import GraphedForward, wants_cuda_graphs  # noqa: E402
from elasticyolo.train.layout import apply_layout  # noqa: E402

IMGSZ, BATCH = 64, 2

# Operators that read a device value on the host (or size their output by one): each would stop
# a CUDA graph capture.
HOST_SYNCS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
              "is_nonzero", "equal", "repeat_interleave", "bincount", "histc"}


class SyncSpy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_SYNCS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", ["yolov8n.yaml", "yolo11n.yaml", "yolo26n.yaml"])
def test_the_captured_part_never_waits_for_the_device(model: str) -> None:
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    net = DetectionModel(model, nc=3, verbose=False)
    net.args = get_cfg()
    net.train()
    x = torch.rand(BATCH, 3, IMGSZ, IMGSZ)
    with SyncSpy() as spy:
        outs = [t for t in torch.utils._pytree.tree_flatten(net(x))[0] if t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    assert spy.seen == []
    # The control: the loss, which stays eager, does wait (its target assignment sizes tensors by the boxes).
    batch = {"img": x, "batch_idx": torch.tensor([0.0, 1.0]), "cls": torch.zeros(2, 1),
             "bboxes": torch.tensor([[0.5, 0.5, 0.3, 0.3]] * 2)}
    with SyncSpy() as spy:
        net.loss(batch, net(x))
    assert spy.seen


def test_the_switch() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert wants_cuda_graphs(cuda, None) and not wants_cuda_graphs(cpu, None)
    assert not wants_cuda_graphs(cuda, False) and not wants_cuda_graphs(cpu, False)
    with pytest.raises(UserError, match="cuda_graphs=true needs a CUDA device"):
        wants_cuda_graphs(cpu, True)
    with pytest.raises(UserError, match="cuda_graphs"):
        TrainSpec.from_pairs(["data=x.yaml", "cuda_graphs=maybe"])
    assert TrainSpec.from_pairs(["data=x.yaml", "cuda_graphs=false"]).cuda_graphs is False


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> TrainSpec:
    data = write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=12, val=2, imgsz=IMGSZ, classes=2))
    # nbs 4 = two micro-batches per step: gradients accumulate across replays.
    return TrainSpec.from_pairs([f"data={data}", f"imgsz={IMGSZ}", f"batch={BATCH}", "nbs=4", "workers=0",
                                 "epochs=2", "warmup_epochs=0", "optimizer=SGD", "val=false", "device=cpu",
                                 "seed=3"])


def _graphed(core: TrainCore, capture=static_buffer_capture) -> GraphedForward:
    core.forward = GraphedForward(core.model, enabled=True, amp=False, shape=(BATCH, 3, IMGSZ, IMGSZ), capture=capture)
    return core.forward


def _assert_same_state(a: TrainCore, b: TrainCore) -> None:
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-6), name


def test_graphed_training_equals_eager_training(spec: TrainSpec, tmp_path: Path) -> None:
    eager, graphed = TrainCore(spec, work_dir=tmp_path / "e"), TrainCore(spec, work_dir=tmp_path / "g")
    forward = _graphed(graphed)
    buffers = [b.clone() for b in graphed.model.buffers()]
    rng = torch.get_rng_state()
    graphed.warm_up()  # a joining worker's pre-warm captures; it and the capture leave no trace
    assert torch.equal(rng, torch.get_rng_state())
    assert forward.live and forward.captures == 1
    assert all(torch.equal(a, b) for a, b in zip(buffers, graphed.model.buffers()))
    # 12 images, 2 per micro-batch, 2 micro-batches per step: 3 steps an epoch, into the second epoch.
    for _ in range(4):
        eager.end_epoch_if_done(), graphed.end_epoch_if_done()
        r_e, r_g = eager.train_step(), graphed.train_step()
        assert r_e.micro_batches == r_g.micro_batches == 2
        assert r_g.loss == pytest.approx(r_e.loss, rel=1e-4)
        _assert_same_state(eager, graphed)
    assert forward.captures == 1
    # Gradients were zeroed in place, not dropped: the next replay adds into them.
    assert all(p.grad is not None and not p.grad.any() for p in graphed.model.parameters() if p.requires_grad)


def test_without_existing_gradients_a_replay_overwrites_the_accumulated_one(spec: TrainSpec, tmp_path: Path) -> None:
    """Why GraphedForward gives every parameter a gradient first: the hazard, shown with the
    stand-in's buffers. Without it, autograd adopts the replay's buffer as `.grad` and the
    second micro-batch's replay writes over the first one's gradient."""
    core = TrainCore(spec, work_dir=tmp_path / "h")
    replay = static_buffer_capture(torch.nn.Sequential(core.model), torch.rand(BATCH, 3, IMGSZ, IMGSZ))
    trainable = [p for p in core.model.parameters() if p.requires_grad]
    x1, x2 = torch.rand(BATCH, 3, IMGSZ, IMGSZ), torch.rand(BATCH, 3, IMGSZ, IMGSZ)

    def objective(preds) -> torch.Tensor:
        return sum(t.float().square().mean() for t in torch.utils._pytree.tree_flatten(preds)[0])

    def accumulated(forward, preset: bool) -> list[torch.Tensor]:
        for p in trainable:
            p.grad = torch.zeros_like(p) if preset else None
        for x in (x1, x2):
            objective(forward(x)).backward()
        return [p.grad.clone() for p in trainable]

    want = accumulated(core.model, preset=False)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(accumulated(replay, preset=True), want))
    adopted = accumulated(replay, preset=False)
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(adopted, want))


def test_a_layout_change_captures_again(spec: TrainSpec, tmp_path: Path) -> None:
    core = TrainCore(spec, work_dir=tmp_path / "l")
    forward = _graphed(core)
    core.train_step()
    assert forward.captures == 1
    apply_layout([core.model], True)  # what Horovod's NCHW broadcasts undo and redo: the tensors move
    core.train_step()
    assert forward.captures == 2 and forward.live
    bn = next(m for m in core.model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    bn.running_mean = bn.running_mean.clone()  # a buffer replaced, not copied into
    core.train_step()
    assert forward.captures == 3 and forward.live
    core.train_step()
    assert forward.captures == 3


def test_short_batches_and_eval_run_eagerly(spec: TrainSpec, tmp_path: Path) -> None:
    calls: list[tuple[int, ...]] = []

    def counting(body, sample):
        replay = static_buffer_capture(body, sample)

        def call(x):
            calls.append(tuple(x.shape))
            return replay(x)
        return call

    core = TrainCore(spec, work_dir=tmp_path / "s")
    forward = _graphed(core, counting)
    core.model.train()
    forward(torch.rand(BATCH - 1, 3, IMGSZ, IMGSZ))
    assert forward.captures == 0 and not calls
    forward(torch.rand(BATCH, 3, IMGSZ, IMGSZ))
    n = len(calls)  # the capture's own check replays too
    assert forward.captures == 1 and n >= 1
    core.model.eval()
    with torch.no_grad():
        forward(torch.rand(BATCH, 3, IMGSZ, IMGSZ))
    assert len(calls) == n


@pytest.mark.parametrize("fault", ["raises", "disagrees"])
def test_a_failed_or_wrong_capture_trains_eagerly(spec: TrainSpec, tmp_path: Path, fault: str) -> None:
    def broken(body, sample):
        if fault == "raises":
            raise RuntimeError("operation not permitted when stream is capturing")
        replay = static_buffer_capture(body, sample)
        return lambda x: torch.utils._pytree.tree_map(lambda t: t * 1.5, replay(x))

    eager, core = TrainCore(spec, work_dir=tmp_path / "e"), TrainCore(spec, work_dir=tmp_path / "b")
    forward = _graphed(core, broken)
    buffers = [b.clone() for b in core.model.buffers()]
    with capture_logs() as logs:
        core.train_step()
    eager.train_step()
    assert not forward.live and not forward.enabled and forward.captures == 1
    reason = {"raises": "RuntimeError: operation not permitted", "disagrees": "graphed outputs differ"}[fault]
    assert [e["reason"][:len(reason)] for e in logs if e["event"] == "cuda_graphs_off"] == [reason]
    _assert_same_state(eager, core)  # the failed capture left no trace; the step ran eagerly
    assert not all(torch.equal(a, b) for a, b in zip(buffers, core.model.buffers()))  # it did train
