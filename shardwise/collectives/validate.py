"""Argument checks shared by the collectives: each error names the op, the argument and the fix."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .where import Pairs, Where


def require_tensor(op: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a torch.Tensor, got {type(x).__name__}")
    return x


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


def _check_piece(op: str, j: int, k: int, piece: object) -> None:
    """Refuse ``rows[j][k]`` unless it is a 1-D contiguous tensor."""
    if not isinstance(piece, torch.Tensor):
        raise TypeError(f"{op}: rows[{j}][{k}] is a {type(piece).__name__}, not a tensor")
    if piece.ndim != 1 or not piece.is_contiguous():
        raise ValueError(f"{op}: rows[{j}][{k}] must be a 1-D contiguous tensor, got shape "
                         f"{list(piece.shape)} (contiguous: {piece.is_contiguous()}); pass .reshape(-1) slices")


def check_reduce_rows(op: str, rows: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype, members: int) -> None:
    """Refuse rows a reduce-scatter cannot read as one (members, m) buffer of ``dtype``."""
    if len(rows) != members:
        raise ValueError(f"{op}: rows has {len(rows)} entries; pass one per member of the axis ({members})")
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{op}: dtype must be a floating-point torch.dtype (the rows are summed in it), got {dtype!r}")
    device: torch.device | None = None
    totals = []
    for j, pieces in enumerate(rows):
        total = 0
        for k, piece in enumerate(pieces):
            _check_piece(op, j, k, piece)
            if piece.requires_grad:
                raise RuntimeError(f"{op} is not differentiable but rows[{j}][{k}] requires grad: pass detached "
                                   "tensors, or call it under torch.no_grad()")
            device = piece.device if device is None else device
            if piece.device != device:
                raise ValueError(f"{op}: rows[{j}][{k}] is on {piece.device}, an earlier piece on {device}; "
                                 "every piece must be on one device")
            total += piece.numel()
        totals.append(total)
    if len(set(totals)) > 1:
        raise ValueError(f"{op}: the rows hold {totals} elements; every member's row must hold as many")
    if device is None:
        raise ValueError(f"{op}: the rows hold no tensor; pass at least one piece per row")


def check_rows(op: str, x: torch.Tensor, rows: Sequence[Sequence[torch.Tensor]], members: int, own: int) -> None:
    """Refuse destinations an all-gather of ``x`` over ``members`` cannot be written into (member
    ``own``'s row may be ``x``'s own values where they lie: nothing is copied there)."""
    if len(rows) != members:
        raise ValueError(f"{op}: rows has {len(rows)} entries; pass one per member of the axis ({members})")
    if not x.is_contiguous():
        raise ValueError(f"{op}: the input must be contiguous (its values are read in place); pass x.contiguous()")
    numel, size = x.numel(), x.element_size()
    spans: list[tuple[int, int, int, int]] = []  # every piece's bytes, to refuse two that overlap
    lo, hi = x.data_ptr(), x.data_ptr() + numel * size  # x is flat and contiguous
    for j, pieces in enumerate(rows):
        total = 0
        for k, piece in enumerate(pieces):
            _check_piece(op, j, k, piece)
            if piece.dtype != x.dtype or piece.device != x.device:
                raise ValueError(f"{op}: rows[{j}][{k}] is {piece.dtype} on {piece.device}, the input "
                                 f"{x.dtype} on {x.device}; the rows take the input's values as they are")
            at = piece.data_ptr()
            in_place = j == own and at == lo + total * size
            if piece.numel() and at < hi and lo < at + piece.numel() * size and not in_place:
                raise ValueError(f"{op}: rows[{j}][{k}] overlaps the input (other than this member's own values "
                                 "where they lie); gather into other tensors")
            if piece.numel():
                spans.append((at, at + piece.numel() * size, j, k))
            total += piece.numel()
        if total != numel:
            raise ValueError(f"{op}: rows[{j}] holds {total} elements, the input {numel}; each member's row "
                             "takes the whole input")
    spans.sort()
    for (_, end, j, k), (start, _, j2, k2) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{op}: rows[{j}][{k}] and rows[{j2}][{k2}] overlap; each element of the result "
                             "needs a place of its own")
