"""New tensors sized by the rank's head count, followed to where a reduction or a running sum counts the rank's heads.

A tensor made with the rank's head count as a size (``torch.ones(q.size(1))``, ``q.new_ones(1, q.size(1), 1, 1)``,
``torch.zeros(h)`` of a count a Region divides) is right as long as each of its places is computed on its own: a
rank holds its own heads in them. A sum or a running sum along that dim counts the rank's heads instead of all of
them: ``torch.ones(h).cumsum(0)`` numbers them 1 .. H/tp on every rank, ``torch.ones(h).sum()`` is H/tp, and per-head
values made of either trained another model without an error (0.57% apart in the loss after one step of the tests'
tiny attention at tp 2, no Region).

:class:`HeadSized` follows such tensors (through ops that keep the dim in place, and views that only add or drop
dims of size 1: ``[None, :, None, None]``, ``view(1, -1, 1, 1)``) and marks what a sum, product, running sum or
product, ``count_nonzero`` or ``logsumexp`` along the dim computes as head numbers (head_numbers.py's
:class:`~.head_numbers.HeadNumbers`): right as an index of the heads (``torch.ones(h).cumsum(0) - 1`` picks the
rank's heads in their places), refused as a value. A sized tensor written head by head and reduced is the rank's
heads' sum alone: refused the same way.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .head_numbers import HeadCount, HeadNumbers, HeadSizedList, HeadSizedTuple

# Calls that make a new tensor of the size their arguments give (after the tensor a ``new_*`` method is called on).
_NEW = frozenset({"empty", "zeros", "ones", "rand", "randn", "full", "empty_strided", "new_empty", "new_zeros",
                  "new_ones", "new_full", "new_empty_strided"})
_FROM_DATA = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})  # (of a list repeated by it: [1.0] * h)
_REPEATED = (HeadSizedList, HeadSizedTuple)
_FIRST = frozenset({"full", "new_full", "empty_strided", "new_empty_strided"})  # (a fill value or strides after it)
# Reductions and scans whose result along the dim depends on how many places it has: a count of them.
_COUNTING = frozenset({"sum", "nansum", "prod", "cumsum", "cumprod", "count_nonzero", "logsumexp", "logcumsumexp",
                       "cumsum_", "cumprod_"})
_DIM_AT = {"logsumexp": 1, "logcumsumexp": 1}


class HeadSized:
    """The tensors with a dim sized by the rank's head count, and that count's origin (see the module docstring)."""

    def __init__(self) -> None:
        self._sized: dict[int, tuple[weakref.ref[Tensor], int, str]] = {}

    def _of(self, t: Any) -> tuple[int, str] | None:
        found = self._sized.get(id(t)) if isinstance(t, Tensor) else None
        return (found[1], found[2]) if found is not None and found[0]() is t else None

    def _follow(self, t: Tensor, dim: int, origin: str) -> None:
        self._sized[id(t)] = (weakref.ref(t), dim, origin)

    def see(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any, numbers: HeadNumbers) -> None:
        """Follow a new tensor sized by a head count, or one computed from it, into ``out``; mark what counts its
        heads as head numbers in ``numbers``."""
        if not isinstance(out, Tensor):
            return
        if name in _FROM_DATA and args and isinstance(args[-1 if name == "new_tensor" else 0], _REPEATED):
            data = args[-1 if name == "new_tensor" else 0]
            self._follow(out, 0, f"a tensor of a {type(data).__mro__[1].__name__} repeated by {data.origin}")
            return
        if name in _NEW:
            for dim, size in enumerate(_sizes(name, args, kwargs)):
                if isinstance(size, HeadCount) and int(size) > 1:
                    self._follow(out, dim, f"a new tensor sized by {size.origin} ({name})")
                    return
            return
        if not self._sized:
            return
        found = next(((t, sized) for t in _tensors(args, kwargs) if (sized := self._of(t)) is not None), None)
        if found is None:
            return
        t, (dim, origin) = found
        if name in _COUNTING:
            dims = _dims(name, args, kwargs, t.dim())
            if dims is None or dim in dims:
                numbers.mark(out, f"{name} of {origin} along the heads it counts")
                return
        kept = _kept_at(t, dim, out)
        if kept is not None:
            self._follow(out, kept, origin)


def _sizes(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    given = list(args[1:] if name.startswith("new_") else args)
    if name in _FIRST:
        given = given[:1]
    if "size" in kwargs:
        given = [kwargs["size"]]
    if len(given) == 1 and isinstance(given[0], (list, tuple)):
        given = list(given[0])
    return given


def _tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]


def _dims(name: str, args: Sequence[Any], kwargs: dict[str, Any], ndim: int) -> set[int] | None:
    """The dims a reduction or scan takes; None for every dim."""
    at = _DIM_AT.get(name, 1)
    given = args[at] if len(args) > at else kwargs.get("dim")
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
    if t.numel() == size and out.numel() == size:
        return next(d for d, n in enumerate(out.shape) if n == size)
    return None
