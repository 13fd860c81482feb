"""The collectives an expert-parallel step's layers issue, and their prediction on fake tensors.

* ``exchange``: the dispatch's and the combine's tiled ``all_to_all`` over dim 0 (its transpose, in
  backward, is the same all-to-all).
* ``gather_counts``: the all-gather of each rank's routing counts (integers: no gradient).

A parameter every rank of the axis holds whole (the router, attention, norms) is used on this rank's
tokens, so its gradient is summed over the axis in backward: the engine's ``in_layer.grad_summed``.

Predicting. Inside the engine's ``in_layer.predicting`` block nothing communicates: each operation
records what it would issue (op, axis, input shape and dtype, phase, label) and returns a tensor of the
shape the run would, so a layer run forward and backward on fake tensors lists every collective it
issues, in order: what the Plan shows and the contract test holds the ledger to.
"""

from __future__ import annotations

from typing import Any

import torch

from ...collectives import Mesh, all_gather, all_to_all
from ...collectives.function import QuickApplyFunction
from ...engine.stack import in_layer


def gather_counts(x: torch.Tensor, axis: str, label: str, mesh: Mesh | None = None) -> torch.Tensor:
    """All-gather of this rank's integer counts: [size, *x.shape] (with no mesh at all, one device: [1, ...])."""
    if in_layer.one_device(mesh):
        return x.unsqueeze(0)
    return in_layer.collective(
        "all_gather", axis, x, label, run=lambda: all_gather(x, axis, mesh=mesh),
        predicted=lambda: torch.stack([x] * in_layer.size(axis)),
    )


def exchange(x: torch.Tensor, axis: str, label: str, mesh: Mesh | None = None) -> torch.Tensor:
    """The tiled all-to-all over dim 0 (rows for rank ``r`` go to rank ``r``); the same in backward. With no
    mesh at all (one device) every row is this rank's: ``x`` itself."""
    if in_layer.one_device(mesh):
        return x
    if in_layer.predicting_now():
        return _PredictedAllToAll.apply(x, axis, label)
    return all_to_all(x, axis, split_dim=0, concat_dim=0, tiled=True, mesh=mesh)


class _PredictedAllToAll(QuickApplyFunction):
    """While predicting: records the all-to-all forward and its transpose backward, moves nothing."""

    @staticmethod
    def forward(x: torch.Tensor, axis: str, label: str) -> torch.Tensor:
        in_layer.record("all_to_all", axis, tuple(x.shape), x.dtype, label)
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.axis, ctx.label = inputs[1], inputs[2]
        in_layer.remember_context(ctx)  # the prediction it records into, on whichever thread it runs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        in_layer.in_forward_context(
            ctx, lambda: in_layer.record("all_to_all", ctx.axis, tuple(g.shape), g.dtype, ctx.label, "backward"))
        return g.clone(), None, None
