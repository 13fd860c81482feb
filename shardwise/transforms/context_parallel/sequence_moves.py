"""The sequence-dim rules of the ops that move or reshape a tensor's elements (views, permutes, slices, cat, pad,
roll): where the positions land, or why the op moves them across the part (a token shift, a token picked).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import Tensor

from .sequence_tags import Call, Tags, Verdict, broadcast, dim_index, dims_named, union


def _view(c: Call) -> Verdict:
    """A reshape keeps the row-major order: each range of strides that counts positions is read off the new dims."""
    x, out = c.args[0], c.outs[0]
    tags = c.tags_of(x)
    flat = [(lo * _after(x.shape, d), hi * _after(x.shape, d)) for d, (lo, hi) in tags.items()]
    new: Tags = {}
    for d in range(out.dim()):
        below = _after(out.shape, d)
        top = below * out.shape[d]
        for lo, hi in flat:
            low, high = max(lo, below), min(hi, top)
            if low < high and out.shape[d] > 1:
                new = union(new, {d: (max(1, low // below), math.ceil(high / below))})
    return c.each(new)


def _after(shape: Sequence[int], d: int) -> int:
    return math.prod(shape[d + 1:])


def _expand(c: Call) -> Verdict:
    x, out = c.args[0], c.outs[0]
    return c.each(broadcast(c.tags_of(x), x.dim(), out.dim()))


def _permute(c: Call) -> Verdict:
    x = c.args[0]
    order = [dim_index(d, x.dim()) for d in c.arg(1, "dims")]
    tags = c.tags_of(x)
    return c.each({i: tags[d] for i, d in enumerate(order) if d in tags})


def _transpose(c: Call) -> Verdict:
    x = c.args[0]
    if c.name in ("t", "t_") or x.dim() < 2:
        a, b = 0, max(x.dim() - 1, 0)
    else:
        a, b = dim_index(c.arg(1, "dim0"), x.dim()), dim_index(c.arg(2, "dim1"), x.dim())
    swap = {a: b, b: a}
    return c.each({swap.get(d, d): r for d, r in c.tags_of(x).items()})


def _squeeze(c: Call) -> Verdict:
    x, out = c.args[0], c.outs[0]
    kept = [d for d in range(x.dim()) if not (x.shape[d] == 1 and out.dim() < x.dim() and _squeezed(c, x, d))]
    tags = c.tags_of(x)
    return c.each({i: tags[d] for i, d in enumerate(kept) if d in tags})


def _squeezed(c: Call, x: Tensor, d: int) -> bool:
    dims = dims_named(c.arg(1, "dim"), x.dim())
    return dims is None or d in dims


def _unsqueeze(c: Call) -> Verdict:
    x = c.args[0]
    at = dim_index(c.arg(1, "dim"), x.dim() + 1)
    return c.each({d + (d >= at): r for d, r in c.tags_of(x).items()})


def _along(dim_at: int, what: str, default: int | None = 0) -> Callable[[Call], Verdict]:
    """An op that takes parts of its input along one dim (slice, select, split...): refused on a tagged dim
    unless it takes the whole dim; the outputs keep the input's other dims."""

    def rule(c: Call) -> Verdict:
        x = c.args[0]
        tags = c.tags_of(x)
        d = dim_index(c.arg(dim_at, "dim", default), x.dim())
        if d in tags and not all(t.dim() == x.dim() and t.shape[d] == x.shape[d] for t in c.outs):
            return c.refuse(f"{what} a {list(x.shape)} tensor along its dim {d}, which holds the part's positions "
                            "(a token shift, or a token picked?)", tags)
        return Verdict([tags if t.dim() == x.dim() else {k - (k > d): v for k, v in tags.items() if k != d}
                        for t in c.outs], None)

    return rule


def _moves(dims_at: int, what: str) -> Callable[[Call], Verdict]:
    """roll, flip: refused when a dim they move along holds positions."""

    def rule(c: Call) -> Verdict:
        x = c.args[0]
        tags = c.tags_of(x)
        dims = dims_named(c.arg(dims_at, "dims"), x.dim())
        along = list(range(x.dim())) if dims is None else dims
        if any(d in tags for d in along):
            return c.refuse(f"{what} a {list(x.shape)} tensor along a dim that holds the part's positions "
                            "(a token shift?)", tags)
        return c.each(tags)

    return rule


