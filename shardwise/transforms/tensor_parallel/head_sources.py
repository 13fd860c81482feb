"""Which heads a value computed from one-head reads came from, to check where it is written.

A loop that writes each head in turn passes the head count (split_watch.py counts heads read and written), but
``out[:, h] = q[:, (h + 1) % q.size(1)]`` writes each head's values into another head: on one device head 3's go
to head 0, on a rank of two heads its own second head's do (0.4% off in the loss after one step of the tests'
tiny attention, no error). :class:`HeadSources` marks what a one-head read gives (``q[:, h]``, ``q.select(1, h)``)
with its head, carries the marks through the ops that take it, and refuses a write into head i of a value made
from head j of a tensor of as many heads. A tensor of fewer heads is left alone: grouped-query attention's
``k[:, h // group]`` takes the group's key head, the same one on a rank as on one device.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor

_Mark = frozenset[tuple[int, int]]  # (the head count of the tensor read, its head)


class HeadSources:
    """The heads the values of the watched call's tensors were read from (one head at a time)."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[weakref.ref[Tensor], _Mark]] = {}

    def mark(self, t: Any, heads: int, head: int) -> None:
        """``t`` holds head ``head`` of a tensor of ``heads`` heads, read alone."""
        if isinstance(t, Tensor):
            self._add(t, frozenset({(heads, head)}) | self.of(t))

    def marked(self) -> bool:
        return bool(self._marks)

    def of(self, t: Any) -> _Mark:
        found = self._marks.get(id(t)) if isinstance(t, Tensor) else None
        return found[1] if found is not None and found[0]() is t else frozenset()

    def carry(self, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """What an op computes from marked tensors holds their heads' values."""
        if not self._marks:
            return
        marks = frozenset().union(*(self.of(t) for t in _tensors((*args, *kwargs.values()))))
        if marks:
            for t in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
                self._add(t, marks | self.of(t))

    def other_heads(self, values: Iterable[Any], heads: int, head: int) -> list[int]:
        """The heads of a tensor of ``heads`` heads, not ``head``, whose values ``values`` hold; none where they
        hold every head's (a tensor stacked back from a loop's reads, whose head ``head`` is that head's again:
        the marks do not say which part of it a value took)."""
        read = {h for t in _tensors(values) for n, h in self.of(t) if n == heads}
        return [] if read <= {head} or read == set(range(heads)) else sorted(read - {head})

    def _add(self, t: Tensor, mark: _Mark) -> None:
        self._marks[id(t)] = (weakref.ref(t), mark)


def _tensors(items: Iterable[Any]) -> Iterable[Tensor]:
    for a in items:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, Tensor):
                yield t
