"""Ops across a Colwise output's features, which a rank computes on its slice of them (split_watch.py refuses).

``Colwise()`` gives each rank a contiguous 1/tp of a projection's output features. An op that
reduces across them (``q.norm(dim=-1)``, ``q.mean(-1)``, ``q.sum()``, ``quantile``, ``kthvalue``,
``count_nonzero``, ``trapezoid``, a matrix norm or any matrix function of ``(tokens, features)``:
``svd``, ``qr``, ``det``, ``tril``), normalises over them (``F.normalize(q, dim=-1)``, a ``layer_norm``
or ``rms_norm`` with no weight, ``q.softmax(-1)``, an ``instance_norm`` or a training ``batch_norm``
taking them as a spatial dim, a loss term over them) or orders them (``cumsum``, ``sort``, ``flip``,
``roll``, ``fftshift`` and the transforms along them) computes it over the rank's slice alone; no
parameter's gradient shows it, and the model trains another model without an error. So does an op
that takes the features by position, for a rank's positions are its slice's: an index, gather,
scatter, ``index_select``, ``select`` or ``narrow`` of them, a slice (``q[..., :rot]``, rotate_half's
halves; a strided ``q[..., ::2]`` takes the same features of a slice as of the whole, and passes), a
``repeat``/``tile`` or ``torch.cat`` along them, a ``pad`` of them, a convolution, pool or
interpolation with the features as a spatial dim (windows that tile them, as wide as their stride,
pass, as does a nearest interpolation by a whole factor: each feature repeated), ``unfold`` into
overlapping windows. And so does a contraction of the features of two Colwise
outputs (single-head attention's ``q @ k.transpose(-1, -2)``, ``einsum("btd,bsd->bts", q, k)``,
``F.scaled_dot_product_attention`` on outputs never viewed per head, ``vecdot``, ``cdist``): each
rank computes a partial sum, which nothing sums; or a product of their features by each other
(``outer``, ``kron``, linear attention's ``k.transpose(-1, -2) @ v``, ``einsum("btd,bte->bde")``): a
rank holds the block of its slices alone.

:func:`mixed` finds such an op where :class:`~.split_watch.SplitWatch` follows the output with its
features whole (last, or moved by a transpose, ``movedim`` or ``unsqueeze(-1)``: :func:`moved_features`;
or kept by a reduction, ordering or gather along another dim: ``q.mean(1)``, ``q.softmax(1)``). What
passes: the same ops on a per-head view (Qwen3's ``q_norm`` on ``(b, t, heads, head_dim)``, a
softmax over the attention scores: head_views.py follows those, each head whole on a rank),
reductions, orderings, gathers and pads over other dims (a mean over the sequence), a depthwise
convolution over the sequence and a batch norm with the features as channels, elementwise ops and
losses with reduction="none", and a Rowwise's own ``linear`` (a contraction with its weight, split
alike, which the Rowwise sums). A norm with a weight is left to the checks that name the weight (its
shape, or its gradient differing across ranks: OLMo-2's ``q_norm``). Unseen: a contraction with a
parameter or constant of the rank's width (``q @ self.mix``), a mask or index built from the rank's
width (``torch.where(torch.arange(q.shape[-1]) < k, ...)``), an op after the features are flattened
with the leading dims (``q.reshape(-1)``) or factored into blocks outermost (``q.view(b, t, 2,
-1)``, read as a per-head view), a cut of transposed features, a reduction of a ``Colwise(fused=N)``
output's blocks after the module cuts them apart, and an op on a result that no longer holds the
features whole (the output of an einsum or ``mv`` keeping them).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .split_watch import _Output

# Where a tensor holds a followed Colwise output's features: the output, and the dim; None elsewhere.
Features = Callable[[Any], "tuple[_Output, int] | None"]

_EVERY = "every"  # no dim given: the op takes every dim (sum(), amax(dim=()), roll(shifts) flattened)
_LEGACY = "legacy"  # softmax's dim=None: torch picks dim 0 of a 0-, 1- or 3-dim input, else dim 1
_KEYWORD = 99  # an op that takes its dims by keyword only (or has none: histc, take)
_MATRIX = (-2, -1)  # a matrix function: over the last two dims
# Reductions, normalisations and orderings along dims, by name: where the op takes its dims
# positionally, and what it takes given none. Boolean tests (any, all) are left out: a module reads
# them (an isinf check), it does not train on them.
_ALONG: dict[str, tuple[int, Any]] = {
    **dict.fromkeys((
        "sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "var", "std",
        "median", "cumsum", "cumprod", "flip", "var_mean", "std_mean", "nanmean", "nansum", "nanmedian",
        "aminmax", "logcumsumexp", "cummax", "cummin", "count_nonzero", "special_logsumexp", "fft_fftshift",
        "fft_ifftshift",
    ), (1, _EVERY)),
    **dict.fromkeys(("softmax", "log_softmax", "softmin", "special_softmax", "special_log_softmax"), (1, _LEGACY)),
    # Along one dim, the last given none (diff's, the 1-D transforms').
    **dict.fromkeys(("diff", "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft"), (2, -1)),
    **dict.fromkeys(("sort", "argsort", "mode"), (1, -1)),
    **dict.fromkeys(("topk", "kthvalue"), (2, -1)),
    **dict.fromkeys(("quantile", "nanquantile"), (2, _EVERY)),
    **dict.fromkeys(("norm", "linalg_vector_norm", "linalg_norm", "roll"), (2, _EVERY)),
    **dict.fromkeys(("normalize", "cosine_similarity"), (2, 1)),
    # The n-dim and 2-dim transforms: over every dim, or the last two, given none.
    **dict.fromkeys(("fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn", "fft_hfftn", "fft_ihfftn"), (2, _EVERY)),
    **dict.fromkeys(("fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2", "fft_hfft2", "fft_ihfft2"), (2, _MATRIX)),
    # Integrals, gradients and distances along the last dim (or every one), their dims by keyword.
    **dict.fromkeys(("trapezoid", "trapz", "cumulative_trapezoid", "pairwise_distance", "pdist",
                     "linalg_vecdot"), (_KEYWORD, -1)),
    **dict.fromkeys(("gradient", "dist", "histc", "take", "masked_select"), (_KEYWORD, _EVERY)),
    "take_along_dim": (2, _EVERY), "linalg_vander": (_KEYWORD, -1), "unique": (4, _EVERY),
    "unique_consecutive": (3, _EVERY),
    "gumbel_softmax": (4, -1), "msort": (_KEYWORD, 0), "flipud": (_KEYWORD, 0), "fliplr": (_KEYWORD, 1),
    "rot90": (2, (0, 1)), "unbind": (1, 0), "diagonal": (_KEYWORD, (0, 1)), "linalg_diagonal": (_KEYWORD, _MATRIX),
    # Matrix functions and norms: over the last two dims (a matrix norm's given by keyword or after ord).
    "linalg_matrix_norm": (2, _MATRIX), "frobenius_norm": (1, _MATRIX), "nuclear_norm": (1, _MATRIX),
    **dict.fromkeys((
        "linalg_svdvals", "linalg_svd", "svd", "svd_lowrank", "pca_lowrank", "linalg_qr", "qr", "linalg_pinv",
        "pinverse", "linalg_det", "det", "logdet", "slogdet", "linalg_slogdet", "linalg_inv", "linalg_inv_ex",
        "inverse", "linalg_eig", "linalg_eigvals", "linalg_eigh", "linalg_eigvalsh", "linalg_cholesky",
        "linalg_cholesky_ex", "cholesky", "matrix_exp", "linalg_matrix_exp", "linalg_matrix_power", "matrix_power",
        "linalg_matrix_rank", "linalg_cond", "trace", "lu", "linalg_lu", "linalg_lu_factor", "linalg_lu_factor_ex",
        "linalg_ldl_factor", "linalg_ldl_factor_ex", "geqrf", "tril", "triu", "linalg_solve", "linalg_lstsq",
    ), (_KEYWORD, _MATRIX)),
}
# Ops that take the features by position (an index, a gather or a scatter along them, a narrow or select of
# them), and where each takes its dim: a rank's positions are those of its slice, not of the whole.
_BY_POSITION = {
    **dict.fromkeys((
        "index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy",
        "index_fill", "index_reduce", "select", "narrow",
    ), 1),
}
# Ops that treat dims as spatial or channel dims: the last k (convolutions, pools), those after the
# channels (interpolate, instance_norm), or the channels (channel_shuffle), where they mix the values.
_SPATIAL = {
    **{f"{op}{k}d": k for k in (1, 2, 3) for op in (
        "conv", "conv_transpose", "avg_pool", "max_pool", "lp_pool", "adaptive_avg_pool", "adaptive_max_pool",
        "fractional_max_pool",
    )},
    **{f"{op}{k}d_with_indices": k for k in (1, 2, 3)
       for op in ("max_pool", "adaptive_max_pool", "fractional_max_pool")},
    **dict.fromkeys(("pixel_shuffle", "pixel_unshuffle"), 3),
}
_AFTER_CHANNELS = ("interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "instance_norm")
_CHANNELS = ("channel_shuffle", "native_channel_shuffle")
# Normalisations over the trailing dims (group_norm: over groups of dim 1 and the dims after it), and
# where each takes its parameters: refused with none (a norm with one is left to the checks naming it).
_NORMS = {"layer_norm": ((2, "weight"), (3, "bias")), "rms_norm": ((2, "weight"),),
          "group_norm": ((2, "weight"), (3, "bias"))}
# Contractions of two operands, and where each takes them (left, right): b.__rmatmul__(a) is a @ b.
_CONTRACTIONS = {
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm", "mv", "linear"), (0, 1)),
    "__rmatmul__": (1, 0), **dict.fromkeys(("addmm", "baddbmm", "addmv", "addbmm"), (1, 2)),
}


def mixed(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features, heads: bool = False
) -> tuple[_Output, str] | None:
    """The followed output the op ``name`` computes across the features of, and what it does (for the
    refusal); None where it computes each feature on its own, or takes no followed output. ``heads``:
    ``features`` finds a per-head view's heads dim, whose cuts and indices head_views.py judges."""
    if heads and name in _CUT_BY_HEAD_VIEWS:
        return None
    if name in _ALONG:
        return _along(name, args, kwargs, features)
    if name in _NORMS:
        return _norm(name, args, kwargs, features)
    if name in _CONTRACTIONS:
        return _contraction(name, args, features)
    if name == "scaled_dot_product_attention":
        q, k = (kwargs.get(key, args[at] if len(args) > at else None) for at, key in ((0, "query"), (1, "key")))
        found = _last(q, features)
        if found is None or _last(k, features) is None:
            return None
        return found[0], "scaled_dot_product_attention of q and k never viewed per head, over their features"
    if name == "einsum":
        return _einsum(args, features)
    if name in _ACROSS_OTHERS:
        return _across_others(name, args, kwargs, features)
    if name in _PAIRWISE:
        return _pairwise(name, args, kwargs, features)
    if name in _LOSSES or name in _LOSSES_ALONG:
        return _loss(name, args, kwargs, features)
    if name in ("outer", "ger", "addr", "kron", "linalg_multi_dot", "chain_matmul"):
        return _products(name, args, features)
    return _by_position(name, args, kwargs, features)