def _cat(c: Call) -> Verdict:
    tensors = [t for t in c.arg(0, "tensors") if isinstance(t, Tensor)]
    out = c.outs[0]
    d = dim_index(c.arg(1, "dim", 0), out.dim())
    stacked = c.name == "stack"
    shaped = [t for t in tensors if t.dim() == out.dim() - stacked]
    tags = union(*({k + (stacked and k >= d): v for k, v in c.tags_of(t).items()} for t in shaped))
    if not stacked and d in tags:
        return c.refuse(f"concatenates {len(tensors)} tensors along dim {d}, which holds the part's positions (a "
                        "token shift?)", tags)
    return c.each(tags)


def _pad(c: Call) -> Verdict:
    x = c.args[0]
    tags = c.tags_of(x)
    pad = list(c.arg(1, "pad"))
    for i in range(len(pad) // 2):
        d = x.dim() - 1 - i
        if d in tags and (pad[2 * i] or pad[2 * i + 1]):
            return c.refuse(f"pads a {list(x.shape)} tensor by {pad[2 * i:2 * i + 2]} along its dim {d}, which holds "
                            "the part's positions (a token shift?)", tags)
    return c.each(tags)


def _repeat(c: Call) -> Verdict:
    x, out = c.args[0], c.outs[0]
    repeats = list(c.arg(1, "repeats"))
    tags = broadcast(c.tags_of(x), x.dim(), out.dim())
    if any(repeats[d] != 1 for d in tags):
        return c.refuse(f"repeats a {list(x.shape)} tensor along a dim that holds the part's positions", tags)
    return c.each(tags)


def _tril(c: Call) -> Verdict:
    x = c.args[0]
    tags = c.tags_of(x)
    if x.dim() - 1 in tags or x.dim() - 2 in tags:
        return c.refuse(f"masks a {list(x.shape)} tensor by the positions' places in the part ({c.name})", tags)
    return c.each(tags)


def _complex_view(c: Call) -> Verdict:
    x, out = c.args[0], c.outs[0]
    tags = c.tags_of(x)
    return c.each({d: r for d, r in tags.items() if d < out.dim()})


def _unfold(c: Call) -> Verdict:
    x = c.args[0]
    tags = c.tags_of(x)
    if dim_index(c.arg(1, "dimension"), x.dim()) in tags:
        return c.refuse(f"takes sliding windows of a {list(x.shape)} tensor along the part's positions", tags)
    return c.each(tags)


MOVE_RULES: dict[str, Callable[[Call], Verdict]] = {
    **dict.fromkeys(["view", "_unsafe_view", "reshape", "_reshape_alias", "view_copy"], _view),
    **dict.fromkeys(["expand", "expand_copy"], _expand),
    **dict.fromkeys(["permute", "permute_copy"], _permute),
    **dict.fromkeys(["transpose", "transpose_", "t", "t_", "transpose_copy"], _transpose),
    **dict.fromkeys(["squeeze", "squeeze_", "squeeze_copy"], _squeeze),
    **dict.fromkeys(["unsqueeze", "unsqueeze_", "unsqueeze_copy"], _unsqueeze),
    **dict.fromkeys(["view_as_complex", "view_as_real"], _complex_view),
    "slice": _along(1, "slices"),
    "select": _along(1, "selects a position of"),
    **dict.fromkeys(["split", "split_with_sizes", "unsafe_split", "split_copy", "split_with_sizes_copy",
                     "unsafe_split_with_sizes", "tensor_split", "chunk", "unsafe_chunk"], _along(2, "splits")),
    "unbind": _along(1, "unbinds"),
    "narrow": _along(1, "narrows"),
    "roll": _moves(2, "rolls"),
    "flip": _moves(1, "flips"),
    **dict.fromkeys(["cat", "concat", "stack", "_cat"], _cat),
    "constant_pad_nd": _pad,
    "repeat": _repeat,
    "unfold": _unfold,
    **dict.fromkeys(["tril", "triu", "tril_", "triu_"], _tril),
}
