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

Point to point, for pipeline stages: ``send(x, axis, dst, tag=)`` and
``recv(axis, src, tag=)`` move one tensor between two ranks of an axis (dst and
src are indices along it), return a :class:`Handle` and are not differentiable
(a pipeline sends the gradient back itself). The receiver learns the shape and
dtype from the message; see ``Backend.send`` / ``Backend.recv`` for ordering.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import _functorch

from . import ledger as _ledger
from .backend import Backend, Group, Work, check_p2p
from .context import current_mesh
from .mesh import Mesh

Pairs = tuple[tuple[int, int], ...]

_phase: contextvars.ContextVar[str] = contextvars.ContextVar("shardwise_comm_phase", default="forward")


@contextlib.contextmanager
def _in_backward() -> Iterator[None]:
    token = _phase.set("backward")
    try:
        yield
    finally:
        _phase.reset(token)


@dataclass(frozen=True)
class _Where:
    """Where a collective runs. Resolved once in forward and kept for its backward."""

    axis: str
    backend: Backend
    group: Group
    # Autograd may run backward on a device thread that sees none of the
    # caller's context variables; the forward's ledgers are the fallback then.
    ledgers: tuple[_ledger.Ledger, ...]

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def index(self) -> int:
        return self.group.index(self.backend.rank)


def _resolve(op: str, axis: str, mesh: Mesh | None) -> _Where:
    if mesh is None:
        mesh = current_mesh()
    if mesh is None:
        raise RuntimeError(f"{op}(axis={axis!r}) needs a mesh: call it inside `with mesh:` or pass mesh=")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{op}(mesh=...) expects a shardwise Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{op}: unknown mesh axis {axis!r}; {mesh!r} has axes {mesh.axis_names}")
    backend = mesh.backend
    group = Group(axis, mesh.group_ranks(axis, backend.rank))
    return _Where(axis, backend, group, _ledger.active_ledgers())


class Handle:
    """An in-flight collective: ``wait()`` blocks until it is done and returns the result."""

    __slots__ = ("_finish", "_result", "_work")

    def __init__(self, work: Work, finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._work = work
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish(self._work.wait())
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work.is_completed()


def _plain(x: torch.Tensor) -> torch.Tensor:
    # torch.func wrappers belong to the calling thread's transform stack; another
    # rank's thread (which computes the threads backend's result) must not see them.
    while _functorch.is_functorch_wrapped_tensor(x):
        if _functorch.is_batchedtensor(x):
            raise NotImplementedError("shardwise collectives do not support torch.func.vmap")
        x = _functorch.get_unwrapped(x)
    return x


def _issue(
    op: str,
    where: _Where,
    x: torch.Tensor,
    send: Callable[[Backend, torch.Tensor, Group, bool], Work],
    finish: Callable[[torch.Tensor], torch.Tensor] = lambda r: r,
    *,
    snapshot: bool,
    layout: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    root: int | None = None,
    pairs: Pairs | None = None,
) -> Handle:
    """Send ``layout(x)`` through ``send``, record ``x`` in the ledger, return the handle.

    ``send(backend, tensor, group, snapshot)`` starts the backend primitive.
    ``snapshot=False`` promises the backend that ``x`` stays unchanged until the
    handle is waited on (the sync forms, which wait at once); the async forms
    pass True, since their caller may reuse ``x`` at once. When the layout made
    a new tensor anyway, nobody else can touch it, so no snapshot is needed.
    """
    x = _plain(x)
    t = layout(x).contiguous()
    if snapshot and not _shares_storage(t, x):
        snapshot = False
    work = send(where.backend, t, where.group, snapshot)
    _ledger.record(
        op,
        axis=where.axis,
        rank=where.backend.rank,
        index=where.index,
        group_size=where.size,
        tensor=x,
        phase=_phase.get(),
        root=root,
        pairs=pairs,
        ledgers=_ledger.active_ledgers() or where.ledgers,
    )
    return Handle(work, finish)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return True  # nothing to copy either way; be conservative
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


# -- validation -----------------------------------------------------------------
def _dim(op: str, x: torch.Tensor, dim: int, ndim: int, what: str = "dim") -> int:
    """``dim`` made non-negative among ``ndim`` dims (negative dims count from the end)."""
    if ndim == 0:
        raise ValueError(f"{op}: {what}={dim} but the tensor of shape () has no dims; give it one")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: {what}={dim} is out of range for the tensor of shape {tuple(x.shape)} "
            f"(valid: {-ndim}..{ndim - 1})"
        )
    return dim % ndim