# Ops that mix every dim but the one they are given: renorm(x, p, dim, maxnorm) scales each slice
# along ``dim`` by its norm over the others (norm_except_dim too: weight_norm's); local_response_norm
# mixes dim 1 (channels) alone.
_ACROSS_OTHERS = {"renorm": 2, "local_response_norm": None, "norm_except_dim": 2}
# Two operands' last dims against each other (cdist's distances, inner's and dot's products), and
# tensordot's contracted dims: with two followed outputs' features there, a partial sum on each rank.
_PAIRWISE = ("cdist", "inner", "dot", "vdot", "tensordot")
# Cuts and indices of a per-head view's heads: head_views.py refuses those taking some of a rank's heads
# and passes a cut into single heads (unbind, select), so they are not ops across the heads here.
_CUT_BY_HEAD_VIEWS = {"unbind", "__getitem__", "index_select", "select", "narrow", "cat", "concat", "concatenate"}
# Losses in the forward (an auxiliary term): over every dim, with the reduction of all but "none" ...
_LOSSES = (
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "kl_div", "soft_margin_loss", "poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss",
    "margin_ranking_loss",
)
# ... and these, over the last dim whatever the reduction.
_LOSSES_ALONG = (
    "cosine_embedding_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss", "multi_margin_loss",
    "multilabel_margin_loss", "multilabel_soft_margin_loss",
)


