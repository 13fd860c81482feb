"""Megatron's communication inside a tensor-parallel layer, as shardwise collectives.

Each operation is one line of forward and one of backward (picotron's
``tp_communications.py``), over the tensor-parallel axis of the current mesh:

* ``enter``: identity forward, all-reduce backward (Megatron's f, JAX's
  ``pvary``); under sequence parallel: all-gather of the sequence forward,
  reduce-scatter backward.
* ``leave``: all-reduce forward, identity backward (Megatron's g, ``psum``);
  under sequence parallel: reduce-scatter of the sequence forward, all-gather
  backward.
* ``gather_invariant``: all-gather forward, this rank's slice of the gradient
  backward: a split value made whole for a computation every rank then does
  alike (a column-parallel output gathered, the sequence after the last
  sequence-parallel block).
* ``scatter``: this rank's slice of the sequence forward, all-gather backward
  (where sequence parallel begins).
* ``vary``: ``enter`` on a replicated parameter used on per-rank values, so its
  gradient is summed over the axis (unless ``summed`` says otherwise by the time the
  backward runs: see layer_rewrite.VaryFn).

Predicting. Inside the engine's ``in_layer.predicting`` block the operations move nothing: they
record what they would issue (the collective, its axis, its input's shape and dtype, forward or
backward) and return tensors of the right shape, so running a layer forward and backward on fake
tensors lists every collective it issues, in order. That list is what the Plan shows; the contract
test checks it against the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...collectives import all_gather, psum, psum_scatter
from ...collectives.function import QuickApplyFunction
from ...collectives.where import in_backward
from ...engine.stack import in_layer
from . import positions
from .following import current, quiet

# -- the operations ------------------------------------------------------------------------------
# Each is one autograd Function: an op in forward and its transpose in backward, among "psum",
# "psum_scatter", "all_gather", "slice" (this rank's part, nothing moved) and None (identity).
# ``reduce``: the dtype sums travel in (mixed_precision's reduce dtype), None for the value's own.


def enter(
    x: torch.Tensor, axis: str, seq_dim: int | None, label: str, reduce: torch.dtype | None = None
) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward; sequence parallel: all-gather the sequence."""
    if seq_dim is None:
        return _comm(x, axis, None, "psum", 0, reduce, label)
    return _comm(x, axis, "all_gather", "psum_scatter", sequence_dim(x, seq_dim, label), reduce, label)


def leave(
    x: torch.Tensor, axis: str, seq_dim: int | None, label: str, reduce: torch.dtype | None = None
) -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward; sequence parallel: reduce-scatter the sequence."""
    if seq_dim is None:
        return _comm(x, axis, "psum", None, 0, reduce, label)
    dim = sequence_dim(x, seq_dim, label)
    _check_divides(x, dim, axis, label)
    return _comm(x, axis, "psum_scatter", "all_gather", dim, reduce, label)


def gather_invariant(x: torch.Tensor, axis: str, dim: int, label: str) -> torch.Tensor:
    """All-gather of ``dim`` forward, this rank's slice of the gradient backward."""
    return _comm(x, axis, "all_gather", "slice", dim % x.dim(), None, label)


def scatter(x: torch.Tensor, axis: str, seq_dim: int, label: str) -> torch.Tensor:
    """This rank's slice of ``seq_dim`` forward, all-gather of the gradient backward."""
    _check_divides(x, seq_dim, axis, label)
    return _comm(x, axis, "slice", "all_gather", seq_dim, None, label)


def vary(
    x: torch.Tensor, axis: str, label: str, reduce: torch.dtype | None = None,
    summed: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """A replicated parameter used on per-rank values: identity forward, its gradient summed over the axis.
    ``summed``, if given, is asked in backward: a forward can learn only as it runs (a Region reading its
    graph, modules.py) that the parameter acted on whole values, whose gradient is whole already."""
    if summed is None:
        return enter(x, axis, None, label, reduce)
    return _comm(x, axis, None, lambda: "psum" if summed() else None, 0, reduce, label)


def _comm(
    x: torch.Tensor, axis: str, forward_op: str | None, backward_op: str | Callable[[], str | None] | None, dim: int,
    reduce: torch.dtype | None, label: str,
) -> torch.Tensor:
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"tensor_parallel: {label!r} passes a {x.dtype} tensor where a floating one is split or summed")
    follower = current()
    if follower is not None:  # a value in reduced form (partial.py) is made whole unless this takes it so
        x = follower.before_collective(x, forward_op, dim)

    def run() -> torch.Tensor:
        with quiet():  # the reduced-form follower does not look inside our own collectives
            return _TPComm.apply(x, axis, forward_op, backward_op, dim, reduce, label)

    return positions.collective(run, x, forward_op, dim)  # whether its output holds a slice


