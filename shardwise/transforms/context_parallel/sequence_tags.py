"""The words of the sequence-dim rules (``sequence_rules.py``, ``sequence_moves.py``): a tensor's tags, an op's
call and the verdict on it.

A tensor's :data:`Tags` map each dim that holds positions of the rank's part of the sequence to the stride
range ``(lo, hi)`` of its index that counts them: ``(1, n)`` for a dim that is the sequence, ``(d, d * t)``
for rows ``b * t`` of (batch, sequence) folded with ``d`` positions' worth of another dim inside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from torch import Tensor

Tags = dict[int, tuple[int, int]]


TagsOf = Callable[[Any], Tags]


# Marks beside the dims. POOLED: a mean over every element, the positions' too (a 0-d auxiliary loss term): each
# rank's mean over its part, and the step averages the ranks' losses, so it is exact while it reaches the loss
# linearly. VALUED: an index whose values are positions (nonzero of a tensor that holds them: a router's tokens).
POOLED, VALUED = -1, -2


NO_RANGE = (0, 0)


class Verdict(NamedTuple):
    outs: list[Tags]  # per tensor the op returns (flattened), its tags
    why: str | None  # what it does along the sequence, or None


def tensors_in(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[Tensor]:
    """The tensors among an aten op's arguments (a list argument's too: cat's, index's)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, Tensor))


class Call(NamedTuple):
    """One aten op's call, with the tags of its tensors."""

    name: str
    func: Any
    args: list[Any]
    kwargs: dict[str, Any]
    outs: list[Tensor]
    tags_of: TagsOf

    def arg(self, i: int, key: str, default: Any = None) -> Any:
        return self.args[i] if len(self.args) > i else self.kwargs.get(key, default)

    def each(self, tags: Tags) -> Verdict:
        return Verdict([dict(tags) for _ in self.outs], None)

    def refuse(self, why: str, tags: Tags | None = None) -> Verdict:
        return Verdict([dict(tags or {}) for _ in self.outs], why)


def words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def readable(func: Any) -> str:
    return f"aten.{func.overloadpacket.__name__}"


def dim_index(d: Any, ndim: int) -> int:
    return int(d) % max(ndim, 1)


def dims_named(value: Any, ndim: int) -> list[int] | None:
    """The dims an argument names; None for all of them (a dim list that is None or empty)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return [dim_index(value, ndim)]
    dims = [dim_index(d, ndim) for d in value]
    return dims or None


def broadcast(tags: Tags, ndim: int, out_ndim: int) -> Tags:
    shift = out_ndim - ndim
    return {d + shift: r for d, r in tags.items() if d >= 0}


def union(*many: Tags) -> Tags:
    out: Tags = {}
    for tags in many:
        for d, (lo, hi) in tags.items():
            if d in out:
                lo, hi = min(lo, out[d][0]), max(hi, out[d][1])
            out[d] = (lo, hi)
    return out