def _loss(name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features) -> tuple[_Output, str] | None:
    found = next((f for f in map(features, (*args[:3], *kwargs.values())) if f is not None), None)
    if found is None:
        return None
    if name in _LOSSES_ALONG:
        return found[0], f"{name} over its features"
    if kwargs.get("reduction", "mean") == "none":
        return None
    reduction = kwargs.get("reduction", "mean")
    return found[0], f"{name} with reduction={reduction!r}, over every dim, its features among them"


def _by_position(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features
) -> tuple[_Output, str] | None:
    """An op taking the features by position, or treating their dim as a spatial one (see _BY_POSITION)."""
    t = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if name in ("cat", "concat", "concatenate", "hstack", "dstack"):
        return _joined(name, args, kwargs, features)
    if name == "embedding":  # max_norm renormalises each row of the weight over its features
        weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
        found = features(weight)
        max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
        if found is None or max_norm is None or not isinstance(weight, Tensor) or found[1] != weight.dim() - 1:
            return None
        return found[0], "embedding with max_norm, which renormalises each row over its features"
    found = features(t)
    if found is None or not isinstance(t, Tensor):
        return None
    entry, at = found
    n = t.dim()
    if name in _BY_POSITION:
        dim = kwargs.get("dim", args[_BY_POSITION[name]] if len(args) > _BY_POSITION[name] else None)
        if not isinstance(dim, int) or dim % n != at:
            return None
        if name == "narrow" and _whole(t, at, args, kwargs):
            return None
        return entry, f"{name} along dim {at - n}, which holds its features, by position: a rank's are its slice's"
    if name == "__getitem__" and len(args) > 1 and entry.fused == 1:
        item = _index_of(t, args[1], at)
        if item is None or _keeps_every_rank_feature(item, t.shape[at]):
            return None
        what = f"a slice {item!r}" if isinstance(item, slice) else f"an index ({type(item).__name__})"
        return entry, f"{what} of dim {at - n}, which holds its features, by position: a rank's are its slice's"
    if name in ("repeat", "tile"):
        sizes: Any = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        sizes = kwargs.get("dims", kwargs.get("repeats", sizes))
        k = len(sizes) - n + at
        if 0 <= k < len(sizes) and isinstance(sizes[k], int) and sizes[k] > 1:
            return entry, f"{name} of dim {at - n}, which holds its features: copies of a rank's slice, not of all"
        return None
    if name == "pad":
        pad = kwargs.get("pad", args[1] if len(args) > 1 else ())
        k = 2 * (n - 1 - at)
        if k + 1 < len(pad) and (pad[k] or pad[k + 1]):
            return entry, f"pad of dim {at - n}, which holds its features, at its edges: a rank pads its slice's"
        return None
    if name == "sum_to_size":
        size = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        k = len(size) - n + at
        if 0 <= k < len(size) and size[k] == 1 and t.shape[at] > 1:
            return entry, f"sum_to_size over dim {at - n}, which holds its features"
        return None
    if name == "unfold" and ("dimension" in kwargs or (len(args) == 4 and all(isinstance(a, int) for a in args[1:]))):
        dim, size, step = (kwargs.get(key, args[i] if len(args) > i else 0)
                           for i, key in ((1, "dimension"), (2, "size"), (3, "step")))
        if dim % n == at and step < size:
            return entry, f"unfold of dim {at - n}, which holds its features, into overlapping windows"
        return None
    return _spatial(name, t, at, n, args, kwargs, entry)


