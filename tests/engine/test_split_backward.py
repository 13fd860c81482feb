"""A stage's backward split into its input part (I) and its weight part (W): the same gradients as one
whole backward, bit for bit, and W runs none of the input's path again."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from shardwise.engine.model.split_backward import input_part, weight_part


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