def _check_split(op: str, x: torch.Tensor, dim: int, where: _Where, tiled: bool) -> None:
    size, n = x.shape[dim], where.size
    if tiled and size % n:
        raise ValueError(
            f"{op}(tiled=True): dim {dim} of the tensor of shape {tuple(x.shape)} has size {size}, "
            f"which the size {n} of axis {where.axis!r} does not divide; pad that dim to a multiple of {n}"
        )
    if not tiled and size != n:
        raise ValueError(
            f"{op}(tiled=False): dim {dim} of the tensor of shape {tuple(x.shape)} has size {size} "
            f"but must equal the size {n} of axis {where.axis!r}; use tiled=True to split it into {n} chunks"
        )


def _check_perm(op: str, perm: Sequence[tuple[int, int]], where: _Where) -> Pairs:
    try:
        pairs = tuple((int(src), int(dst)) for src, dst in perm)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: perm must be pairs (src, dst) of axis indices, got {perm!r}") from None
    n = where.size
    for src, dst in pairs:
        if not (0 <= src < n and 0 <= dst < n):
            raise ValueError(f"{op}: pair ({src}, {dst}) is outside the axis {where.axis!r} of size {n}")
    for k, name in ((0, "source"), (1, "destination")):
        seen = [p[k] for p in pairs]
        repeated = sorted({i for i in seen if seen.count(i) > 1})
        if repeated:
            raise ValueError(f"{op}: {name} indices {repeated} repeat in perm={list(pairs)}; each may appear once")
    return pairs


def _check_root(op: str, root: int, where: _Where) -> int:
    if not 0 <= root < where.size:
        raise ValueError(f"{op}: root={root} is outside the axis {where.axis!r} of size {where.size}")
    return root


def _refuse_grad(op: str, x: torch.Tensor, fix: str | None = None) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        fix = fix or f"use the sync form {op.removesuffix('_async')}(...)"
        raise RuntimeError(
            f"{op} is not differentiable but its input requires grad: {fix} or call it under torch.no_grad()"
        )


# -- starting each collective: the one code path of the sync and async forms --------
# ``snapshot``: True for the async forms (the caller may modify x before wait),
# False for the sync forms (they wait at once; see Backend on snapshots).
def _start_psum(x: torch.Tensor, where: _Where, snapshot: bool = True) -> Handle:
    return _issue(
        "psum", where, x, lambda b, t, g, s: b.all_reduce(t, g, "psum", snapshot=s), snapshot=snapshot
    )


def _start_pmean(x: torch.Tensor, where: _Where, snapshot: bool = True) -> Handle:
    n = where.size
    # The backend's result is a fresh tensor of our own: divide it in place.
    return _issue(
        "pmean",
        where,
        x,
        lambda b, t, g, s: b.all_reduce(t, g, "pmean", snapshot=s),
        lambda r: r.div_(n),
        snapshot=snapshot,
    )


def _start_all_gather(x: torch.Tensor, where: _Where, dim: int, tiled: bool, snapshot: bool = True) -> Handle:
    def finish(stacked: torch.Tensor) -> torch.Tensor:  # (n, *x.shape)
        out = stacked.movedim(0, dim)
        return (out.flatten(dim, dim + 1) if tiled else out).contiguous()

    return _issue(
        "all_gather",
        where,
        x,
        lambda b, t, g, s: b.all_gather(t, g, "all_gather", snapshot=s),
        finish,
        snapshot=snapshot,
    )