def _spatial(
    name: str, t: Tensor, at: int, n: int, args: Sequence[Any], kwargs: dict[str, Any], entry: _Output
) -> tuple[_Output, str] | None:
    """A convolution, pool, interpolation or norm treating the features' dim as a spatial or channel dim."""
    what = f"{name} over dim {at - n}, which holds its features, as a spatial dim"
    if name in _CHANNELS:
        return (entry, f"{name} across dim 1, which holds its features") if at == 1 and n > 1 else None
    if name in _AFTER_CHANNELS:
        return (entry, what) if at >= 2 and not _repeats(name, args, kwargs) else None
    if name == "batch_norm":
        training = kwargs.get("training", args[5] if len(args) > 5 else False)
        running = kwargs.get("running_mean", args[1] if len(args) > 1 else None)
        if n > 1 and at != 1 and (training or running is None):
            return entry, f"batch_norm with the batch's statistics over dim {at - n}, which holds its features"
        return None
    if name == "unfold":  # F.unfold (im2col) of (N, C, H, W)
        return (entry, what) if at >= n - 2 and not _tiles(name, args, kwargs, 2, at - (n - 2)) else None
    k = _SPATIAL.get(name)
    if k is None or at < n - k:
        return None
    if _tiles(name, args, kwargs, k, at - (n - k)):
        return None
    return entry, what


