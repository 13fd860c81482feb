"""Differentiable collectives over one mesh axis, named as in JAX.

Every collective takes a mesh axis name and ``mesh=`` (default: the mesh of the
enclosing ``with mesh:`` block) and runs over the caller's slice of that axis.
Each one is a short ``torch.autograd.Function`` (``setup_context`` style, so it
works under ``loss.backward()`` and ``torch.func.grad`` / ``vjp`` alike) around
the same code path as its ``*_async`` form: sync = async + wait + autograd.

Cotangent convention. A per-rank value is either *varying* (each rank holds its
own, and the global loss is the sum of the per-rank losses) or *invariant* (the
same on every rank, standing for ONE value: its cotangent is already the total,
never summed again over ranks). ``psum`` and ``pmean`` turn varying values into
invariant ones; ``pvary`` turns an invariant value into a varying one; every
other collective maps varying to varying. The transpose rules follow JAX:

* psum: all-reduce forward, identity backward (Megatron's g).
* pvary: identity forward, psum backward (Megatron's f).
* pmean: psum / n forward, identity / n backward.
* all_gather: gather forward, psum_scatter backward (each rank's use of the
  gathered value contributes its own cotangent).
* psum_scatter: reduce-scatter forward, all_gather backward.
* ppermute: permute forward, inverse permutation backward.
* all_to_all: all_to_all forward, all_to_all with split and concat dims swapped
  backward.
* broadcast: broadcast forward; backward sums every rank's cotangent onto the
  root (an all-reduce), the other ranks get zeros.

Backward collectives are issued through the same Functions, so they are
recorded in the ledger (with ``phase="backward"``) and are differentiable again.
Integer and bool tensors work with every collective except pmean; they never
carry gradients. The async forms refuse inputs that require grad.

Each collective starts in ``start.py`` (through ``handle.issue``); point-to-point ``send``/``recv`` in ``p2p.py``.
A synchronous one notes when it ran inside ``timing.timing()`` (what a traced step reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .backends.base import Rows
from .function import QuickApplyFunction
from .handle import Handle
from .mesh import Mesh
from .mesh_context import current_mesh
from .start import (
    start_all_gather,
    start_all_gather_into,
    start_all_to_all,
    start_broadcast,
    start_pmean,
    start_ppermute,
    start_psum,
    start_psum_scatter,
    start_psum_scatter_rows,
)
from .timing import timed
from .validate import (
    check_perm,
    check_reduce_rows,
    check_root,
    check_rows,
    gather_input,
    normalize_dim,
    refuse_grad,
    require_tensor,
)
from .where import Pairs, Where, in_backward, resolve


# -- autograd: one Function per collective ---------------------------------------------
class _PSum(QuickApplyFunction):
    """All-reduce in forward, identity in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: Where) -> torch.Tensor:
        return timed(lambda: start_psum(x, where, snapshot=False).wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g, None


class _PMean(QuickApplyFunction):
    """All-reduce / n in forward, identity / n in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: Where) -> torch.Tensor:
        return timed(lambda: start_pmean(x, where, snapshot=False).wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.n = inputs[1].size

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g / ctx.n, None


class _PVary(QuickApplyFunction):
    """Identity in forward, all-reduce in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: Where) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.where = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with in_backward():
            return _PSum.apply(g, ctx.where), None