def _apply(
    op: str | None, x: torch.Tensor, axis: str, dim: int, reduce: torch.dtype | None, label: str, phase: str
) -> torch.Tensor:
    """One op on ``x``: moved for real, or (while predicting) recorded with the right output shape."""
    n = in_layer.size(axis)
    wire = reduce if reduce is not None and op in ("psum", "psum_scatter") else x.dtype
    if in_layer.predicting_now():
        if op in ("psum", "psum_scatter", "all_gather"):
            in_layer.record(op, axis, tuple(x.shape), wire, label, phase)
        if op == "all_gather":
            return torch.cat([x] * n, dim)
        if op in ("psum_scatter", "slice"):
            return x.narrow(dim, 0, x.shape[dim] // n).clone()
        if op is None:  # a view as in the run: a copy would count as memory kept (a norm's weight)
            return x.view_as(x)
        return x.clone()
    if op is None:  # Megatron's f forward and g backward are free: a view, no copy
        return x.view_as(x)
    if op == "slice":
        return x.chunk(n, dim)[in_layer.index(axis)].contiguous()
    if op == "all_gather":
        return all_gather(x.contiguous(), axis, dim, tiled=True)
    sent = x.to(wire).contiguous()
    if op == "psum":
        return psum(sent, axis).to(x.dtype)
    return psum_scatter(sent, axis, dim, tiled=True).to(x.dtype)


class _TPComm(QuickApplyFunction):
    """``forward_op`` in forward, ``backward_op`` (its transpose; a callable: asked then) on the gradient
    in backward."""

    @staticmethod
    def forward(
        x: torch.Tensor, axis: str, forward_op: str | None, backward_op: str | Callable[[], str | None] | None,
        dim: int, reduce: torch.dtype | None, label: str,
    ) -> torch.Tensor:
        return _apply(forward_op, x, axis, dim, reduce, label, "forward")

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.axis, _, ctx.backward_op, ctx.dim, ctx.reduce, ctx.label = inputs
        in_layer.remember_context(ctx)  # the axis's group, on whichever thread the backward runs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        op = ctx.backward_op() if callable(ctx.backward_op) else ctx.backward_op

        def transposed() -> torch.Tensor:
            with in_backward():
                return _apply(op, g, ctx.axis, ctx.dim, ctx.reduce, ctx.label, "backward")

        return in_layer.in_forward_context(ctx, transposed), None, None, None, None, None, None


def all_max(x: torch.Tensor, axis: str, label: str) -> torch.Tensor:
    """The elementwise maximum over the axis (no gradient): an all-gather, then the max."""
    x = x.detach()
    if in_layer.predicting_now():
        in_layer.record("all_gather", axis, tuple(x.shape), x.dtype, label)
        return x.clone()
    return all_gather(x, axis).amax(0)


def sequence_dim(x: torch.Tensor, dim: int, label: str) -> int:
    """The dim a sequence-parallel value is gathered or scattered along: ``dim``, the sequence, of a (batch,
    sequence, ...) value; or 0 of tokens folded into rows, (batch x sequence, features) (OPT's layer and a MoE
    block flatten them before their MLP): a rank's rows are its tokens, so the rows of all ranks, one rank's
    after another's, are every token once, for a computation of each row alone, and a reduce-scatter of them
    hands each rank its own rows back (the guard, positions.py, checks that the rows are the tokens). A value
    with fewer dims holds no sequence to cut."""
    if x.dim() > dim + 1:
        return dim
    if dim == 1 and x.dim() == 2:
        return 0
    raise ValueError(
        f"tensor_parallel(sequence_parallel=...): {label!r} receives a value of shape {list(x.shape)} inside a "
        f"sequence-parallel block, where values are (batch, sequence, ...) split along dim {dim}, the sequence, or "
        "(tokens, features) with batch and sequence folded into rows; this one is neither. Leave this module out "
        "of the plan, or leave its block out of sequence_parallel"
    )


def _check_divides(x: torch.Tensor, dim: int, axis: str, label: str) -> None:
    n = in_layer.size(axis)
    if x.shape[dim] % n:
        raise ValueError(
            f"tensor_parallel(sequence_parallel=...): {label!r} splits the sequence (dim {dim}, length "
            f"{x.shape[dim]}) over {n} ranks of axis {axis!r}, which does not divide it; use a sequence "
            f"length that is a multiple of {n}, or sequence_parallel=None"
        )