def _repeats(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """An interpolation to the nearest by a whole scale factor (or its inverse): each feature repeated (or
    every k-th taken), as ``repeat_interleave`` (a strided slice) does, the same on a slice as on the whole."""
    if name not in ("interpolate", "upsample", "upsample_nearest"):
        return False
    mode = "nearest" if name == "upsample_nearest" else kwargs.get("mode", args[3] if len(args) > 3 else "nearest")
    size = kwargs.get("size", args[1] if len(args) > 1 else None)
    scale = kwargs.get("scale_factor", args[2] if len(args) > 2 else None)
    scales = scale if isinstance(scale, (list, tuple)) else [scale]
    return mode in ("nearest", "nearest-exact") and size is None and all(
        isinstance(f, (int, float)) and f > 0 and (float(f).is_integer() or (1 / f).is_integer()) for f in scales
    )


def _tiles(name: str, args: Sequence[Any], kwargs: dict[str, Any], k: int, j: int) -> bool:
    """Whether a convolution's, a pool's or F.unfold's windows along spatial dim ``j`` (of ``k``) tile it:
    as wide as their stride, no padding or dilation, so that a rank's slice is whole windows."""
    def one(key: str, at: int, default: Any) -> Any:
        value = kwargs.get(key, args[at] if len(args) > at else default)
        value = default if value is None else value
        return value[j] if isinstance(value, (list, tuple)) and len(value) == k else value

    if name.startswith(("adaptive", "fractional", "pixel")):
        return False
    if name.startswith("conv"):
        weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
        if not isinstance(weight, Tensor) or weight.dim() < k:
            return False
        kernel = weight.shape[weight.dim() - k + j]
        at = (3, 4, 7) if name.startswith("conv_transpose") else (3, 4, 5)
        stride, padding, dilation = one("stride", at[0], 1), one("padding", at[1], 0), one("dilation", at[2], 1)
    else:
        first = 2 if name.startswith("lp_pool") else 1
        kernel = one("kernel_size", first, 1)
        stride = one("stride", first + 1, kernel)
        padding = one("padding", first + 2, 0) if name.startswith(("avg", "max")) else 0
        dilation = one("dilation", first + 3, 1) if name.startswith("max") else 1
        if name == "unfold":  # F.unfold(input, kernel_size, dilation, padding, stride)
            dilation, padding, stride = one("dilation", 2, 1), one("padding", 3, 0), one("stride", 4, 1)
    padding = 0 if padding == "valid" else padding
    return isinstance(kernel, int) and kernel == stride and padding == 0 and (dilation == 1 or kernel == 1)


def _joined(name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features) -> tuple[_Output, str] | None:
    """torch.cat of tensors along a dim holding a followed output's features: a rank joins its slices."""
    tensors = kwargs.get("tensors", args[0] if args else ())
    if not isinstance(tensors, (list, tuple)):
        return None
    for t in tensors:
        found = features(t)
        if found is None or not isinstance(t, Tensor):
            continue
        n = t.dim()
        if name in ("hstack", "dstack"):
            dim = (2 if name == "dstack" else 1) if n > 1 else 0
        else:
            dim = kwargs.get("dim", kwargs.get("axis", args[1] if len(args) > 1 else 0))
        if isinstance(dim, int) and dim % n == found[1]:
            return found[0], (
                f"{name} along dim {found[1] - n}, which holds its features: a rank joins its slice of each, "
                "not the whole tensors"
            )
    return None


def _whole(t: Tensor, at: int, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    start = kwargs.get("start", args[2] if len(args) > 2 else 0)
    length = kwargs.get("length", args[3] if len(args) > 3 else None)
    return isinstance(start, int) and start % max(t.shape[at], 1) == 0 and length == t.shape[at]


def _index_of(t: Tensor, index: Any, at: int) -> Any:
    """The item of ``t[index]`` that indexes dim ``at``; None where it takes that dim whole (or none does)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, Tensor) and i.dtype == torch.bool and i.dim() > 1 for i in items):
        return None  # a mask of several dims (x[x > 0]): elementwise, flattened
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items[e:e + 1] = [slice(None)] * (t.dim() - consumed)
    in_dim = 0
    for item in items:
        if item is None:
            continue
        if in_dim == at:
            return None if isinstance(item, slice) and item == slice(None) else item
        in_dim += 1
    return None


def _keeps_every_rank_feature(item: Any, size: int) -> bool:
    """A slice taking every step-th feature from the first (``[..., ::2]``, ``[..., 1::2]``: a rotary's
    interleaved halves), the same ones of a rank's slice as of the whole where the step divides it."""
    if not isinstance(item, slice):
        return False
    start, stop, step = item.indices(size)
    return step >= 1 and start < step and stop == size and size % step == 0


def _across_others(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features
) -> tuple[_Output, str] | None:
    t = args[0] if args else kwargs.get("input")
    found = features(t)
    if found is None or not isinstance(t, Tensor):
        return None
    entry, at = found
    dim_at = _ACROSS_OTHERS[name]
    if dim_at is None:  # local_response_norm: across dim 1
        return (entry, f"{name} across dim 1, which holds its features") if at == 1 else None
    dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else 0 if name == "norm_except_dim" else None)
    if name == "norm_except_dim" and dim == -1:  # weight_norm(dim=None): the norm of every dim
        return entry, "norm_except_dim with dim=-1, over every dim, its features among them"
    if not isinstance(dim, int) or dim % t.dim() == at:
        return None
    return entry, f"{name} along dim {dim}, whose norm is taken over the other dims, its features among them"


def _pairwise(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features
) -> tuple[_Output, str] | None:
    if len(args) < 2:
        return None
    left, right = args[0], args[1]
    a, b = features(left), features(right)
    if a is None or b is None or not isinstance(left, Tensor) or not isinstance(right, Tensor):
        return None
    if name == "tensordot":
        dims = kwargs.get("dims", args[2] if len(args) > 2 else 2)
        if isinstance(dims, int):
            mine, theirs = set(range(left.dim() - dims, left.dim())), set(range(dims))
        else:
            first, second = (d if isinstance(d, (list, tuple)) else (d,) for d in dims)
            mine, theirs = {d % left.dim() for d in first}, {d % right.dim() for d in second}
        if a[1] not in mine or b[1] not in theirs:
            return None
    elif a[1] != left.dim() - 1 or b[1] != right.dim() - 1:
        return None
    return a[0], f"{name} of its features with those of {b[0].label!r}: a partial sum on each rank, which nothing sums"


def moved_features(func: Any, name: str, t: Tensor, args: Sequence[Any], out: Any) -> int | None:
    """Where ``out``, a transpose or permute of ``t`` (features last), holds them; None for another op."""
    n = t.dim()
    if not isinstance(out, Tensor) or out.dim() != n or not args or args[0] is not t:
        return None
    if name in ("transpose", "swapaxes", "swapdims") and len(args) >= 3 and all(isinstance(a, int) for a in args[1:3]):
        a, b = args[1] % n, args[2] % n
        return b if a == n - 1 else a if b == n - 1 else n - 1
    if name == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return [d % n for d in order].index(n - 1) if len(order) == n else None
    if name in ("movedim", "moveaxis") and len(args) >= 3:
        return _moved_to(n, args[1], args[2])
    if name == "t" and n == 2:
        return 0
    if name == "adjoint" and n >= 2:
        return n - 2
    getter = getattr(func, "__self__", None)
    if getter is Tensor.mT and n >= 2:
        return n - 2
    if getter is Tensor.T:
        return 0
    return None


def _moved_to(n: int, source: Any, destination: Any) -> int | None:
    """Where ``movedim(t, source, destination)`` puts the last of ``t``'s ``n`` dims."""
    sources = [source] if isinstance(source, int) else list(source)
    destinations = [destination] if isinstance(destination, int) else list(destination)
    if len(sources) != len(destinations) or not all(isinstance(d, int) for d in (*sources, *destinations)):
        return None
    order: list[int | None] = [None] * n
    for src, dst in zip(sources, destinations, strict=True):
        order[dst % n] = src % n
    rest = iter(d for d in range(n) if d not in {s % n for s in sources})
    order = [d if d is not None else next(rest) for d in order]
    return order.index(n - 1)


def keeps_features(name: str) -> bool:
    """Whether ``name`` (refused where it mixes the features) keeps each of them on its own elsewhere: a
    reduction or ordering along another dim (``q.mean(1)``, ``q.softmax(1)``), a gather of tokens."""
    return name in _ALONG or name in _BY_POSITION


def _along(name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features) -> tuple[_Output, str] | None:
    t = args[0] if args else kwargs.get("input")
    found = features(t)
    if found is None or not isinstance(t, Tensor):
        return None
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], Tensor):
        return None  # torch.max(a, b): elementwise
    entry, at = found
    n = t.dim()
    dims = _dims(args, kwargs, *_ALONG[name], n)
    if name in ("diagonal", "linalg_diagonal") and n:  # diagonal(input, offset, dim1, dim2): by keyword in linalg's
        first, second = _ALONG[name][1]
        dims = {kwargs.get("dim1", args[2] if len(args) > 2 and name == "diagonal" else first) % n,
                kwargs.get("dim2", args[3] if len(args) > 3 and name == "diagonal" else second) % n}
    if dims is not None and at not in dims:
        return None
    over = "every dim" if dims is None else f"dim {sorted(dims)[0] - n if len(dims) == 1 else sorted(dims)}"
    return entry, f"{name} over {over}, which holds its features"