def _chunks_first(x: torch.Tensor, dim: int, n: int, tiled: bool) -> torch.Tensor:
    """The backend layout (n, ...): index k along ``dim`` (or its k-th tile, when tiled) first."""
    if tiled:
        x = x.unflatten(dim, (n, x.shape[dim] // n))
    return x.movedim(dim, 0)


def _start_psum_scatter(x: torch.Tensor, where: _Where, dim: int, tiled: bool, snapshot: bool = True) -> Handle:
    _check_split("psum_scatter", x, dim, where, tiled)
    # Untiled, the reduced chunk has lost `dim`; tiled, its tile sits back at `dim`.
    return _issue(
        "psum_scatter",
        where,
        x,
        lambda b, t, g, s: b.reduce_scatter(t, g, "psum_scatter", snapshot=s),
        snapshot=snapshot,
        layout=lambda t: _chunks_first(t, dim, where.size, tiled),
    )


def _start_all_to_all(
    x: torch.Tensor, where: _Where, split_dim: int, concat_dim: int, tiled: bool, snapshot: bool = True
) -> Handle:
    _check_split("all_to_all", x, split_dim, where, tiled)

    def finish(received: torch.Tensor) -> torch.Tensor:  # received[j]: rank j's chunk for us
        out = received.movedim(0, concat_dim)
        return (out.flatten(concat_dim, concat_dim + 1) if tiled else out).contiguous()

    return _issue(
        "all_to_all",
        where,
        x,
        lambda b, t, g, s: b.all_to_all(t, g, "all_to_all", snapshot=s),
        finish,
        snapshot=snapshot,
        layout=lambda t: _chunks_first(t, split_dim, where.size, tiled),
    )


def _start_broadcast(x: torch.Tensor, where: _Where, root: int, snapshot: bool = True) -> Handle:
    return _issue(
        "broadcast",
        where,
        x,
        lambda b, t, g, s: b.broadcast(t, root, g, "broadcast", snapshot=s),
        snapshot=snapshot,
        root=root,
    )


def _start_ppermute(x: torch.Tensor, where: _Where, pairs: Pairs, snapshot: bool = True) -> Handle:
    return _issue(
        "ppermute",
        where,
        x,
        lambda b, t, g, s: b.permute(t, pairs, g, "ppermute", snapshot=s),
        snapshot=snapshot,
        pairs=pairs,
    )


# -- autograd: one Function per collective ---------------------------------------------
class _PSum(torch.autograd.Function):
    """All-reduce in forward, identity in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: _Where) -> torch.Tensor:
        return _start_psum(x, where, snapshot=False).wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g, None


class _PMean(torch.autograd.Function):
    """All-reduce / n in forward, identity / n in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: _Where) -> torch.Tensor:
        return _start_pmean(x, where, snapshot=False).wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.n = inputs[1].size

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g / ctx.n, None


class _PVary(torch.autograd.Function):
    """Identity in forward, all-reduce in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: _Where) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.where = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _in_backward():
            return _PSum.apply(g, ctx.where), None


class _AllGather(torch.autograd.Function):
    """All-gather in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: _Where, dim: int, tiled: bool) -> torch.Tensor:
        return _start_all_gather(x, where, dim, tiled, snapshot=False).wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _in_backward():
            return _PSumScatter.apply(g, ctx.where, ctx.dim, ctx.tiled), None, None, None


class _PSumScatter(torch.autograd.Function):
    """Reduce-scatter in forward, all-gather in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: _Where, dim: int, tiled: bool) -> torch.Tensor:
        return _start_psum_scatter(x, where, dim, tiled, snapshot=False).wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _in_backward():
            return _AllGather.apply(g, ctx.where, ctx.dim, ctx.tiled), None, None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all in forward, all-to-all with split and concat dims swapped in backward."""

    @staticmethod
    def forward(
        x: torch.Tensor, where: _Where, split_dim: int, concat_dim: int, tiled: bool
    ) -> torch.Tensor:
        return _start_all_to_all(x, where, split_dim, concat_dim, tiled, snapshot=False).wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.split_dim, ctx.concat_dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _in_backward():
            gx = _AllToAll.apply(g, ctx.where, ctx.concat_dim, ctx.split_dim, ctx.tiled)
        return gx, None, None, None, None


class _Broadcast(torch.autograd.Function):
    """Broadcast from the root in forward; in backward the root gets the sum of all cotangents, others zeros."""

    @staticmethod
    def forward(x: torch.Tensor, where: _Where, root: int) -> torch.Tensor:
        return _start_broadcast(x, where, root, snapshot=False).wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.root = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # No reduce-to-root primitive: every rank takes part in an all-reduce and
        # only the root keeps it (the ledger records that psum, as it runs).
        with _in_backward():
            total = _PSum.apply(g, ctx.where)
        gx = total if ctx.where.index == ctx.root else torch.zeros_like(total)
        return gx, None, None


class _PPermute(torch.autograd.Function):
    """Permute in forward, inverse permutation in backward."""

    @staticmethod
    def forward(x: torch.Tensor, where: _Where, pairs: Pairs) -> torch.Tensor:
        return _start_ppermute(x, where, pairs, snapshot=False).wait()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        _, ctx.where, ctx.pairs = inputs

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inverse = tuple((dst, src) for src, dst in ctx.pairs)
        with _in_backward():
            return _PPermute.apply(g, ctx.where, inverse), None, None


