"""Ops across a Colwise output's features, which a rank computes on its slice of them (split_watch.py refuses).

``Colwise()`` gives each rank a contiguous 1/tp of a projection's output features. An op that
reduces across them (``q.norm(dim=-1)``, ``q.mean(-1)``, ``q.sum()``), normalises over them
(``F.normalize(q, dim=-1)``, a ``layer_norm`` or ``rms_norm`` with no weight, ``q.softmax(-1)``) or
orders them (``cumsum``, ``sort``, ``flip``, ``roll`` along them) computes it over the rank's slice
alone; no parameter's gradient shows it, and the model trains another model without an error. So
does a contraction of the features of two Colwise outputs (single-head attention's ``q @
k.transpose(-1, -2)``, ``einsum("btd,bsd->bts", q, k)``, ``F.scaled_dot_product_attention`` on
outputs never viewed per head): each rank computes a partial sum, which nothing sums.

:func:`mixed` finds such an op where :class:`~.split_watch.SplitWatch` follows the output with its
features whole (last, or moved by a transpose: :func:`moved_features`). What passes: the same ops
on a per-head view (Qwen3's ``q_norm`` on ``(b, t, heads, head_dim)``, a softmax over the attention
scores: head_views.py follows those, each head whole on a rank), reductions over other dims (a mean
over the sequence), elementwise ops, and a Rowwise's own ``linear`` (a contraction with its weight,
split alike, which the Rowwise sums). A norm with a weight is left to the checks that name the
weight (its shape, or its gradient differing across ranks: OLMo-2's ``q_norm``), and a contraction
with a parameter of the rank's width, or a reduction of a ``Colwise(fused=N)`` output's blocks after
the module cuts them apart, goes unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from .split_watch import _Output

# Where a tensor holds a followed Colwise output's features: the output, and the dim; None elsewhere.
Features = Callable[[Any], "tuple[_Output, int] | None"]

_EVERY = "every"  # no dim given: the op takes every dim (sum(), amax(dim=()), roll(shifts) flattened)
_LEGACY = "legacy"  # softmax's dim=None: torch picks dim 0 of a 0-, 1- or 3-dim input, else dim 1
# Reductions, normalisations and orderings along dims, by name: where the op takes its dims
# positionally, and what it takes given none. Boolean tests (any, all) are left out: a module reads
# them (an isinf check), it does not train on them.
_ALONG: dict[str, tuple[int, int | str]] = {
    **dict.fromkeys((
        "sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "var", "std",
        "median", "cumsum", "cumprod", "flip", "var_mean", "std_mean", "nanmean", "nansum", "nanmedian",
        "aminmax", "logcumsumexp", "cummax", "cummin",
    ), (1, _EVERY)),
    **dict.fromkeys(("softmax", "log_softmax", "softmin", "special_softmax", "special_log_softmax"), (1, _LEGACY)),
    # Along one dim, the last given none (diff's, the 1-D transforms').
    **dict.fromkeys(("diff", "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft"), (2, -1)),
    **dict.fromkeys(("sort", "argsort"), (1, -1)),
    "topk": (2, -1),
    **dict.fromkeys(("norm", "linalg_vector_norm", "linalg_norm", "roll"), (2, _EVERY)),
    **dict.fromkeys(("normalize", "cosine_similarity"), (2, 1)),
}
# Normalisations over the trailing dims (group_norm: over groups of dim 1 and the dims after it), and
# where each takes its parameters: refused with none (a norm with one is left to the checks naming it).
_NORMS = {"layer_norm": ((2, "weight"), (3, "bias")), "rms_norm": ((2, "weight"),),
          "group_norm": ((2, "weight"), (3, "bias"))}
# Contractions of two operands, and where each takes them (left, right): b.__rmatmul__(a) is a @ b.
_CONTRACTIONS = {
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm", "linear"), (0, 1)),
    "__rmatmul__": (1, 0), **dict.fromkeys(("addmm", "baddbmm"), (1, 2)),
}


def mixed(name: str, args: Sequence[Any], kwargs: dict[str, Any], features: Features) -> tuple[_Output, str] | None:
    """The followed output the op ``name`` computes across the features of, and what it does (for the
    refusal); None where it computes each feature on its own, or takes no followed output."""
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
    return None


# Ops that mix every dim but the one they are given: renorm(x, p, dim, maxnorm) scales each slice
# along ``dim`` by its norm over the others; local_response_norm mixes dim 1 (channels) alone.
_ACROSS_OTHERS = {"renorm": 2, "local_response_norm": None}
# Two operands' last dims against each other (cdist's distances, inner's and dot's products), and
# tensordot's contracted dims: with two followed outputs' features there, a partial sum on each rank.
_PAIRWISE = ("cdist", "inner", "dot", "vdot", "tensordot")


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
    dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else None)
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
    if name == "t" and n == 2:
        return 0
    getter = getattr(func, "__self__", None)
    if getter is Tensor.mT and n >= 2:
        return n - 2
    if getter is Tensor.T:
        return 0
    return None


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
    if dims is not None and at not in dims:
        return None
    over = "every dim" if dims is None else f"dim {sorted(dims)[0] - n if len(dims) == 1 else sorted(dims)}"
    return entry, f"{name} over {over}, which holds its features"


def _dims(args: Sequence[Any], kwargs: dict[str, Any], at: int, default: int | str, n: int) -> set[int] | None:
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
    if not found or other is None or other[1] != contracted:
        return None
    return found[0], (
        f"{name} contracting its features with those of {other[0].label!r} (single-head attention's q @ "
        "k.transpose(-1, -2)): a partial sum on each rank, which nothing sums"
    )


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
    for subscript, operand in zip(subscripts, operands, strict=False):  # torch refused a mismatch
        found = features(operand)
        if found is None:
            continue
        entry, at = found
        letter = _letter(subscript, at, operand.dim())
        if letter is not None and letter not in output:
            return entry, f"einsum({args[0]!r}) summing out its features (the letter {letter!r})"
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