def _dims(args: Sequence[Any], kwargs: dict[str, Any], at: int, default: Any, n: int) -> set[int] | None:
    """The dims (of ``n``) an op reduces or orders along; None for every dim."""
    given: Any = next((kwargs[k] for k in ("dim", "dims", "axis") if k in kwargs), default)
    if not any(k in kwargs for k in ("dim", "dims", "axis")) and len(args) > at and not isinstance(args[at], bool):
        given = args[at]  # var(True): unbiased, not a dim
    if given == _LEGACY or (given is None and default == _LEGACY):
        given = 0 if n in (0, 1, 3) else 1
    if given is None or given == _EVERY or (isinstance(given, (list, tuple)) and not given):
        return None
    dims = given if isinstance(given, (list, tuple)) else (given,)
    return {d % n for d in dims if isinstance(d, int)} if n else None


def _norm(name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features) -> tuple[_Output, str] | None:
    t = args[0] if args else kwargs.get("input")
    found = features(t)
    given = [kwargs.get(key, args[at] if len(args) > at else None) for at, key in _NORMS[name]]
    if found is None or not isinstance(t, Tensor) or any(p is not None for p in given):
        return None  # with a weight or bias: refused by the checks that name it
    entry, at = found
    shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
    first = 1 if name == "group_norm" else t.dim() - len(shape if isinstance(shape, (list, tuple)) else (shape,))
    return (entry, f"{name} with no weight over its features") if at >= first else None


