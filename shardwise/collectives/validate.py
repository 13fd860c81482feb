"""Argument checks shared by the collectives: each error names the op, the argument and the fix."""

from __future__ import annotations

import bisect
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


_NO_SYNC_FORM = "pass detached tensors (x.detach())"  # an all-gather into rows has no differentiable form


def gather_input(op: str, x: object) -> list[torch.Tensor]:
    """An all-gather's input as the 1-D pieces its values lie in, end to end: a tensor, flattened
    (it must be contiguous: its values are read in place), or a sequence of 1-D contiguous tensors
    of one dtype and device that do not overlap each other."""
    if isinstance(x, torch.Tensor):
        if not x.is_contiguous():
            raise ValueError(f"{op}: the input must be contiguous (its values are read in place); pass x.contiguous()")
        refuse_grad(op, x, _NO_SYNC_FORM)
        return [x.detach().reshape(-1)]
    if not isinstance(x, Sequence) or not x:
        raise TypeError(f"{op}: the input must be a tensor or a non-empty sequence of 1-D tensors (its values "
                        f"end to end), got {type(x).__name__}{' (empty)' if isinstance(x, Sequence) else ''}")
    pieces = list(x)
    for k, piece in enumerate(pieces):
        if not isinstance(piece, torch.Tensor):
            raise TypeError(f"{op}: x[{k}] is a {type(piece).__name__}, not a tensor")
        if piece.ndim != 1 or not piece.is_contiguous():
            raise ValueError(f"{op}: x[{k}] must be a 1-D contiguous tensor, got shape {list(piece.shape)} "
                             f"(contiguous: {piece.is_contiguous()}); pass .reshape(-1) slices")
        if piece.dtype != pieces[0].dtype or piece.device != pieces[0].device:
            raise ValueError(f"{op}: x[{k}] is {piece.dtype} on {piece.device}, x[0] {pieces[0].dtype} on "
                             f"{pieces[0].device}; every piece of the input must be of one dtype and device")
        refuse_grad(op, piece, _NO_SYNC_FORM)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), k)
                   for k, p in enumerate(pieces) if p.numel())
    for (_, end, k), (start, _, k2) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{op}: x[{k}] and x[{k2}] overlap; the input's pieces must hold distinct elements")
    return [piece.detach() for piece in pieces]


def check_rows(op: str, xs: Sequence[torch.Tensor], rows: Sequence[Sequence[torch.Tensor]], members: int,
               own: int) -> None:
    """Refuse destinations an all-gather of the pieces ``xs`` (end to end, from ``gather_input``)
    over ``members`` cannot be written into (member ``own``'s row may be the input's values where
    they lie: nothing is copied there)."""
    if len(rows) != members:
        raise ValueError(f"{op}: rows has {len(rows)} entries; pass one per member of the axis ({members})")
    dtype, device, size = xs[0].dtype, xs[0].device, xs[0].element_size()
    numel = sum(x.numel() for x in xs)
    # The input's pieces by address (they do not overlap each other): (start, end, element offset).
    inputs = sorted((x.data_ptr(), x.data_ptr() + x.numel() * size, at)
                    for x, at in zip(xs, itertools.accumulate((x.numel() for x in xs[:-1]), initial=0), strict=True)
                    if x.numel())
    input_ends = [end for _, end, _ in inputs]
    spans: list[tuple[int, int, int, int]] = []  # every piece's bytes, to refuse two that overlap
    for j, pieces in enumerate(rows):
        total = 0
        for k, piece in enumerate(pieces):
            _check_piece(op, j, k, piece)
            if piece.dtype != dtype or piece.device != device:
                raise ValueError(f"{op}: rows[{j}][{k}] is {piece.dtype} on {piece.device}, the input "
                                 f"{dtype} on {device}; the rows take the input's values as they are")
            at, end = piece.data_ptr(), piece.data_ptr() + piece.numel() * size
            # Each input piece it overlaps must hold the same elements at the same addresses, in
            # this member's own row: its values where they lie.
            for lo, _, first in itertools.islice(inputs, bisect.bisect_right(input_ends, at), None):
                if lo >= end or not piece.numel():
                    break
                if j != own or lo - first * size != at - total * size:
                    raise ValueError(f"{op}: rows[{j}][{k}] overlaps the input (other than this member's own "
                                     "values where they lie); gather into other tensors")
            if piece.numel():
                spans.append((at, end, j, k))
            total += piece.numel()
        if total != numel:
            raise ValueError(f"{op}: rows[{j}] holds {total} elements, the input {numel}; each member's row "
                             "takes the whole input")
    spans.sort()
    for (_, end, j, k), (start, _, j2, k2) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{op}: rows[{j}][{k}] and rows[{j2}][{k2}] overlap; each element of the result "
                             "needs a place of its own")
