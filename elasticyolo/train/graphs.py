"""The model's training forward and backward replayed as CUDA graphs (`torch.cuda.make_graphed_callables`).

Why: on a GPU the step is paced by the training thread launching kernels, not by the GPU or the
data. On an H200 (yolov8n, imgsz 640, batch 16, AMP) the GPU was busy 25-30 % of the step, for
our loop and for Ultralytics' trainer alike. Per micro-batch the thread dispatches about 1,430
operations (yolov8n, counted on a CPU without autocast, which adds casts; 1,050 that are not
views): the model's forward 331 (317), its backward 459 (226), the loss 422 (322) forward and
about 220 (190) backward. A captured graph launches the model's part as two replays. The loss
stays eager: its target assignment sizes tensors by how many boxes each image has, and reads
them on the host (4 waits for the device per micro-batch).

What a replay assumes, and how it is kept true here:
- The same input shape: only full micro-batches (`batch` images at `imgsz`) replay; an epoch's
  short last batch runs eagerly.
- The same tensors: the graph reads and writes the parameters' and buffers' memory as it was at
  capture. A layout change (`layout.py`, around Horovod's tensor-by-tensor fallback sync) moves
  them, so every call compares their addresses and captures again after a move.
  `load_state_dict` copies in place.
- Gradients that already exist: the backward replay returns its gradients in its own static
  buffers, and autograd *adopts* such a tensor as `.grad` when `.grad` is None. The next replay
  would then overwrite the gradient accumulated so far (pytorch#181723, open). Every graphed
  call first gives each trainable parameter a `.grad`, so autograd adds into it instead; the
  core zeroes gradients in place while a graph is live.
- Capture runs a few warm-up passes, which move BatchNorm's running statistics: they are put back.

Memory: the graphs keep the forward's activations reserved in their own pool, and eager passes
(the capture's check, an epoch's short last batch) use the ordinary pool beside it: up to twice
one micro-batch's activations. The check needs that much right after capture, so where it does
not fit the capture fails and training stays eager (`bench/throughput.py` prints the peak with
and without graphs).

A capture checks itself once against the eager model on a random input (outputs, gradients, and
two backward passes accumulating to twice one). Any error or mismatch logs why and trains eagerly.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from elasticyolo.errors import UserError
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.graphs")

CAPTURE_LOCK = threading.Lock()
"""Held during a capture, and by the loader's thread around pinning a batch: pinned host memory is
allocated and its events queried through CUDA calls that a capture in torch's default ("global")
mode fails on when another thread makes them. Torch versions that take `capture_error_mode`
capture in "thread_local" mode as well."""

Preds = Any  # the model's training output: Ultralytics' dict of boxes, scores and feature maps


class Capture(Protocol):
    def __call__(self, body: nn.Module, sample: torch.Tensor) -> Callable[[torch.Tensor], Preds]: ...


def wants_cuda_graphs(device: torch.device, requested: bool | None) -> bool:
    """`requested` None: on for CUDA. A CPU has nothing to capture, so True there is refused."""
    if requested and device.type != "cuda":
        raise UserError(f"cuda_graphs=true needs a CUDA device (this worker trains on {device}): unset it or use false")
    return device.type == "cuda" if requested is None else requested


class _Body(nn.Module):
    """The model's training forward alone (no loss), as the module to capture. A wrapper, so the
    capture replaces this module's `forward` and the model itself stays untouched.

    Autocast is entered here, inside what is captured, and not around the capture: the backward
    graph is then recorded without autocast, as eager training runs its backward (pytorch#120930).
    Without its weight-cast cache, which would keep capture-time casts across replays (torch
    refuses it)."""

    def __init__(self, model: nn.Module, amp: bool) -> None:
        super().__init__()
        self.model, self.amp = model, amp

    def forward(self, img: torch.Tensor) -> Preds:
        with torch.autocast(img.device.type, enabled=self.amp, cache_enabled=False):
            return self.model(img)


def capture_cuda(body: nn.Module, sample: torch.Tensor) -> Callable[[torch.Tensor], Preds]:
    options: dict[str, Any] = {"allow_unused_input": True}
    if "capture_error_mode" in inspect.signature(torch.cuda.make_graphed_callables).parameters:
        # Only this thread's calls are checked: a snapshot copy or a collective on another thread
        # during a (re)capture must not fail there.
        options["capture_error_mode"] = "thread_local"
    with CAPTURE_LOCK, torch.autocast("cuda", enabled=False):  # the step's own autocast stays outside (_Body)
        graphed = torch.cuda.make_graphed_callables(body, (sample,), **options)
    torch.cuda.synchronize(sample.device)
    return graphed  # its forward now replays while it is in training mode (it always is)


class GraphedForward:
    """Calls the model's training forward: replays the captured graphs where they apply, else eagerly."""

    def __init__(self, model: nn.Module, *, enabled: bool, amp: bool, shape: tuple[int, ...],
                 capture: Capture = capture_cuda) -> None:
        self.model, self.enabled, self.amp, self.shape = model, enabled, amp, tuple(shape)
        self._capture = capture
        self._graphed: Callable[[torch.Tensor], Preds] | None = None
        self._addresses: tuple[int, ...] = ()
        # What a replay reads and writes, found fast on every call (walking the module tree took
        # 0.53 ms for yolov8n, this 0.03): the Parameter objects (a layout change swaps their
        # data), and each module's buffer dict (where a replaced buffer would appear).
        self._params = list(model.parameters())
        self._buffer_dicts = [m._buffers for m in model.modules() if m._buffers]
        self._trainable = [p for p in self._params if p.requires_grad]
        self.captures = 0  # how many times the graphs were captured (a layout change captures again)

    @property
    def live(self) -> bool:
        """A graph is captured and in use: gradients must be zeroed in place, not dropped."""
        return self._graphed is not None

    def __call__(self, img: torch.Tensor) -> Preds:
        if not (self.enabled and self.model.training and tuple(img.shape) == self.shape):
            return self.model(img)
        if self._graphed is None or self._addresses != self._current_addresses():
            self._graphed = None  # stale graphs go first, with their memory pool
            self._prepare(img)
            if self._graphed is None:
                return self.model(img)
        for p in self._trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # see the module's docstring: else autograd adopts the graph's buffer
        return self._graphed(img)

    def _current_addresses(self) -> tuple[int, ...]:
        return (*(p.data_ptr() for p in self._params),
                *(b.data_ptr() for d in self._buffer_dicts for b in d.values() if b is not None))

    def _prepare(self, sample: torch.Tensor) -> None:
        """Capture and check, in training mode (the only mode `__call__` captures in)."""
        saved = _ModelState(self.model)
        try:
            # A fresh wrapper each time: a captured one's forward already replays the old graphs.
            graphed = self._capture(_Body(self.model, self.amp), sample.detach().clone())
            saved.restore()  # the capture's warm-up passes moved BatchNorm's statistics
            mismatch = self._check(graphed, sample)
        except Exception as exc:  # noqa: BLE001 - any failure to capture means eager training, not a crash
            mismatch = f"{type(exc).__name__}: {exc}"
        finally:
            saved.restore()
        self.captures += 1
        if mismatch is not None:
            self.enabled = False
            log.warning("cuda_graphs_off", reason=mismatch.splitlines()[0][:300], note="training eagerly")
            return
        self._graphed, self._addresses = graphed, self._current_addresses()
        log.info("cuda_graphs_captured", shape=list(self.shape), captures=self.captures)

    def _check(self, graphed: Callable[[torch.Tensor], Preds], like: torch.Tensor) -> str | None:
        """Why the graphs disagree with the eager model on a random input shaped `like`, or None:
        outputs, gradients, and two backward passes accumulating into existing gradients."""
        gen = _generator(like.device)
        x = torch.rand(like.shape, device=like.device, generator=gen)  # not the capture's input: any input must agree
        weights: list[torch.Tensor] = []

        def run(forward: Callable[[torch.Tensor], Preds]) -> list[torch.Tensor]:
            with torch.autocast(x.device.type, enabled=self.amp):
                outs = [o for o in tree_flatten(forward(x))[0] if isinstance(o, torch.Tensor)]
            if not weights:
                weights.extend(torch.randn(o.shape, device=o.device, generator=gen) / o.numel() ** 0.5 for o in outs)
            sum((o.float() * w).sum() for o, w in zip(outs, weights)).backward()
            return [o.detach().float().clone() for o in outs]

        def grads() -> list[torch.Tensor]:
            return [p.grad.detach().float().clone() for p in self._trainable]

        def zero() -> None:
            for p in self._trainable:
                p.grad = torch.zeros_like(p)

        zero()
        eager_out = run(self.model)
        eager_grads = grads()
        zero()
        graph_out = run(graphed)
        graph_grads = grads()
        run(graphed)
        twice = grads()
        if len(graph_out) != len(eager_out) or any(a.shape != b.shape for a, b in zip(graph_out, eager_out)):
            return "the graph's outputs differ in number or shape from the model's"
        for what, got, want in (("outputs", graph_out, eager_out), ("gradients", graph_grads, eager_grads),
                                ("accumulated gradients", twice, [2 * g for g in graph_grads])):
            error = _relative_error(got, want)
            if not error <= 1e-2:  # also catches NaN
                return f"graphed {what} differ from eager ones by {error:.3g} (relative)"
        return None


def _generator(device: torch.device) -> torch.Generator:
    """Random inputs of its own, so a capture leaves training's random streams where they were."""
    return torch.Generator(device).manual_seed(0)


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(got, want))
    den = sum(float(b.pow(2).sum()) for b in want)
    return (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))


class _ModelState:
    """The buffers' values and the gradients at one moment, to put back after a capture and its check."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        with torch.no_grad():
            self.buffers = [(b, b.clone()) for b in model.buffers()]
            self.grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]

    def restore(self) -> None:
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)
            for p, grad in self.grads:
                p.grad = grad if grad is None else grad.clone()
