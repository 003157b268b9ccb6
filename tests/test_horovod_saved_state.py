"""Horovod's rollback point kept in reused buffers (engines/horovod/saved_state.py): a restore
brings back exactly the saved model and optimizer, a second save writes into the first one's
tensors, and training after a restore never changes the rollback point."""

from __future__ import annotations

import torch

from elasticyolo.engines.horovod.saved_state import BufferedModelState, BufferedOptimizerState, copy_into


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model.train()
    loss = model(torch.randn(16, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    opt_tensors = [v.clone() for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    return [t.clone() for t in model.state_dict().values()] + opt_tensors


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_restore_returns_to_the_save_and_training_after_it_leaves_the_save_alone() -> None:
    model, opt = make()
    step(model, opt)
    m, o = BufferedModelState(model), BufferedOptimizerState(opt)
    saved = snapshot(model, opt)
    lr_saved = opt.param_groups[0]["lr"]
    step(model, opt)
    opt.param_groups[0]["lr"] = 0.5
    assert not same(snapshot(model, opt), saved)
    m.restore()
    o.restore()
    assert same(snapshot(model, opt), saved) and opt.param_groups[0]["lr"] == lr_saved
    step(model, opt)  # writes into the restored state: must not reach the rollback point
    m.restore()
    o.restore()
    assert same(snapshot(model, opt), saved)


def test_a_save_writes_into_the_last_saves_tensors() -> None:
    model, opt = make()
    step(model, opt)
    m, o = BufferedModelState(model), BufferedOptimizerState(opt)
    before = [id(t) for t in m._saved_model_state.values()]
    opt_before = [id(v) for s in o._saved_optimizer_state["state"].values() for v in s.values()]
    step(model, opt)
    m.save()
    o.save()
    assert [id(t) for t in m._saved_model_state.values()] == before
    assert [id(v) for s in o._saved_optimizer_state["state"].values() for v in s.values()] == opt_before
    step(model, opt)
    expected = snapshot(model, opt)
    m.save()
    o.save()
    step(model, opt)
    m.restore()
    o.restore()
    assert same(snapshot(model, opt), expected)


def test_copy_into_allocates_where_shapes_or_dtypes_differ() -> None:
    saved = {"a": torch.zeros(3), "b": torch.zeros(2), "c": [torch.zeros(1)], "n": 1}
    live = {"a": torch.ones(3), "b": torch.ones(4), "c": [torch.ones(1, dtype=torch.int64)], "n": 2, "new": torch.ones(1)}
    out = copy_into(saved, live)
    assert out["a"] is saved["a"] and torch.equal(out["a"], torch.ones(3))
    assert out["b"] is not live["b"] and torch.equal(out["b"], torch.ones(4))
    assert out["c"][0].dtype == torch.int64 and out["n"] == 2 and out["new"] is not live["new"]