class _AllGather(QuickApplyFunction):
    """All-gather in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: Where, dim: int, tiled: bool) -> torch.Tensor:
        return timed(lambda: start_all_gather(x, where, dim, tiled, snapshot=False).wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with in_backward():
            return _PSumScatter.apply(g, ctx.where, ctx.dim, ctx.tiled), None, None, None


class _PSumScatter(QuickApplyFunction):
    """Reduce-scatter in forward, all-gather in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: Where, dim: int, tiled: bool) -> torch.Tensor:
        return timed(lambda: start_psum_scatter(x, where, dim, tiled, snapshot=False).wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with in_backward():
            return _AllGather.apply(g, ctx.where, ctx.dim, ctx.tiled), None, None, None


class _AllToAll(QuickApplyFunction):
    """All-to-all in forward, all-to-all with split and concat dims swapped in backward."""

    @staticmethod
    def forward(
        x: torch.Tensor, where: Where, split_dim: int, concat_dim: int, tiled: bool
    ) -> torch.Tensor:
        return timed(lambda: start_all_to_all(x, where, split_dim, concat_dim, tiled, snapshot=False).wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.split_dim, ctx.concat_dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with in_backward():
            gx = _AllToAll.apply(g, ctx.where, ctx.concat_dim, ctx.split_dim, ctx.tiled)
        return gx, None, None, None, None


class _Broadcast(QuickApplyFunction):
    """Broadcast from the root in forward; in backward the root gets the sum of all cotangents, others zeros."""

    @staticmethod
    def forward(x: torch.Tensor, where: Where, root: int) -> torch.Tensor:
        return timed(lambda: start_broadcast(x, where, root, snapshot=False).wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.root = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # No reduce-to-root primitive: every rank takes part in an all-reduce and
        # only the root keeps it (the ledger records that psum, as it runs).
        with in_backward():
            total = _PSum.apply(g, ctx.where)
        gx = total if ctx.where.index == ctx.root else torch.zeros_like(total)
        return gx, None, None


class _PPermute(QuickApplyFunction):
    """Permute in forward, inverse permutation in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: Where, pairs: Pairs) -> torch.Tensor:
        return timed(lambda: start_ppermute(x, where, pairs, snapshot=False).wait())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.pairs = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inverse = tuple((dst, src) for src, dst in ctx.pairs)
        with in_backward():
            return _PPermute.apply(g, ctx.where, inverse), None, None


def _run(fn: type[torch.autograd.Function], x: torch.Tensor, *args: Any) -> torch.Tensor:
    if x.is_floating_point() or x.is_complex():
        return fn.apply(x, *args)
    return fn.forward(x, *args)  # integers and bools carry no gradient


def _gather_dim(op: str, x: torch.Tensor, dim: int, tiled: bool) -> int:
    # Untiled, `dim` places a new dim in the output, so it ranges over ndim + 1 positions.
    return normalize_dim(op, x, dim, x.ndim if tiled else x.ndim + 1)


# -- public API ----------------------------------------------------------------------
def psum(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``axis``, on every one of them (all-reduce)."""
    where = resolve("psum", axis, mesh)
    return _run(_PSum, require_tensor("psum", x), where)


def pmean(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Mean of ``x`` over the ranks of ``axis`` (psum, then divide by the axis size)."""
    x = require_tensor("pmean", x)
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"pmean needs a floating tensor, got {x.dtype}; use psum and divide yourself")
    return _run(_PMean, x, resolve("pmean", axis, mesh))


def pvary(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Mark a value replicated over ``axis`` as per-rank: identity, whose gradient is psum'd."""
    where = resolve("pvary", axis, mesh)
    return _run(_PVary, require_tensor("pvary", x), where)


def all_gather(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Every rank's ``x``, stacked along a new ``dim`` (or concatenated along ``dim`` if tiled)."""
    x = require_tensor("all_gather", x)
    where = resolve("all_gather", axis, mesh)
    return _run(_AllGather, x, where, _gather_dim("all_gather", x, dim, tiled), tiled)


def psum_scatter(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """This rank's part of the sum over ``axis``: index i of ``dim`` (dropped), or its i-th tile if tiled."""
    x = require_tensor("psum_scatter", x)
    where = resolve("psum_scatter", axis, mesh)
    return _run(_PSumScatter, x, where, normalize_dim("psum_scatter", x, dim, x.ndim), tiled)


def ppermute(
    x: torch.Tensor, axis: str, perm: Sequence[tuple[int, int]], *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Send ``x`` from axis index src to dst for each (src, dst) in ``perm``; ranks receiving nothing get zeros."""
    x = require_tensor("ppermute", x)
    where = resolve("ppermute", axis, mesh)
    return _run(_PPermute, x, where, check_perm("ppermute", perm, where))


def all_to_all(
    x: torch.Tensor,
    axis: str,
    split_dim: int,
    concat_dim: int,
    tiled: bool = False,
    *,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """Chunk k of ``split_dim`` goes to rank k; received chunks stack (concatenate, if tiled) at ``concat_dim``."""
    x = require_tensor("all_to_all", x)
    where = resolve("all_to_all", axis, mesh)
    split = normalize_dim("all_to_all", x, split_dim, x.ndim, "split_dim")
    concat = normalize_dim("all_to_all", x, concat_dim, x.ndim, "concat_dim")
    return _run(_AllToAll, x, where, split, concat, tiled)


def broadcast(x: torch.Tensor, axis: str, root: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """The ``x`` of axis index ``root``, on every rank of ``axis``."""
    x = require_tensor("broadcast", x)
    where = resolve("broadcast", axis, mesh)
    return _run(_Broadcast, x, where, check_root("broadcast", root, where))


def axis_index(axis: str, *, mesh: Mesh | None = None) -> int:
    """The calling rank's index along ``axis``."""
    return resolve("axis_index", axis, mesh).index


def axis_size(axis: str, *, mesh: Mesh | None = None) -> int:
    """The number of ranks along ``axis`` (no rank needed: it is layout)."""
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise RuntimeError(f"axis_size(axis={axis!r}) needs a mesh: call it inside `with mesh:` or pass mesh=")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis_size: unknown mesh axis {axis!r}; {mesh!r} has axes {mesh.axis_names}")
    return mesh.axis_size(axis)


# -- async forms: not differentiable, same code path as the sync forms ---------------
def _async_input(op: str, x: object) -> torch.Tensor:
    x = require_tensor(op, x)
    refuse_grad(op, x)
    return x


def psum_async(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> Handle:
    """Start :func:`psum`; ``.wait()`` returns its result."""
    x = _async_input("psum_async", x)
    return start_psum(x, resolve("psum_async", axis, mesh))


def all_gather_async(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None,
    snapshot: bool = True,
) -> Handle:
    """Start :func:`all_gather`; ``.wait()`` returns its result. ``snapshot=False`` promises that
    ``x`` is left unchanged until then, so it is not copied first."""
    x = _async_input("all_gather_async", x)
    where = resolve("all_gather_async", axis, mesh)
    return start_all_gather(x, where, _gather_dim("all_gather_async", x, dim, tiled), tiled, snapshot=snapshot)


def all_gather_into_async(
    x: torch.Tensor | Sequence[torch.Tensor], rows: Rows, axis: str, *, mesh: Mesh | None = None
) -> Handle:
    """Start the all-gather over ``axis`` of each member's input, written where the caller says:
    member ``j``'s values into ``rows[j]``, 1-D contiguous pieces of the input's dtype and device laid
    end to end. The input is ``x`` flattened, or given as a sequence of 1-D contiguous tensors, their
    values end to end (a bucket's shards, say, gathered without joining them first). No piece of the
    rows may overlap the input, but in this member's own row, which may be the input's values where
    they lie (left as they are). The input and this member's row must stay unchanged until
    ``.wait()``, which returns ``x`` given a tensor, else an empty tensor. Through shared memory no
    buffer of the input or the result is made (this member's row is sent from where it lies, each
    peer's part copied from its slots into the pieces); elsewhere the input is joined (when it is
    several pieces) and gathered, and the result copied into the pieces at the wait."""
    xs = gather_input("all_gather_into_async", x)
    where = resolve("all_gather_into_async", axis, mesh)
    check_rows("all_gather_into_async", xs, rows, where.size, where.index)
    return start_all_gather_into(x if isinstance(x, torch.Tensor) else xs, where, rows)


def psum_scatter_rows_async(rows: Rows, dtype: torch.dtype, axis: str, *, mesh: Mesh | None = None) -> Handle:
    """Start the tiled reduce-scatter over ``axis`` of the buffer whose row ``j`` (the part member
    ``j`` gets the sum of) is ``rows[j]``: 1-D pieces on one device laid end to end, converted to
    ``dtype``. The pieces must stay unchanged until ``.wait()``, which returns this member's row of
    the sum (a tensor of its own). Through shared memory no buffer of the whole input is made (each
    piece is copied into the slots it is sent from); elsewhere they are concatenated first, and the
    result is :func:`psum_scatter_async`'s of that buffer, bit for bit."""
    where = resolve("psum_scatter_rows_async", axis, mesh)
    check_reduce_rows("psum_scatter_rows_async", rows, dtype, where.size)
    return start_psum_scatter_rows(rows, dtype, where)


def psum_scatter_async(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None,
    snapshot: bool = True, donate: bool = False,
) -> Handle:
    """Start :func:`psum_scatter`; ``.wait()`` returns its result. ``snapshot=False`` promises
    that ``x`` is left unchanged until then, so it is not copied first (a whole gradient's bytes).
    ``donate=True`` (implies ``snapshot=False``) hands ``x`` over: the backend may reduce in it, so
    its values are undefined afterwards and the caller must not read it again (gloo, which
    reduce-scatters by an all-reduce, then runs it in ``x`` instead of a copy of it)."""
    x = _async_input("psum_scatter_async", x)
    where = resolve("psum_scatter_async", axis, mesh)
    return start_psum_scatter(
        x, where, normalize_dim("psum_scatter_async", x, dim, x.ndim), tiled,
        snapshot=snapshot and not donate, donate=donate,
    )


def ppermute_async(
    x: torch.Tensor, axis: str, perm: Sequence[tuple[int, int]], *, mesh: Mesh | None = None
) -> Handle:
    """Start :func:`ppermute`; ``.wait()`` returns its result."""
    x = _async_input("ppermute_async", x)
    where = resolve("ppermute_async", axis, mesh)
    return start_ppermute(x, where, check_perm("ppermute_async", perm, where))


def all_to_all_async(
    x: torch.Tensor,
    axis: str,
    split_dim: int,
    concat_dim: int,
    tiled: bool = False,
    *,
    mesh: Mesh | None = None,
) -> Handle:
    """Start :func:`all_to_all`; ``.wait()`` returns its result."""
    x = _async_input("all_to_all_async", x)
    where = resolve("all_to_all_async", axis, mesh)
    split = normalize_dim("all_to_all_async", x, split_dim, x.ndim, "split_dim")
    concat = normalize_dim("all_to_all_async", x, concat_dim, x.ndim, "concat_dim")
    return start_all_to_all(x, where, split, concat, tiled)


def broadcast_async(x: torch.Tensor, axis: str, root: int = 0, *, mesh: Mesh | None = None) -> Handle:
    """Start :func:`broadcast`; ``.wait()`` returns its result."""
    x = _async_input("broadcast_async", x)
    where = resolve("broadcast_async", axis, mesh)
    return start_broadcast(x, where, check_root("broadcast_async", root, where))
