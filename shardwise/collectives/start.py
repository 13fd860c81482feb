"""How each collective starts: the backend layout of its input and output, shared by the sync
(differentiable, in ``ops.py``) and async forms. Each ``start_*`` returns a :class:`Handle`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends.base import Rows
from .handle import Handle, issue
from .validate import check_split
from .where import Pairs, Where


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


def start_all_gather_into(x: torch.Tensor | Sequence[torch.Tensor], where: Where, rows: Rows) -> Handle:
    """Each member's input, ``x`` flattened or the 1-D pieces ``x`` end to end, written into its
    ``rows`` entry; the input is read until the wait, which returns ``x`` given a tensor, else an
    empty tensor. The ledger records ``x``, or given pieces one tensor of their elements."""
    if isinstance(x, torch.Tensor):
        given = x
        return issue(
            "all_gather",
            where,
            x,
            lambda b, t, g, s: b.all_gather_into([t], rows, g, "all_gather"),
            lambda _: given,
            snapshot=False,
            layout=lambda t: t.reshape(-1),
        )
    pieces = list(x)
    joined = torch.empty(sum(p.numel() for p in pieces), dtype=pieces[0].dtype, device="meta")
    return issue(
        "all_gather",
        where,
        joined,
        lambda b, t, g, s: b.all_gather_into(pieces, rows, g, "all_gather"),
        snapshot=False,
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


def start_psum_scatter(
    x: torch.Tensor, where: Where, dim: int, tiled: bool, snapshot: bool = True, donate: bool = False
) -> Handle:
    check_split("psum_scatter", x, dim, where, tiled)
    # Untiled, the reduced chunk has lost `dim`; tiled, its tile sits back at `dim`.
    return issue(
        "psum_scatter",
        where,
        x,
        lambda b, t, g, s: b.reduce_scatter(t, g, "psum_scatter", snapshot=s, donate=donate),
        snapshot=snapshot,
        layout=lambda t: _chunks_first(t, dim, where.size, tiled),
    )


def start_psum_scatter_rows(rows: Rows, dtype: torch.dtype, where: Where) -> Handle:
    """The tiled reduce-scatter of the (members, m) buffer whose row ``j`` is ``rows[j]``'s pieces end
    to end, in ``dtype``; the pieces are read until the wait. The ledger records that buffer."""
    buffer = torch.empty(where.size * sum(p.numel() for p in rows[0]), dtype=dtype, device="meta")
    return issue(
        "psum_scatter",
        where,
        buffer,
        lambda b, t, g, s: b.reduce_scatter_rows(rows, dtype, g, "psum_scatter"),
        snapshot=False,
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
