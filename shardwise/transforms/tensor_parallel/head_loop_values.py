"""What a loop over a rank's heads computes for each: the same ops with the same numbers, or refused.

A loop over the heads (``for h in range(q.size(1))``) counts a rank's heads from 0, and ``range`` gives plain
Python ints no mark can follow (head_numbers.py). As an index the loop's number is exact: it names the rank's
head h in its place (split_watch.py counts the heads taken). As a value it is not: ``out[:, h] = q[:, h] * (h +
1.0)`` scales a rank's head h by h + 1 where one device scales it by its number among all heads (5.7e-3 relative
in the loss after one step of the tests' tiny attention, no error); so is ``q[:, h] * slopes[h]`` of a Python
list or a replicated table of every head's slope, and an ``if h == 0:`` that computes head 0 otherwise.

:class:`HeadLoopValues` records, for each op that takes values read from one head alone (head_sources.py's
marks: ``q[:, h]`` and what is computed from it), the op and its other arguments: the numbers, and the tensors
not read from a head (by value). Each head of the rank must get the same ops with the same numbers, as a loop
that treats every head alike gives them; the first difference is refused at the end of the first call, naming
the op, its line, what differed and the fix (compute the per-head values once at init as a parameter split
with the heads: ``sw.tp.PerHead()``). Indices, dims and sizes (``q[:, h]``, ``select(1, h)``, the ``[h]`` of a
write) are not values, and a tensor written in place (the loop's ``out``) is not one of its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .model_frames import innermost_model_line

if TYPE_CHECKING:
    from .head_sources import HeadSources

# Ops whose numbers are dims, indices or sizes of the heads' values, never values (q[:, h], select(1, h)).
_PLACES = frozenset({
    "__getitem__", "__setitem__", "select", "narrow", "view", "reshape", "transpose", "permute", "unsqueeze",
    "squeeze", "expand", "flatten", "unflatten", "movedim", "split", "chunk", "unbind", "index_select", "size",
    "__get__", "dim", "contiguous", "clone", "to", "sum", "mean", "amax", "amin", "softmax", "log_softmax",
    "stack", "cat", "index_fill", "index_fill_", "index_copy", "index_copy_", "index_add", "index_add_",
    "gather", "scatter", "scatter_", "repeat_interleave", "tril", "triu", "norm", "max", "min", "argmax",
})
_AUGMENTED = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow"))


@dataclass
class _Call:
    name: str
    line: str
    numbers: tuple[Any, ...]
    tensors: tuple[Tensor, ...]


class HeadLoopValues:
    """The ops each head of a per-head tensor got, read one head at a time (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: dict[tuple[int, int], list[_Call]] = {}  # (heads of the tensor read, its head) -> calls

    def see(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], sources: HeadSources) -> None:
        items = [(k, a) for k, a in (*enumerate(args), *kwargs.items())]
        marks = frozenset().union(*(sources.of(t) for _, a in items for t in _tensors(a)))
        by_count: dict[int, set[int]] = {}
        for heads, head in marks:
            by_count.setdefault(heads, set()).add(head)
        ones = [(heads, next(iter(h))) for heads, h in by_count.items() if len(h) == 1 and heads > 1]
        if not ones:
            return
        written = name == "__setitem__" or name in _AUGMENTED or (name.endswith("_") and not name.startswith("_"))
        numbers: list[Any] = []
        tensors: list[Tensor] = []
        if name not in _PLACES:
            for k, a in items:
                if k == "out" or (written and k == 0):
                    continue
                for e in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(e, Tensor):
                        if not sources.of(e) and (e.is_floating_point() or e.is_complex()):
                            tensors.append(e)
                    elif isinstance(e, (int, float, complex)) and not isinstance(e, bool):
                        numbers.append(e)
        call = _Call(name, innermost_model_line(), tuple(numbers), tuple(tensors))
        for key in ones:
            self.calls.setdefault(key, []).append(call)

    def differing(self) -> tuple[int, str] | None:
        """The first op whose values differ between the heads of a tensor whose every head got ops one at a
        time: (that tensor's head count, what differed); None where each head got the same."""
        for (heads, _), _calls in sorted(self.calls.items()):
            got = [self.calls.get((heads, h)) for h in range(heads)]
            if any(g is None for g in got):
                continue  # some heads never read alone: a fixed head, refused by the heads taken (split_watch.py)
            first = got[0]
            assert first is not None
            for h, calls in enumerate(got[1:], start=1):
                assert calls is not None
                why = _differs(first, calls, h)
                if why is not None:
                    return heads, why
        return None


def _differs(first: list[_Call], other: list[_Call], h: int) -> str | None:
    for a, b in zip(first, other, strict=False):
        if a.name != b.name:
            return f"{a.name} for head 0 ({a.line}) where {b.name} for head {h} ({b.line})"
        if a.numbers != b.numbers:
            return (f"{a.name} with {_shown(a.numbers)} for head 0 and with {_shown(b.numbers)} for head {h} "
                    f"({a.line})")
        if len(a.tensors) != len(b.tensors) or not all(_same(x, y) for x, y in zip(a.tensors, b.tensors, strict=True)):
            return (f"{a.name} with a tensor of other values for head {h} than for head 0 ({a.line}): "
                    "one not read from the heads, picked by the head's number")
    if len(first) != len(other):
        longer, h_of = (first, 0) if len(first) > len(other) else (other, h)
        extra = longer[min(len(first), len(other))]
        return f"{extra.name} for head {h_of} only ({extra.line}): other ops for head 0 than for head {h}"
    return None


def _same(x: Tensor, y: Tensor) -> bool:
    if x is y:
        return True
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_meta or y.is_meta:
        return True  # (values unknown on the meta device: the first call on real tensors judges them)
    with torch.no_grad():
        return bool(torch.equal(x, y))


def _shown(numbers: tuple[Any, ...]) -> str:
    return ", ".join(repr(n) for n in numbers) if numbers else "no number"


def _tensors(a: Any) -> list[Tensor]:
    return [t for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, Tensor)]
