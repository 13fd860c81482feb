"""Which dims of an aten op's outputs hold the rank's positions, given those of its inputs; or why the op mixes them.

Given the :data:`~.sequence_tags.Tags` of an op's inputs (``sequence_tags.py``), a rule
reads the op's arguments at dispatch level (a finite set of aten ops whose dims are explicit arguments:
``x.mean(1)``, ``F.pad``, ``torch.einsum`` and ``x @ y`` arrive as ``mean.dim``, ``constant_pad_nd``,
``bmm``...) and answers a :class:`Verdict`: the tags of every tensor it returns, and why it mixes or
moves positions (None: it computes each position from that position alone). An op no rule knows, given
a tagged tensor, is answered as mixing: it cannot be told apart from one that does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from .sequence_moves import MOVE_RULES
from .sequence_tags import (
    NO_RANGE,
    POOLED,
    VALUED,
    Call,
    Tags,
    TagsOf,
    Verdict,
    broadcast,
    dim_index,
    dims_named,
    readable,
    tensors_in,
    union,
    words,
)


def judge(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, tags_of: TagsOf) -> Verdict:
    """The verdict on ``func(*args, **kwargs) -> out`` (see the module docstring)."""
    name = func.overloadpacket.__name__
    outs = [t for t in optree.tree_leaves(out, none_is_leaf=True) if isinstance(t, Tensor)]
    if any(POOLED in tags_of(t) for t in tensors_in(args, kwargs)):
        return _pooled(Call(name, func, list(args), kwargs, outs, tags_of))
    if any(VALUED in tags_of(t) for t in tensors_in(args, kwargs)):
        return _valued(Call(name, func, list(args), kwargs, outs, tags_of))
    rule = _RULES.get(name)
    if rule is None and (torch.Tag.pointwise in func.tags or _pointwise(name)):
        rule = _pointwise_rule
    if rule is None and name in _UNREAD:
        return Verdict([{} for _ in outs], None)
    if rule is None:
        return Verdict([{} for _ in outs], f"runs {readable(func)}, an op whose effect on the positions is not "
                                           "known (it cannot be told apart from one that mixes them)")
    return rule(Call(name, func, list(args), kwargs, outs, tags_of))


# What a mean over the positions may go through and stay a term of the loss: linear maps by constants.
_LINEAR = words("_to_copy clone detach alias lift_fresh view _unsafe_view expand squeeze unsqueeze mul mul_ div "
                 "div_ add add_ sub sub_ neg rsub")


def _pooled(c: Call) -> Verdict:
    pooled = [t for t in tensors_in(c.args, c.kwargs) if POOLED in c.tags_of(t)]
    others = [t for t in tensors_in(c.args, c.kwargs) if all(t is not p for p in pooled)]
    linear = c.name in _LINEAR and len(pooled) == 1 and not any(c.tags_of(t) for t in others) and (
        c.name not in ("div", "div_") or c.args[0] is pooled[0])
    if linear:
        return c.each({POOLED: NO_RANGE})
    return c.refuse(f"computes {readable(c.func)} of a mean over every element of a tensor that holds the part's "
                    "positions (exact under context_parallel only as a term added to the loss: each rank averages "
                    "its own part)")


# What an index whose values are positions may go through: ops that keep its values as they are (views, picks of
# its elements, copies, a cast); and the ops that take or put rows by it, where it is the index (its argument).
_KEEPS_VALUES = words(
    "view _unsafe_view reshape _reshape_alias alias detach clone contiguous lift_fresh _to_copy squeeze unsqueeze "
    "expand permute transpose t select slice unbind split split_with_sizes narrow index _unsafe_index")
_INDEX_AT = {**dict.fromkeys(["index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"], 1),
             **dict.fromkeys(["index_select", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
                              "scatter_reduce", "scatter_reduce_", "index_add", "index_add_", "index_copy",
                              "index_copy_"], 2)}


def _valued(c: Call) -> Verdict:
    """An op given an index whose values are the part's positions (``nonzero``'s): passed only where it uses them
    as an index or keeps them as they are; any op computing with them (``tok % t``, ``tok < n``, ``tok.sum()``)
    reads this rank's local positions as numbers, which differ from the sequence's."""
    valued = [t for t in tensors_in(c.args, c.kwargs) if VALUED in c.tags_of(t)]
    at = _INDEX_AT.get(c.name)
    index = c.arg(at, "indices" if at == 1 else "index") if at is not None else None
    as_index = list(index) if isinstance(index, (list, tuple)) else [index]
    kept = c.name in _KEEPS_VALUES and len(c.args) > 0 and isinstance(c.args[0], Tensor) and (
        VALUED in c.tags_of(c.args[0]))
    others = [t for t in valued if all(t is not i for i in as_index)]
    if kept and all(t is c.args[0] for t in others):
        rule = _RULES.get(c.name, _self_rule)
        verdict = rule(c)
        return Verdict([{**tags, VALUED: NO_RANGE} if tags else tags for tags in verdict.outs], verdict.why)
    if at is not None and not others:
        return _RULES[c.name](c)
    return c.refuse(f"computes {readable(c.func)} with the values of an index made by nonzero of a tensor that "
                    "holds the part's positions (its values are this rank's local positions, not the sequence's: "
                    "an index may only take or put rows by them)")


@functools.cache
def _pointwise(name: str) -> bool:
    """Whether some overload of ``aten.<name>`` (or of its out-of-place form) is tagged pointwise."""
    for candidate in (name, name[:-1] if name.endswith("_") else name):
        packet = getattr(torch.ops.aten, candidate, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            if torch.Tag.pointwise in getattr(packet, overload).tags:
                return True
    return name in _ELEMENTWISE


# Each computes every element from the elements at the same place (after broadcasting), or copies it.
_ELEMENTWISE = words(
    "_to_copy copy_ copy clone detach alias lift_fresh lift_fresh_copy fill_ fill zero_ masked_fill masked_fill_ "
    "where bernoulli bernoulli_ uniform_ normal_ _conj resolve_conj resolve_neg contiguous native_dropout "
    "_assert_tensor_metadata polar complex"
)


# Ops that read none of their tensor arguments' values (a new tensor of their dtype or device, of a size given; the
# ``*_like`` ones, of their input's shape, hold its positions: _like_rule).
_UNREAD = words(
    "new_empty new_zeros new_ones new_full new_empty_strided empty_strided _assert_async "
    "_has_compatible_shallow_copy_type is_same_size "
    "record_stream sym_size sym_stride sym_numel sym_storage_offset device layout dtype is_contiguous "
    "is_strides_like_format is_non_overlapping_and_dense size stride numel dim storage_offset"
)


def _like_rule(c: Call) -> Verdict:
    """A new tensor of its input's shape (``torch.ones_like(x)``): its dims hold the positions the input's hold, as
    a new tensor sized by the part's length does (``shape_reads.sized_dims``), so that a cumulated sum of it along
    them (a count of the part's positions, 0 .. t / n - 1 on every rank) is refused as one of ``x`` would be."""
    return c.each({d: r for d, r in c.tags_of(c.args[0]).items() if d >= 0} if c.args else {})


def _pointwise_rule(c: Call) -> Verdict:
    """Each output element from the inputs' elements at its place: a tagged dim stays where broadcasting puts it."""
    ndim = c.outs[0].dim() if c.outs else 0
    found = [broadcast(c.tags_of(t), t.dim(), ndim) for t in tensors_in(c.args, c.kwargs)]
    return c.each(union(*found))


def _self_rule(c: Call) -> Verdict:
    """Outputs shaped as the input (or dropping nothing): its tags."""
    return c.each(c.tags_of(c.args[0]))


def _reduction(dims_at: int | None, keep_at: int | None, what: str,
               default: int | None = None) -> Callable[[Call], Verdict]:
    """An op along the dims its argument ``dims_at`` names (``default``, or all if None, where it names none),
    keeping them if ``keep_at``'s argument is true; the outputs it returns beside (indices) are shaped alike."""

    def rule(c: Call) -> Verdict:
        x = c.args[0]
        if len(c.args) > 1 and isinstance(c.args[1], Tensor):  # max(a, b), min(a, b): elementwise
            return _pointwise_rule(c)
        tags = c.tags_of(x)
        value = c.arg(dims_at, "dim", default) if dims_at is not None else None
        dims = dims_named(default if value is None else value, x.dim())
        along = list(range(x.dim())) if dims is None else dims
        if c.name == "mean" and dims is None and all(t.dim() == 0 for t in c.outs):
            return c.each({POOLED: NO_RANGE})
        if any(d in tags for d in along):
            hit = min(d for d in along if d in tags)
            return c.refuse(f"takes {c.name.lstrip('_')} of a {list(x.shape)} tensor along the sequence (its dim "
                            f"{hit}, which holds the part's positions{what})", tags)
        keep = bool(c.arg(keep_at, "keepdim", False)) if keep_at is not None else True
        if keep or all(t.dim() == x.dim() for t in c.outs):
            return c.each(tags)
        return c.each({d - sum(r < d for r in along): v for d, v in tags.items()})

    return rule


def _scan(what: str) -> Callable[[Call], Verdict]:
    return _reduction(1, None, what)


def _layer_norm(c: Call) -> Verdict:
    x, shape = c.args[0], c.arg(1, "normalized_shape")
    tags = c.tags_of(x)
    spans = range(x.dim() - len(shape), x.dim())
    if any(d in tags for d in spans):
        return c.refuse(f"normalizes a {list(x.shape)} tensor over its last {len(shape)} dims, one of which holds "
                        "the part's positions", tags)
    return c.each(tags)


def _group_norm(c: Call) -> Verdict:
    x = c.args[0]
    tags = c.tags_of(x)
    if any(d != 0 for d in tags):
        return c.refuse(f"group-normalizes a {list(x.shape)} tensor over its channels and dims past them, which "
                        "hold the part's positions", tags)
    return c.each(tags)


def _batch_norm(c: Call) -> Verdict:
    x = c.args[0]
    tags = c.tags_of(x)
    training = not c.name.endswith("no_training") and c.arg(5, "training", True) is not False
    if training and any(d != 1 for d in tags):
        return c.refuse(f"batch-normalizes a {list(x.shape)} tensor over every dim but the channels, the "
                        "positions too", tags)
    return Verdict([dict(tags) if t.dim() == x.dim() else {} for t in c.outs], None)


def _matmul(c: Call) -> Verdict:
    """mm / bmm and their fused forms: the product contracts dim -1 of the first and -2 of the second."""
    at = 1 if c.name in ("addmm", "baddbmm", "addmv", "addbmm") else 0
    a, b = c.args[at], c.args[at + 1]
    ta, tb = c.tags_of(a), c.tags_of(b)
    if a.dim() - 1 in ta or (b.dim() >= 2 and b.dim() - 2 in tb) or (b.dim() == 1 and 0 in tb):
        return c.refuse(f"multiplies a {list(a.shape)} by a {list(b.shape)} tensor contracting a dim that holds "
                        "the part's positions (attention without softmax, a Gram matrix of the tokens?)",
                        union(ta, tb))
    if c.name == "addbmm" and (0 in ta or 0 in tb):
        return c.refuse("sums products over a batch of matrices that holds the part's positions", union(ta, tb))
    out_ndim = c.outs[0].dim()
    tags: Tags = {d: r for d, r in ta.items() if d < a.dim() - 1}
    if b.dim() >= 2 and b.dim() - 1 in tb:
        tags = union(tags, {out_ndim - 1: tb[b.dim() - 1]})
    if b.dim() == 3 and 0 in tb:
        tags = union(tags, {0: tb[0]})
    if at == 1 and isinstance(c.args[0], Tensor):
        tags = union(tags, broadcast(c.tags_of(c.args[0]), c.args[0].dim(), out_ndim))
    return c.each(tags)


def _dot(c: Call) -> Verdict:
    if c.tags_of(c.args[0]) or c.tags_of(c.args[1]):
        return c.refuse("takes a dot product over the part's positions")
    return c.each({})


def _attention_kernel(c: Call) -> Verdict:
    """sdpa's kernels ([batch, heads, seq, head_dim]): keys along dim 2 holding positions are attended alone."""
    q, k = c.args[0], c.args[1]
    tq, tk = c.tags_of(q), c.tags_of(k)
    tags = {d: r for d, r in tq.items() if d < 3}
    outs = [dict(tags) if t.dim() >= 3 and tuple(t.shape[:3]) == tuple(q.shape[:3]) else {} for t in c.outs]
    if 2 in tk or 3 in tq or 3 in tk:
        return Verdict(outs, f"calls scaled_dot_product_attention ({readable(c.func)}) on a {list(k.shape)} key "
                             "tensor whose dim 2 holds the part's positions")
    return Verdict(outs, None)


def _pool(c: Call) -> Verdict:
    """avg / max pooling over the last ``len(kernel_size)`` dims (pool1d arrives as pool2d over a unit dim): a
    window of one element, stride one and no padding along a dim that holds positions is elementwise there."""
    x = c.args[0]
    tags = c.tags_of(x)
    kernel = list(c.arg(1, "kernel_size"))
    stride = list(c.arg(2, "stride", None) or kernel)
    padding = c.arg(3, "padding", 0)
    padding = list(padding) if isinstance(padding, (list, tuple)) else [padding]
    first = x.dim() - len(kernel)
    for d in tags:
        i = d - first
        if i >= 0 and (kernel[i] != 1 or _at(stride, i) != 1 or _at(padding, i) != 0):
            return c.refuse(f"pools a {list(x.shape)} tensor over its dim {d}, which holds the part's positions, "
                            f"with a window of {kernel[i]}", tags)
    return Verdict([dict(tags) if t.dim() == x.dim() else {} for t in c.outs], None)


def _convolution(c: Call) -> Verdict:
    x, w = c.args[0], c.args[1]
    tags = c.tags_of(x)
    stride, padding = (list(c.arg(i, "")) for i in (3, 4))
    transposed = bool(c.arg(6, "transposed"))
    if 1 in tags or c.tags_of(w):
        return c.refuse(f"convolves a {list(x.shape)} tensor whose channels hold the part's positions", tags)
    for d in tags:
        if d < 2:
            continue
        i = d - 2
        kernel = w.shape[d]
        moved = transposed or kernel > 1 or _at(stride, i) != 1 or _at(padding, i) != 0
        if moved:
            return c.refuse(f"convolves a {list(x.shape)} tensor over its dim {d}, the sequence, with a kernel of "
                            f"{kernel}", tags)
    return c.each(tags)


def _at(values: list[Any], i: int) -> Any:
    return values[i] if i < len(values) else values[-1] if values else 0


def _embedding(c: Call) -> Verdict:
    weight, ids = c.args[0], c.args[1]
    if c.tags_of(weight):
        return c.refuse("looks up rows of a table that holds the part's positions")
    return c.each(c.tags_of(ids))


def _index_select(c: Call) -> Verdict:
    x, index = c.args[0], c.arg(2, "index")
    d = dim_index(c.arg(1, "dim"), x.dim())
    tags = c.tags_of(x)
    if d in tags:
        return c.refuse(f"selects along dim {d} of a {list(x.shape)} tensor, which holds the part's positions", tags)
    held = c.tags_of(index).get(0)  # the index, 1-D, holds positions: so does the output's dim
    return c.each(union(tags, {d: held} if held is not None else {}))


def _gather(c: Call) -> Verdict:
    x, index = c.args[0], c.arg(2, "index")
    d = dim_index(c.arg(1, "dim"), x.dim())
    tags = c.tags_of(x)
    if d in tags:
        return c.refuse(f"gathers along dim {d} of a {list(x.shape)} tensor, which holds the part's positions", tags)
    return c.each(union({k: v for k, v in tags.items() if k != d}, c.tags_of(index)))


def _scatter(c: Call) -> Verdict:
    """scatter / index_add / index_copy (self, dim, index, source): refused along a tagged dim."""
    x = c.args[0]
    d = dim_index(c.arg(1, "dim"), x.dim())
    tensors = [t for t in c.args[2:] if isinstance(t, Tensor)]
    tags = [c.tags_of(x), *(c.tags_of(t) for t in tensors)]
    index = c.arg(2, "index")
    if c.name in ("index_add", "index_add_", "index_copy", "index_copy_") and VALUED in c.tags_of(index):
        # rows put back at the positions they were taken from (a router's tokens, through their experts)
        return c.each({k: v for k, v in union(*tags).items() if k >= 0})
    if any(d in t for t in tags) or (c.name.startswith("index_") and c.tags_of(index)):
        return c.refuse(f"writes along dim {d} of a {list(x.shape)} tensor by an index, across the part's positions",
                        union(*tags))
    return c.each(union(*(t for t, x_ in zip(tags, [x, *tensors], strict=True) if x_.dim() == x.dim())))


def _index(c: Call) -> Verdict:
    """x[i, j]: refused when an index falls on a dim that holds positions (the dims of the indices hold theirs)."""
    x, indices = c.args[0], list(c.arg(1, "indices"))
    tags = c.tags_of(x)
    given = [i for i, t in enumerate(indices) if t is not None]
    spans = [i + k for i in given for k in range(indices[i].dim() if indices[i].dtype == torch.bool else 1)]
    by_positions = all(VALUED in c.tags_of(indices[i]) for i in given if i in tags)
    if any(d in tags for d in spans) and not by_positions:
        return c.refuse(f"indexes a {list(x.shape)} tensor along a dim that holds the part's positions (a token "
                        "picked, or tokens selected?)", tags)
    if any(indices[i].dtype == torch.bool for i in given):
        return c.refuse(f"indexes a {list(x.shape)} tensor by a boolean mask", tags) if tags else c.each({})
    out = c.outs[0]
    index_ndim = max(indices[i].dim() for i in given)
    contiguous = given == list(range(given[0], given[-1] + 1))
    start = given[0] if contiguous else 0
    new: Tags = {}
    for i in given:
        new = union(new, {d + start: r for d, r in broadcast(c.tags_of(indices[i]), indices[i].dim(),
                                                                 index_ndim).items()})
    rest = [d for d in range(x.dim()) if d not in given]
    for i, d in enumerate(rest):
        at = index_ndim + i if not contiguous else d if d < given[0] else d - len(given) + index_ndim
        if d in tags and at < out.dim():
            new = union(new, {at: tags[d]})
    return c.each({k: v for k, v in new.items() if k >= 0})


def _index_put(c: Call) -> Verdict:
    x, indices, values = c.args[0], list(c.arg(1, "indices")), c.arg(2, "values")
    tags = c.tags_of(x)
    given = [i for i, t in enumerate(indices) if t is not None]
    spans = [i + k for i in given for k in range(indices[i].dim() if indices[i].dtype == torch.bool else 1)]
    if c.tags_of(values) or (any(d in tags for d in spans) and values.numel() != 1):
        return c.refuse(f"writes into a {list(x.shape)} tensor by an index across the part's positions", tags)
    return c.each(union(tags, *(broadcast(c.tags_of(indices[i]), indices[i].dim(), x.dim()) for i in given)))


def _nonzero(c: Call) -> Verdict:
    """The places of a tensor's nonzero elements, [n, ndim]: its rows are some of the part's positions, and its
    values positions (an index that takes rows from a tensor that holds them, and puts them back)."""
    x, out = c.args[0], c.outs[0]
    if c.tags_of(x) and out.dim() == 2:
        return c.each({0: (1, max(int(out.shape[0]), 1)), VALUED: NO_RANGE})
    return c.refuse(f"takes the nonzero elements of a {list(x.shape)} tensor that holds the part's positions")


def _full_read(what: str) -> Callable[[Call], Verdict]:
    def rule(c: Call) -> Verdict:
        if any(c.tags_of(t) for t in c.args if isinstance(t, Tensor)):
            return c.refuse(f"{what} a tensor that holds the part's positions")
        return c.each({})

    return rule


_RULES: dict[str, Callable[[Call], Verdict]] = {
    **MOVE_RULES,
    **dict.fromkeys(["empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                     "randint_like"], _like_rule),
    **dict.fromkeys(["sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "any", "all", "logsumexp",
                     "count_nonzero", "aminmax"], _reduction(1, 2, "")),
    **dict.fromkeys(["max", "min", "argmax", "argmin", "median", "nanmedian"], _reduction(1, 2, "")),
    "mode": _reduction(1, 2, "", -1),
    **dict.fromkeys(["var", "std", "var_mean", "std_mean"], _reduction(1, 3, "")),
    "linalg_vector_norm": _reduction(2, 3, ""),
    "norm": _reduction(2, 3, ""),
    **dict.fromkeys(["_softmax", "_log_softmax", ": attention scores?", "log_softmax", "_safe_softmax"],
                    _reduction(1, None, ": attention scores?")),
    **dict.fromkeys(["cumsum", "cumsum_", "cumprod", "cumprod_", "cummax", "cummin", "logcumsumexp",
                     "_logcumsumexp"], _scan("")),
    **dict.fromkeys(["sort", "argsort"], _reduction(1, None, "", -1)),
    "topk": _reduction(2, None, "", -1),
    "kthvalue": _reduction(2, 3, "", -1),
    "glu": _reduction(1, None, "", -1),
    "native_layer_norm": _layer_norm,
    "_fused_rms_norm": _layer_norm,
    "rms_norm": _layer_norm,
    "layer_norm": _layer_norm,
    "native_group_norm": _group_norm,
    **dict.fromkeys(["native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                     "_native_batch_norm_legit_functional"], _batch_norm),
    **dict.fromkeys(["mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "_int_mm"], _matmul),
    **dict.fromkeys(["dot", "vdot"], _dot),
    **dict.fromkeys(["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                     "_efficient_attention_forward"], _attention_kernel),
    **dict.fromkeys(["convolution", "_convolution"], _convolution),
    **dict.fromkeys(["avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
                     "max_pool2d_with_indices", "max_pool3d_with_indices"], _pool),
    "nonzero": _nonzero,
    "argwhere": _nonzero,
    "embedding": _embedding,
    "index_select": _index_select,
    "gather": _gather,
    **dict.fromkeys(["scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                     "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_"], _scatter),
    **dict.fromkeys(["index", "_unsafe_index"], _index),
    **dict.fromkeys(["index_put", "index_put_", "_index_put_impl_"], _index_put),
    **dict.fromkeys(["_local_scalar_dense", "equal", "is_nonzero", "allclose"], _full_read("reads every value of")),
    **dict.fromkeys(["_to_copy", "clone", "detach", "alias", "lift_fresh", "native_dropout", "contiguous"],
                    _self_rule),
}
