"""The collectives an expert-parallel step's layers issue, and their prediction on fake tensors.

* ``exchange``: the dispatch's and the combine's tiled ``all_to_all`` over dim 0 (its transpose, in
  backward, is the same all-to-all).
* ``gather_counts``: the all-gather of each rank's routing counts (integers: no gradient).
* ``grad_summed``: identity forward, psum of the gradient backward: a parameter every rank of the
  axis holds whole (the router, attention, norms) used on this rank's tokens, whose gradient is the
  sum over the axis' shares of the batch (JAX's ``pvary``; Megatron's f).

Predicting. Inside :func:`predicting` nothing communicates: each operation records what it would
issue (op, input shape and dtype, phase, label) and returns a tensor of the shape the run would, so a
layer run forward and backward on fake tensors lists every collective it issues, in order: what the
Plan shows and the contract test holds the ledger to.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...collectives import Mesh, all_gather, all_to_all, axis_index, axis_size, psum
from ...engine.run import inside_times


@dataclass(frozen=True)
class Issued:
    """One collective a layer issues: the ledger's op name, its input, the phase and who issued it."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    phase: str  # "forward" or "backward"
    label: str


@dataclass
class _Prediction:
    size: int
    issued: list[Issued]


_predicting: contextvars.ContextVar[_Prediction | None] = contextvars.ContextVar(
    "shardwise_ep_predicting", default=None
)


@contextlib.contextmanager
def predicting(size: int) -> Iterator[list[Issued]]:
    """Inside the block no operation communicates: each records what it would issue over an axis of
    ``size`` ranks into the yielded list."""
    prediction = _Prediction(size, [])
    token = _predicting.set(prediction)
    try:
        yield prediction.issued
    finally:
        _predicting.reset(token)


def predicting_now() -> bool:
    return _predicting.get() is not None


def size(axis: str, mesh: Mesh | None = None) -> int:
    """The axis size, also while predicting."""
    prediction = _predicting.get()
    return prediction.size if prediction is not None else axis_size(axis, mesh=mesh)


def index(axis: str, mesh: Mesh | None = None) -> int:
    return 0 if predicting_now() else axis_index(axis, mesh=mesh)


def _record(op: str, x: torch.Tensor, phase: str, label: str) -> None:
    prediction = _predicting.get()
    assert prediction is not None
    prediction.issued.append(Issued(op, tuple(x.shape), x.dtype, phase, label))


def gather_counts(x: torch.Tensor, axis: str, label: str, mesh: Mesh | None = None) -> torch.Tensor:
    """All-gather of this rank's integer counts: [size, *x.shape]."""
    if predicting_now():
        _record("all_gather", x, "forward", label)
        return torch.stack([x] * size(axis))
    return inside_times.timed(lambda: all_gather(x, axis, mesh=mesh))


def exchange(x: torch.Tensor, axis: str, label: str, mesh: Mesh | None = None) -> torch.Tensor:
    """The tiled all-to-all over dim 0 (rows for rank ``r`` go to rank ``r``); the same in backward."""
    if predicting_now():
        return _PredictedAllToAll.apply(x, label)
    return inside_times.timed(lambda: all_to_all(x, axis, split_dim=0, concat_dim=0, tiled=True, mesh=mesh))


def grad_summed(x: torch.Tensor, axis: str, label: str, reduce: torch.dtype | None = None) -> torch.Tensor:
    """Identity forward; backward, the gradient psum'd over ``axis`` (in ``reduce``, else its own dtype)."""
    return _GradSum.apply(x, axis, label, reduce)


class _PredictedAllToAll(torch.autograd.Function):
    """While predicting: records the all-to-all forward and its transpose backward, moves nothing."""

    @staticmethod
    def forward(x: torch.Tensor, label: str) -> torch.Tensor:
        _record("all_to_all", x, "forward", label)
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.label = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _record("all_to_all", g, "backward", ctx.label)
        return g.clone(), None


class _GradSum(torch.autograd.Function):
    """Identity forward (a view), psum over the axis backward."""

    @staticmethod
    def forward(x: torch.Tensor, axis: str, label: str, reduce: torch.dtype | None) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.axis, ctx.label, ctx.reduce = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sent = g.to(ctx.reduce if ctx.reduce is not None else g.dtype).contiguous()
        if predicting_now():
            _record("psum", sent, "backward", ctx.label)
            return g.clone(), None, None, None
        summed = inside_times.timed(lambda: psum(sent, ctx.axis))
        return summed.to(g.dtype), None, None, None
