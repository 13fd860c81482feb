"""The collectives a context-parallel step's layers issue, and their prediction on fake tensors.

* ``grad_summed``: identity forward, psum of the gradient backward: every parameter is replicated
  over the axis and used on this rank's part of the sequence, so its gradient is the sum over the
  axis' parts (JAX's ``pvary``; Megatron's f).
* ``attend``: the rank's attention over the whole sequence, ring (``ppermute`` of the key/value
  slice, ``n - 1`` times forward and again backward) or Ulysses (four all-to-alls forward, four back).

Predicting. Inside :func:`predicting` nothing communicates: each operation records what it would
issue (op, shape, dtype, label) and returns a tensor of the shape the run would (attention over the
local slice alone), so a layer run forward and backward on fake tensors lists every collective it
issues, in the order the run's autograd issues them: what the Plan shows and the contract test holds
the ledger to.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...collectives import Mesh, axis_index, axis_size, psum
from ...engine.run import inside_times
from .ring import ring_attention
from .ulysses import ulysses_attention


@dataclass(frozen=True)
class Issued:
    """One collective a layer issues: the ledger's op name, its input's shape and dtype, and who issued it."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    label: str


@dataclass
class _Prediction:
    size: int
    issued: list[Issued]


_predicting: contextvars.ContextVar[_Prediction | None] = contextvars.ContextVar(
    "shardwise_cp_predicting", default=None
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
    """The calling rank's index on the axis (0 while predicting: every index issues the same)."""
    return 0 if _predicting.get() is not None else axis_index(axis, mesh=mesh)


def _record(op: str, shape: tuple[int, ...], dtype: torch.dtype, label: str) -> None:
    prediction = _predicting.get()
    assert prediction is not None
    prediction.issued.append(Issued(op, shape, dtype, label))


def grad_summed(x: torch.Tensor, axis: str, label: str, reduce: torch.dtype | None = None) -> torch.Tensor:
    """Identity forward; backward, the gradient psum'd over ``axis`` (in ``reduce``, else its own dtype)."""
    return _GradSum.apply(x, axis, label, reduce)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, attention: str, balanced: bool, label: str,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence: ``ring_attention`` or
    ``ulysses_attention`` (q [batch, heads, seq_local, head_dim]; k, v with kv_heads)."""
    if _predicting.get() is not None:
        return _PredictedAttention.apply(q, k, v, attention, label, scale)
    if attention == "ring":
        return inside_times.timed(lambda: ring_attention(q, k, v, axis, causal=True, balanced=balanced, scale=scale))
    return inside_times.timed(
        lambda: ulysses_attention(q, k, v, axis, causal=True, balanced=balanced, scale=scale)
    )


class _PredictedAttention(torch.autograd.Function):
    """While predicting: local causal attention (the run's shapes), recording the collectives the run's
    attention issues forward and, in the order its autograd issues them, backward."""

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: str, label: str, scale: float | None
    ) -> torch.Tensor:
        n = size("")
        if attention == "ring":
            for _ in range(n - 1):
                _record("ppermute", (2, *k.shape), k.dtype, label)
        else:
            for t in (q, k, v, q):  # q, k, v to heads, the output (shaped as q) back
                _record("all_to_all", tuple(t.shape), t.dtype, label)
        group = q.shape[1] // k.shape[1]
        keys, values = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, ctx.attention, ctx.label, _ = inputs
        ctx.shapes = [(tuple(t.shape), t.dtype) for t in (q, k, v)]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (q, qd), (k, kd), (v, vd) = ctx.shapes
        if ctx.attention == "ring":
            for _ in range(size("") - 1):
                _record("ppermute", (2, *k), kd, ctx.label)
        else:
            # The output's transpose first, then the inputs' in reverse creation order (autograd runs
            # the latest-made ready node first): v, k, q.
            for shape, dtype in ((tuple(g.shape), g.dtype), (v, vd), (k, kd), (q, qd)):
                _record("all_to_all", shape, dtype, ctx.label)
        return (torch.zeros(q, dtype=qd), torch.zeros(k, dtype=kd), torch.zeros(v, dtype=vd), None, None, None)


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
        if _predicting.get() is not None:
            _record("psum", tuple(sent.shape), sent.dtype, ctx.label)
            return g.clone(), None, None, None
        summed = inside_times.timed(lambda: psum(sent, ctx.axis))
        return summed.to(g.dtype), None, None, None