def _contraction(name: str, args: Sequence[Any], features: Features) -> tuple[_Output, str] | None:
    left_at, right_at = _CONTRACTIONS[name]
    if len(args) <= max(left_at, right_at):
        return None
    left, right = args[left_at], args[right_at]
    if not isinstance(right, Tensor) or not isinstance(left, Tensor):
        return None
    # linear(x, w) contracts w's last dim; the others, right's second-to-last (a vector's only one).
    contracted = right.dim() - 1 if name == "linear" or right.dim() == 1 else right.dim() - 2
    found, other = _last(left, features), features(right)
    if other is not None and name != "linear" and right.dim() > 1 and other[1] == right.dim() - 1:
        mine = features(left)  # k.transpose(-1, -2) @ v: features by features, a block of them on a rank
        if mine is not None and left.dim() > 1 and mine[1] == left.dim() - 2:
            return mine[0], _block(name, other[0])
    if not found or other is None or other[1] != contracted:
        return None
    return found[0], (
        f"{name} contracting its features with those of {other[0].label!r} (single-head attention's q @ "
        "k.transpose(-1, -2)): a partial sum on each rank, which nothing sums"
    )


def _block(name: str, other: _Output) -> str:
    outer = name in ("outer", "ger", "addr", "kron")
    like = "an outer product" if outer else "a linear attention's k.transpose(-1, -2) @ v"
    return (
        f"{name} of its features by those of {other.label!r} ({like}): a rank holds the products of its slices "
        "alone, not those across the ranks"
    )