def _run(fn: type[torch.autograd.Function], x: torch.Tensor, *args: Any) -> torch.Tensor:
    if x.is_floating_point() or x.is_complex():
        return fn.apply(x, *args)
    return fn.forward(x, *args)  # integers and bools carry no gradient


def _tensor(op: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a torch.Tensor, got {type(x).__name__}")
    return x


def _gather_dim(op: str, x: torch.Tensor, dim: int, tiled: bool) -> int:
    # Untiled, `dim` places a new dim in the output, so it ranges over ndim + 1 positions.
    return _dim(op, x, dim, x.ndim if tiled else x.ndim + 1)


# -- public API ----------------------------------------------------------------------
def psum(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``axis``, on every one of them (all-reduce)."""
    where = _resolve("psum", axis, mesh)
    return _run(_PSum, _tensor("psum", x), where)


def pmean(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Mean of ``x`` over the ranks of ``axis`` (psum, then divide by the axis size)."""
    x = _tensor("pmean", x)
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"pmean needs a floating tensor, got {x.dtype}; use psum and divide yourself")
    return _run(_PMean, x, _resolve("pmean", axis, mesh))


def pvary(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> torch.Tensor:
    """Mark a value replicated over ``axis`` as per-rank: identity, whose gradient is psum'd."""
    where = _resolve("pvary", axis, mesh)
    return _run(_PVary, _tensor("pvary", x), where)


def all_gather(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Every rank's ``x``, stacked along a new ``dim`` (or concatenated along ``dim`` if tiled)."""
    x = _tensor("all_gather", x)
    where = _resolve("all_gather", axis, mesh)
    return _run(_AllGather, x, where, _gather_dim("all_gather", x, dim, tiled), tiled)


def psum_scatter(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None
) -> torch.Tensor:
    """This rank's part of the sum over ``axis``: index i of ``dim`` (dropped), or its i-th tile if tiled."""
    x = _tensor("psum_scatter", x)
    where = _resolve("psum_scatter", axis, mesh)
    return _run(_PSumScatter, x, where, _dim("psum_scatter", x, dim, x.ndim), tiled)


def ppermute(
    x: torch.Tensor, axis: str, perm: Sequence[tuple[int, int]], *, mesh: Mesh | None = None
) -> torch.Tensor:
    """Send ``x`` from axis index src to dst for each (src, dst) in ``perm``; ranks receiving nothing get zeros."""
    x = _tensor("ppermute", x)
    where = _resolve("ppermute", axis, mesh)
    return _run(_PPermute, x, where, _check_perm("ppermute", perm, where))


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
    x = _tensor("all_to_all", x)
    where = _resolve("all_to_all", axis, mesh)
    split = _dim("all_to_all", x, split_dim, x.ndim, "split_dim")
    concat = _dim("all_to_all", x, concat_dim, x.ndim, "concat_dim")
    return _run(_AllToAll, x, where, split, concat, tiled)


def broadcast(x: torch.Tensor, axis: str, root: int = 0, *, mesh: Mesh | None = None) -> torch.Tensor:
    """The ``x`` of axis index ``root``, on every rank of ``axis``."""
    x = _tensor("broadcast", x)
    where = _resolve("broadcast", axis, mesh)
    return _run(_Broadcast, x, where, _check_root("broadcast", root, where))


def axis_index(axis: str, *, mesh: Mesh | None = None) -> int:
    """The calling rank's index along ``axis``."""
    return _resolve("axis_index", axis, mesh).index


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
    x = _tensor(op, x)
    _refuse_grad(op, x)
    return x


def psum_async(x: torch.Tensor, axis: str, *, mesh: Mesh | None = None) -> Handle:
    """Start :func:`psum`; ``.wait()`` returns its result."""
    x = _async_input("psum_async", x)
    return _start_psum(x, _resolve("psum_async", axis, mesh))


def all_gather_async(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None
) -> Handle:
    """Start :func:`all_gather`; ``.wait()`` returns its result."""
    x = _async_input("all_gather_async", x)
    where = _resolve("all_gather_async", axis, mesh)
    return _start_all_gather(x, where, _gather_dim("all_gather_async", x, dim, tiled), tiled)


def psum_scatter_async(
    x: torch.Tensor, axis: str, dim: int = 0, tiled: bool = False, *, mesh: Mesh | None = None
) -> Handle:
    """Start :func:`psum_scatter`; ``.wait()`` returns its result."""
    x = _async_input("psum_scatter_async", x)
    where = _resolve("psum_scatter_async", axis, mesh)
    return _start_psum_scatter(x, where, _dim("psum_scatter_async", x, dim, x.ndim), tiled)


def ppermute_async(
    x: torch.Tensor, axis: str, perm: Sequence[tuple[int, int]], *, mesh: Mesh | None = None
) -> Handle:
    """Start :func:`ppermute`; ``.wait()`` returns its result."""
    x = _async_input("ppermute_async", x)
    where = _resolve("ppermute_async", axis, mesh)
    return _start_ppermute(x, where, _check_perm("ppermute_async", perm, where))


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
    where = _resolve("all_to_all_async", axis, mesh)
    split = _dim("all_to_all_async", x, split_dim, x.ndim, "split_dim")
    concat = _dim("all_to_all_async", x, concat_dim, x.ndim, "concat_dim")
    return _start_all_to_all(x, where, split, concat, tiled)


def broadcast_async(x: torch.Tensor, axis: str, root: int = 0, *, mesh: Mesh | None = None) -> Handle:
    """Start :func:`broadcast`; ``.wait()`` returns its result."""
    x = _async_input("broadcast_async", x)
    where = _resolve("broadcast_async", axis, mesh)
    return _start_broadcast(x, where, _check_root("broadcast_async", root, where))


# -- point to point: not differentiable ------------------------------------------------
def _peer(op: str, where: _Where, index: object, name: str) -> int:
    """The global rank at axis index ``index`` of the caller's group."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{op}: {name} must be an int axis index, got {type(index).__name__} {index!r}")
    if not 0 <= index < where.size:
        raise ValueError(f"{op}: {name}={index} is outside the axis {where.axis!r} of size {where.size}")
    return where.group.ranks[index]


def _record_p2p(op: str, where: _Where, t: torch.Tensor, sent_bytes: int, phase: str) -> None:
    targets = _ledger.active_ledgers() or where.ledgers
    if not targets:
        return
    entry = _ledger.CommRecord(
        op=op,
        axis=where.axis,
        rank=where.backend.rank,
        group_size=where.size,
        dtype=str(t.dtype).removeprefix("torch."),
        shape=tuple(t.shape),
        nbytes=t.numel() * t.element_size(),
        sent_bytes=sent_bytes,
        phase=phase,
    )
    for ledger in targets:
        ledger.add(entry)


def send(x: torch.Tensor, axis: str, dst: int, *, tag: int = 0, mesh: Mesh | None = None) -> Handle:
    """Send ``x`` to the rank at index ``dst`` of ``axis``; ``.wait()`` returns ``x``.

    The message is a snapshot taken now: ``x`` may be modified at once, and
    ``wait()`` never waits for the receiver. Messages to one rank with one
    ``tag`` (an int in ``0..MAX_TAG``) arrive in send order; tags are
    independent. Not differentiable.
    """
    x = _tensor("send", x)
    _refuse_grad("send", x, "send x.detach() (a pipeline sends the gradient back itself)")
    where = _resolve("send", axis, mesh)
    peer = _peer("send", where, dst, "dst")
    _, tag = check_p2p("send", peer, tag, where.backend.world_size, "dst")
    plain = _plain(x)
    work = where.backend.send(plain, peer, tag)
    # Like ppermute: a message to oneself moves no bytes.
    sent_bytes = 0 if dst == where.index else plain.numel() * plain.element_size()
    _record_p2p("send", where, plain, sent_bytes, _phase.get())
    return Handle(work, lambda _: x)


def recv(axis: str, src: int, *, tag: int = 0, mesh: Mesh | None = None) -> Handle:
    """Receive the next message with ``tag`` from the rank at index ``src`` of ``axis``.

    ``.wait()`` returns it with the sender's shape and dtype, or raises
    CollectiveTimeout after the backend timeout. Receives from one rank with
    one tag take the messages in the order the receives were issued. The
    ledger records the receive (sent_bytes 0) when its wait completes.
    """
    where = _resolve("recv", axis, mesh)
    peer = _peer("recv", where, src, "src")
    _, tag = check_p2p("recv", peer, tag, where.backend.world_size, "src")
    work = where.backend.recv(peer, tag)
    phase = _phase.get()

    def finish(received: torch.Tensor) -> torch.Tensor:
        _record_p2p("recv", where, received, 0, phase)
        return received

    return Handle(work, finish)
