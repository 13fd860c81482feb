"""How a collective starts: where it runs, its validation, and the one code path that the
sync (differentiable) and async forms of every collective share.

``start_*`` functions issue the backend primitive, record the call in the
ledger and return a :class:`Handle`; ``ops.py`` wraps them in autograd and
``p2p.py`` adds point-to-point messages.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from . import ledger as _ledger
from ._functorch import unwrap
from .backend import Backend, Group, Work
from .context import current_mesh
from .mesh import Mesh

Pairs = tuple[tuple[int, int], ...]

_phase: contextvars.ContextVar[str] = contextvars.ContextVar("shardwise_comm_phase", default="forward")


def current_phase() -> str:
    """"backward" while a collective's autograd backward issues collectives, else "forward"."""
    return _phase.get()


def require_tensor(op: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a torch.Tensor, got {type(x).__name__}")
    return x


@contextlib.contextmanager
def in_backward() -> Iterator[None]:
    token = _phase.set("backward")
    try:
        yield
    finally:
        _phase.reset(token)


@dataclass(frozen=True)
class Where:
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


def resolve(op: str, axis: str, mesh: Mesh | None) -> Where:
    if mesh is None:
        mesh = current_mesh()
    if mesh is None:
        raise RuntimeError(f"{op}(axis={axis!r}) needs a mesh: call it inside `with mesh:` or pass mesh=")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{op}(mesh=...) expects a shardwise Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{op}: unknown mesh axis {axis!r}; {mesh!r} has axes {mesh.axis_names}")
    backend = mesh.backend
    return Where(axis, backend, _group(axis, mesh.group_ranks(axis, backend.rank)), _ledger.active_ledgers())


@functools.lru_cache(maxsize=4096)  # every collective resolves its group; Group is a frozen value
def _group(axis: str, ranks: tuple[int, ...]) -> Group:
    return Group(axis, ranks)


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


def issue(
    op: str,
    where: Where,
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
    x = unwrap(x)
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
def normalize_dim(op: str, x: torch.Tensor, dim: int, ndim: int, what: str = "dim") -> int:
    """``dim`` made non-negative among ``ndim`` dims (negative dims count from the end)."""
    if ndim == 0:
        raise ValueError(f"{op}: {what}={dim} but the tensor of shape () has no dims; give it one")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: {what}={dim} is out of range for the tensor of shape {tuple(x.shape)} "
            f"(valid: {-ndim}..{ndim - 1})"
        )
    return dim % ndim


def check_split(op: str, x: torch.Tensor, dim: int, where: Where, tiled: bool) -> None:
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


def check_perm(op: str, perm: Sequence[tuple[int, int]], where: Where) -> Pairs:
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


def check_root(op: str, root: int, where: Where) -> int:
    if not 0 <= root < where.size:
        raise ValueError(f"{op}: root={root} is outside the axis {where.axis!r} of size {where.size}")
    return root


def refuse_grad(op: str, x: torch.Tensor, fix: str | None = None) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        fix = fix or f"use the sync form {op.removesuffix('_async')}(...)"
        raise RuntimeError(
            f"{op} is not differentiable but its input requires grad: {fix} or call it under torch.no_grad()"
        )


# -- starting each collective: the one code path of the sync and async forms --------
# ``snapshot``: True for the async forms (the caller may modify x before wait),
# False for the sync forms (they wait at once; see Backend on snapshots).
def start_psum(x: torch.Tensor, where: Where, snapshot: bool = True) -> Handle:
    return issue(
        "psum", where, x, lambda b, t, g, s: b.all_reduce(t, g, "psum", snapshot=s), snapshot=snapshot
    )


def start_pmean(x: torch.Tensor, where: Where, snapshot: bool = True) -> Handle:
    n = where.size
    # The backend's result is a fresh tensor of our own: divide it in place.
    return issue(
        "pmean",
        where,
        x,
        lambda b, t, g, s: b.all_reduce(t, g, "pmean", snapshot=s),
        lambda r: r.div_(n),
        snapshot=snapshot,
    )


def start_all_gather(x: torch.Tensor, where: Where, dim: int, tiled: bool, snapshot: bool = True) -> Handle:
    return issue(
        "all_gather",
        where,
        x,
        lambda b, t, g, s: b.all_gather(t, g, "all_gather", snapshot=s),
        lambda stacked: _chunks_to(stacked, dim, tiled),  # stacked: (n, *x.shape)
        snapshot=snapshot,
    )


def _chunks_to(chunks: torch.Tensor, dim: int, tiled: bool) -> torch.Tensor:
    """Inverse of :func:`_chunks_first`: the backend's (n, ...) chunks put back along ``dim``."""
    out = chunks.movedim(0, dim)
    return (out.flatten(dim, dim + 1) if tiled else out).contiguous()


def _chunks_first(x: torch.Tensor, dim: int, n: int, tiled: bool) -> torch.Tensor:
    """The backend layout (n, ...): index k along ``dim`` (or its k-th tile, when tiled) first."""
    if tiled:
        x = x.unflatten(dim, (n, x.shape[dim] // n))
    return x.movedim(dim, 0)


def start_psum_scatter(x: torch.Tensor, where: Where, dim: int, tiled: bool, snapshot: bool = True) -> Handle:
    check_split("psum_scatter", x, dim, where, tiled)
    # Untiled, the reduced chunk has lost `dim`; tiled, its tile sits back at `dim`.
    return issue(
        "psum_scatter",
        where,
        x,
        lambda b, t, g, s: b.reduce_scatter(t, g, "psum_scatter", snapshot=s),
        snapshot=snapshot,
        layout=lambda t: _chunks_first(t, dim, where.size, tiled),
    )


def start_all_to_all(
    x: torch.Tensor, where: Where, split_dim: int, concat_dim: int, tiled: bool, snapshot: bool = True
) -> Handle:
    check_split("all_to_all", x, split_dim, where, tiled)

    return issue(
        "all_to_all",
        where,
        x,
        lambda b, t, g, s: b.all_to_all(t, g, "all_to_all", snapshot=s),
        lambda received: _chunks_to(received, concat_dim, tiled),  # received[j]: rank j's chunk for us
        snapshot=snapshot,
        layout=lambda t: _chunks_first(t, split_dim, where.size, tiled),
    )


def start_broadcast(x: torch.Tensor, where: Where, root: int, snapshot: bool = True) -> Handle:
    return issue(
        "broadcast",
        where,
        x,
        lambda b, t, g, s: b.broadcast(t, root, g, "broadcast", snapshot=s),
        snapshot=snapshot,
        root=root,
    )


def start_ppermute(x: torch.Tensor, where: Where, pairs: Pairs, snapshot: bool = True) -> Handle:
    return issue(
        "ppermute",
        where,
        x,
        lambda b, t, g, s: b.permute(t, pairs, g, "ppermute", snapshot=s),
        snapshot=snapshot,
        pairs=pairs,
    )