def _products(name: str, args: Sequence[Any], features: Features) -> tuple[_Output, str] | None:
    """outer, kron of two followed outputs' features; linalg.multi_dot contracting them."""
    if name in ("linalg_multi_dot", "chain_matmul"):
        matrices = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
        for left, right in itertools.pairwise(matrices):
            found, other = _last(left, features), features(right)
            if found is not None and other is not None and other[1] == 0:
                return found[0], f"{name} contracting its features with those of {other[0].label!r}: a partial sum"
        return None
    first = 1 if name == "addr" else 0  # addr(input, vec1, vec2)
    if len(args) < first + 2 or not isinstance(args[first], Tensor) or not isinstance(args[first + 1], Tensor):
        return None
    found, other = _last(args[first], features), _last(args[first + 1], features)
    return (found[0], _block(name, other[0])) if found is not None and other is not None else None


def _einsum(args: Sequence[Any], features: Features) -> tuple[_Output, str] | None:
    """An einsum summing out the features of a followed output (``"btd,bsd->bts"``, ``"btd->bt"``)."""
    if not args or not isinstance(args[0], str):
        return None
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    equation = args[0].replace(" ", "")
    inputs, _, output = equation.partition("->")
    subscripts = inputs.split(",")
    if "->" not in equation:  # torch's implicit output: the letters seen once
        output = "".join(sorted(c for c in set(inputs) if c.isalpha() and inputs.count(c) == 1))
    kept: dict[str, _Output] = {}  # the letters of followed features the output keeps
    for subscript, operand in zip(subscripts, operands, strict=False):  # torch refused a mismatch
        found = features(operand)
        if found is None:
            continue
        entry, at = found
        letter = _letter(subscript, at, operand.dim())
        if letter is not None and letter not in output:
            return entry, f"einsum({args[0]!r}) summing out its features (the letter {letter!r})"
        if letter is not None:
            kept.setdefault(letter, entry)
    if len(kept) > 1:  # "btd,bte->btde": the features of one by another's, a block of them on a rank
        (first, entry), (second, other) = list(kept.items())[:2]
        return entry, (
            f"einsum({args[0]!r}) of its features (the letter {first!r}) by those of {other.label!r} (the letter "
            f"{second!r}): a rank holds the products of its slices alone, not those across the ranks"
        )
    return None


def _letter(subscript: str, at: int, n: int) -> str | None:
    """The letter an einsum subscript gives dim ``at`` of an ``n``-dim operand; None inside its ``...``."""
    before, ellipsis, after = subscript.partition("...")
    if not ellipsis:
        return subscript[at] if at < len(subscript) else None
    if at < len(before):
        return before[at]
    k = at - (n - len(after))
    return after[k] if 0 <= k < len(after) else None


def _last(t: Any, features: Features) -> tuple[_Output, int] | None:
    """``features(t)`` where ``t`` holds them in its last dim."""
    found = features(t)
    return found if found is not None and isinstance(t, Tensor) and found[1] == t.dim() - 1 else None
