"""New tensors sized by the rank's head count, followed to where a reduction or a running sum counts the rank's heads.

A tensor made with the rank's head count as a size (``torch.ones(q.size(1))``, ``q.new_ones(1, q.size(1), 1, 1)``,
``torch.zeros(h)`` of a count a Region divides) is right as long as each of its places is computed on its own: a
rank holds its own heads in them. A sum or a running sum along that dim counts the rank's heads instead of all of
them: ``torch.ones(h).cumsum(0)`` numbers them 1 .. H/tp on every rank, ``torch.ones(h).sum()`` is H/tp, and per-head
values made of either trained another model without an error (0.57% apart in the loss after one step of the tests'
tiny attention at tp 2, no Region).

:class:`HeadSized` follows such tensors, along each dim so sized: made by a size (``torch.ones(h)``,
``q.new_ones(1, h, 1, 1)``, ``torch.ones(1).expand(h)``, ``.repeat(h)`` of a dim of one, a ``view`` by it), from a
list repeated by the count (``torch.tensor([1.0] * h)``, nested too), or a stack of one tensor per head
(``torch.stack([x] * h)``); through ops that keep the dim in place and views that only add or drop dims of size 1
(``[None, :, None, None]``). What a reduction, normalisation, ordering or running sum along such a dim computes
(``sum``, ``cumsum``, ``prod``, ``mean`` and ``softmax`` of a buffer filled head by head, a ``norm``: the same tables
as for a per-head view's heads, feature_mixing.py) is marked as head numbers (head_numbers.py's
:class:`~.head_numbers.HeadNumbers`): right as an index of the heads (``torch.ones(h).cumsum(0) - 1`` picks the
rank's heads in their places), refused as a value. An index of such a tensor by a head number names the rank's head
in its place (``mask[h] = 1.0``). Not followed: a sized tensor read back into Python (``.tolist()``) and its
``len()`` (CPython makes it a plain ``int``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from .feature_mixing import mixed
from .head_numbers import HeadCount, HeadIndex, HeadNumbers, PerHeadItems
from .rank_flow import flow

# Calls that make a new tensor of the size their arguments give (after the tensor a ``new_*`` method is called on).
_NEW = frozenset({"empty", "zeros", "ones", "rand", "randn", "full", "empty_strided", "new_empty", "new_zeros",
                  "new_ones", "new_full", "new_empty_strided"})
# Calls that give a tensor a size along a dim from their arguments (``torch.ones(1).expand(h)``, ``repeat(h)`` of
# a dim of one): the output's dim there is as long as the count.
_RESIZED = frozenset({"expand", "broadcast_to", "repeat", "tile", "view", "reshape"})
_FROM_DATA = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})  # (of a list repeated by it: [1.0] * h)
_STACKS = frozenset({"stack", "hstack", "vstack"})  # (of one tensor per head: torch.stack([x] * h))
_FIRST = frozenset({"full", "new_full", "empty_strided", "new_empty_strided"})  # (a fill value or strides after it)
_COUNTING = frozenset({"sum", "nansum", "prod", "cumsum", "cumprod", "count_nonzero", "logsumexp", "logcumsumexp",
                       "cumsum_", "cumprod_"})
_DIM_AT = {"logsumexp": 1, "logcumsumexp": 1}
_FOUND: Any = object()  # (mixed()'s lookup answers it for a sized tensor: only whether an op is across it matters)


class HeadSized:
    """The tensors with dims sized by the rank's head count, and the counts' origins (see the module docstring)."""

    def __init__(self) -> None:
        self._sized: dict[int, tuple[weakref.ref[Tensor], dict[int, str]]] = {}

    def dims_of(self, t: Any) -> dict[int, str]:
        """The dims of ``t`` sized by the rank's head count, each with the count's origin (none: not followed)."""
        found = self._sized.get(id(t)) if isinstance(t, Tensor) else None
        return found[1] if found is not None and found[0]() is t else {}

    def _follow(self, t: Tensor, dims: dict[int, str]) -> None:
        if dims:
            self._sized[id(t)] = (weakref.ref(t), {**self.dims_of(t), **dims})

    def see(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any, numbers: HeadNumbers,
            per_head: Callable[[Any], bool]) -> None:
        """Follow a new tensor sized by a head count, or one computed from it, into ``out``; mark what counts its
        heads (or computes across them) as head numbers in ``numbers``. Not inside a Region (its probe runs the
        module whole and compares), nor for a per-head view (``per_head``: the watch judges an op across its heads,
        naming it)."""
        in_region: int = getattr(flow, "in_region", 0)
        if not isinstance(out, Tensor) or in_region:
            return
        made = _made_dims(name, args, kwargs, out)
        if made:
            self._follow(out, made)
            return
        if not self._sized:
            return
        for t in _tensors(args, kwargs):
            dims = {} if per_head(t) else self.dims_of(t)
            for dim, origin in dims.items():
                across = _across(name, args, kwargs, t, dim)
                if across is not None:
                    numbers.mark(out, f"{across} of {origin}, across the heads it counts")
                    return
            self._follow(out, {kept: origin for dim, origin in dims.items()
                               if (kept := _kept_at(t, dim, out)) is not None})


def _made_dims(name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Tensor) -> dict[int, str]:
    """The dims of a new tensor sized by a head count (or a head number), each with how it was sized."""
    if name in _NEW or (name in _RESIZED and args and isinstance(args[0], Tensor)):
        sizes = _sizes(name, args, kwargs)
        lead = out.dim() - len(sizes) if name in ("expand", "broadcast_to") else 0
        return {lead + d: f"a new tensor sized by {size.origin} ({name})" for d, size in enumerate(sizes)
                if isinstance(size, (HeadCount, HeadIndex)) and 0 <= lead + d < out.dim()
                and out.shape[lead + d] == int(size)}
    if name in _FROM_DATA and args:
        data, depth = args[-1 if name == "new_tensor" else 0], 0
        while isinstance(data, (list, tuple)) and data and not isinstance(data, PerHeadItems):
            data, depth = data[0], depth + 1
        if isinstance(data, PerHeadItems) and depth < out.dim():
            return {depth: f"a tensor of {data.origin}"}
    if name in _STACKS and args and isinstance(args[0], PerHeadItems):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if isinstance(dim, int) and name == "stack":
            return {dim % out.dim(): f"a stack of {args[0].origin}"}
    return {}


def _sizes(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    given = list(args[1:] if name.startswith("new_") or name in _RESIZED else args)
    if name in _FIRST:
        given = given[:1]
    if "size" in kwargs:
        given = [kwargs["size"]]
    if len(given) == 1 and isinstance(given[0], (list, tuple)):
        given = list(given[0])
    return given


def _tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]


def _across(name: str, args: Sequence[Any], kwargs: dict[str, Any], t: Tensor, dim: int) -> str | None:
    """What the op computes across ``t``'s dim ``dim`` (a reduction, a normalisation, an ordering, a running sum:
    feature_mixing.py's tables, as for a per-head view's heads), or None."""
    if name in _COUNTING:
        dims = _dims(name, args, kwargs, t.dim())
        if dims is None or dim in dims:
            return f"{name} along dim {dim}"
    found = mixed(name, args, kwargs, lambda x: (_FOUND, dim) if x is t else None, heads=True)
    return None if found is None else found[1].split(", which holds")[0]  # ("mean over dim -1")


def _dims(name: str, args: Sequence[Any], kwargs: dict[str, Any], ndim: int) -> set[int] | None:
    """The dims a reduction or scan takes; None for every dim."""
    at = _DIM_AT.get(name, 1)
    given = args[at] if len(args) > at else kwargs.get("dim", kwargs.get("axis"))
    if given is None or (isinstance(given, (list, tuple)) and not given):
        return None
    if not isinstance(given, (list, tuple)):
        given = [given]
    return {int(d) % max(ndim, 1) for d in given if isinstance(d, int)}


def _kept_at(t: Tensor, dim: int, out: Tensor) -> int | None:
    """Where ``out`` holds ``t``'s sized dim: the same place where it has as many dims and that size there (an
    elementwise op, a broadcast), or the one dim of that size where both are that dim and dims of size 1 (a view
    or index that adds or drops them)."""
    size = t.shape[dim]
    if out.dim() == t.dim() and out.shape[dim] == size:
        return dim
    if t.numel() == size and out.numel() == size and size > 1:
        return next(d for d, n in enumerate(out.shape) if n == size)
    return None
