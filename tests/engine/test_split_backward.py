"""A stage's backward split into its input part (I) and its weight part (W): the same gradients as one
whole backward, bit for bit, and W runs none of the input's path again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.engine.model.split_backward import input_part, recomputes, weight_part
from shardwise.engine.run import stage_backward
from shardwise.transforms.pipeline import get_schedule, simulate


class _Counted(torch.autograd.Function):
    """The identity, counting its backward calls (a collective on the input's path in a real stage)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Counted.calls += 1
        return g


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (16, 8), "b1": (16,), "w2": (8, 16), "tied": (8, 8), "ln": (8,), "alone": (8,)}
    return {k: torch.randn(*s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}


def _stage(x: torch.Tensor, p: dict[str, torch.Tensor], remat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Two linears, a weight used twice, a norm's scale, the counted identity on the input's path, and
    a second output that does not depend on the input (a weight's own branch to the outputs)."""

    def body(h: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(h, p["w1"], p["b1"]).tanh()
        h = torch.nn.functional.linear(h, p["w2"])
        h = h @ p["tied"] + (h * 0.5) @ p["tied"].t()
        return torch.nn.functional.layer_norm(h, (8,), p["ln"])

    h = _Counted.apply(x)
    h = checkpoint(body, h, use_reentrant=False) if remat else body(h)
    return h, (p["alone"] * 2.0).sum().expand(3)


def _run(split: bool, remat: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    leaves = {k: v.requires_grad_() for k, v in _weights().items()}
    out, side = _stage(x, leaves, remat)
    outputs = [out, side]
    gen = torch.Generator().manual_seed(2)
    seeds = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outputs]
    _Counted.calls = 0
    if split:
        (dx,), part = input_part(outputs, seeds, [x], list(leaves.values()))
        in_i = _Counted.calls
        weight_part(part)
        assert _Counted.calls == in_i  # W walks none of the input's path again
        assert dx is not None
    else:
        torch.autograd.backward(outputs, seeds, inputs=[x, *leaves.values()])
        dx = x.grad
    return dx, {k: v.grad for k, v in leaves.items()}, _Counted.calls


def test_input_then_weight_part_give_the_whole_backwards_gradients_bit_for_bit() -> None:
    for remat in (False, True):
        dx, grads, calls = _run(split=True, remat=remat)
        dx_whole, grads_whole, calls_whole = _run(split=False, remat=remat)
        assert torch.equal(dx, dx_whole)
        assert grads.keys() == grads_whole.keys()
        for k in grads:
            assert grads[k] is not None and torch.equal(grads[k], grads_whole[k]), (k, remat)
        assert calls == calls_whole == 1


def test_the_weight_part_adds_into_gradients_already_there() -> None:
    """Micro-batch after micro-batch the step's leaves accumulate, as the whole backward accumulates."""
    x = torch.randn(4, 8, dtype=torch.float64).requires_grad_()
    split = {k: v.requires_grad_() for k, v in _weights().items()}
    whole = {k: v.detach().clone().requires_grad_() for k, v in split.items()}
    for _ in range(2):
        outs = list(_stage(x, split))
        seeds = [torch.ones_like(o) for o in outs]
        weight_part(input_part(outs, seeds, [x], list(split.values()))[1])
        outs = list(_stage(x, whole))
        torch.autograd.backward(outs, seeds, inputs=list(whole.values()))
    for k in split:
        assert torch.equal(split[k].grad, whole[k].grad), k


def test_a_stage_whose_weights_all_meet_the_input_path_leaves_nothing_to_the_outputs() -> None:
    x = torch.randn(4, 8, dtype=torch.float64).requires_grad_()
    p = {k: v.requires_grad_() for k, v in _weights().items()}
    out, _ = _stage(x, p)
    _, part = input_part([out], [torch.ones_like(out)], [x], [p[k] for k in ("w1", "b1", "w2", "tied", "ln")])
    assert part.rest == []
    assert sum(len(g.leaves) for g in part.groups) == 5


def test_the_plan_counts_what_the_input_pass_records_for_the_weight_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between a micro-batch's I and its W the gradients recorded at the weights' branches are held:
    the Plan's kept_for_backward under ZB-H1 is GPipe's (as many micro-batches in flight) plus those
    gradients for each of them, as the run records them (stage 1; stage 0 has no input pass)."""
    model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12), nn.Linear(12, 24), nn.Tanh(),
                          nn.Linear(24, 12))
    chain, params = sw.functionalize(model)
    mesh, microbatches = sw.Mesh(pp=2), 2
    batch = (torch.randn(8, 12), torch.randn(8, 12))

    def pipelined(schedule: str) -> sw.Step:
        return sw.pipeline(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "pp", schedule, microbatches)

    recorded: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        got, part = input_part(*args, **kwargs)
        recorded.append(sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                             for group in part.groups for grads in group.grads for g in grads or ()
                             if g is not None}.values()))
        return got, part

    monkeypatch.setattr(stage_backward, "input_part", spy)
    zb = pipelined("zb_h1")

    def run() -> None:
        zb(zb.init(params, mesh), batch)

    sw.launch(run, mesh.size, timeout=60)
    assert len(recorded) == microbatches and len(set(recorded)) == 1 and recorded[0] > 0  # stage 1's I
    # GPipe holds as many micro-batches on each rank as ZB-H1 does here (every one, on both ranks).
    in_flight = simulate(get_schedule("zb_h1", 2, 2, microbatches)).peak_activations
    assert in_flight == simulate(get_schedule("gpipe", 2, 2, microbatches)).peak_activations == (2, 2)
    kept = {s: pipelined(s).plan(mesh, params, batch).memory["kept_for_backward"] for s in ("zb_h1", "gpipe")}
    assert kept["zb_h1"][0] == kept["gpipe"][0]
    assert kept["zb_h1"][1] == kept["gpipe"][1] + in_flight[1] * recorded[0]


def test_a_gradient_hook_on_an_activation_applies_once() -> None:
    """The engine runs a tensor's gradient hook before its node's prehooks: I records the gradient the
    hook shaped, and W, which feeds it back into that node, must not let the hook apply again."""

    def stage(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h.register_hook(lambda g: g * 2)  # a user's layer scaling its gradient
        return h.tanh()

    w = torch.randn(8, 8, dtype=torch.float64).requires_grad_()
    x = torch.randn(4, 8, dtype=torch.float64).requires_grad_()
    seed = torch.randn(4, 8, dtype=torch.float64)
    whole_dx, whole_dw = torch.autograd.grad([stage(x, w)], [x, w], [seed])
    (dx,), part = input_part([stage(x, w)], [seed], [x], [w])
    weight_part(part)
    assert torch.equal(dx, whole_dx) and torch.equal(w.grad, whole_dw)


def test_a_layer_that_recomputes_in_its_backward_takes_its_weight_pass_whole() -> None:
    """A remat region's backward runs its forward again: a pass per weight branch would run it once
    per branch, so such a stage's W is one backward from its outputs (nothing recorded)."""
    chain, _ = sw.functionalize(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    assert not recomputes(layer.fn for layer in step.chain)
    assert recomputes(layer.fn for layer in sw.remat(step).chain)
    forwards = 0

    def region(h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        return (h @ w1).tanh() @ w2

    w1, w2 = (torch.randn(4, 4, dtype=torch.float64).requires_grad_() for _ in range(2))
    x = torch.randn(3, 4, dtype=torch.float64).requires_grad_()
    y = checkpoint(region, x, w1, w2, use_reentrant=False)
    (dx,), part = input_part([y], [torch.ones_like(y)], [x], [w1, w2], whole=True)
    assert part.groups == [] and len(part.rest) == 2
    weight_part(part)
    assert forwards == 3  # the forward, I's recompute, W's: one each
    want = torch.autograd.grad([region(x, w1, w2)], [x, w1, w2], [torch.ones(3, 4, dtype=torch.float64)])
    assert torch.equal(dx, want[0]) and torch.equal(w1.grad, want[1]) and torch.equal(w2.grad, want[2])
