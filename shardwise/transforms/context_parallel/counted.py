"""Positions counted from the part's length (``torch.arange(t)``, ``buffer[:, :t]``), and where they are right.

Under context_parallel a layer that makes positions from the length of what it holds counts 0 .. t/n - 1 on
every rank. That is right only where shardwise maps the count to the rank's own positions: a lookup in a
position table context_parallel gave the layer with this rank's rows first (``positions=``: ``table[:, :t]``,
``table(arange(t))``), a rotary embedding (``GlobalPositions``) and transformers' mask making (whose mask it
replaces), both shardwise's or exempt code. :class:`Counted` marks such tensors in the watched first call
(``unsplit.py``) and follows them through the calls that keep their values (a view, a cast); any other use
(``h + pos``, ``pos.float() / t``, a lookup in another table) is refused by the caller.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .part_length import Part, PartLength

# Calls that keep a tensor's values where they are (or pick some): their output is counted as their input.
KEEPS = frozenset({
    "unsqueeze", "squeeze", "view", "reshape", "expand", "expand_as", "to", "long", "int", "clone", "contiguous",
    "detach", "__getitem__", "flatten", "unflatten", "repeat", "type", "cpu", "cuda",
})


class Counted:
    """The tensors of a watched call that hold positions counted from the part's length (with how they were
    made), and the position tables whose first rows are this rank's positions."""

    def __init__(self) -> None:
        self.counted: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self.tables: dict[int, weakref.ref[torch.Tensor]] = {}

    def table(self, t: torch.Tensor) -> None:
        """``t``, a position table with this rank's rows first (``spec._at_positions``)."""
        self.tables[id(t)] = weakref.ref(t)

    def is_table(self, t: Any) -> bool:
        ref = self.tables.get(id(t))
        return ref is not None and ref() is t

    def right_lookup(self, name: str, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether a lookup by counted positions reads what the rank's positions would: in a position table
        with this rank's rows first, or in one that holds the same values at every index looked up along (a
        buffer of zeros; a Hugging Face head's zero stand-in for a table it does not hold)."""
        if name == "__getitem__" and len(args) > 1:
            items = args[1] if isinstance(args[1], tuple) else (args[1],)
            if Ellipsis in items or None in items:
                return False
            dims = [i for i, e in enumerate(items) if self.origin(e) is not None]
            return len(dims) == 1 and self._right_table(args[0], dims[0])
        if name not in _LOOKUPS:
            return False
        table_at, index_at, dim = _LOOKUPS[name]
        given = [*args, *kwargs.values()]
        if len(given) <= max(table_at, index_at) or self.origin(given[index_at]) is None:
            return False
        table = given[table_at]
        d = dim if dim is not None else given[table_at + 1]
        if any(self.origin(t) is not None for i, t in enumerate(given) if i != index_at):
            return False
        return isinstance(table, torch.Tensor) and self._right_table(table, int(d) % table.dim())

    def _right_table(self, table: Any, d: int) -> bool:
        if not isinstance(table, torch.Tensor):
            return False
        return (self.is_table(table) and d == max(table.dim() - 2, 0)) or constant_along(table, d)

    def mark(self, t: Any, origin: str) -> None:
        if isinstance(t, torch.Tensor):
            self.counted[id(t)] = (weakref.ref(t), origin)

    def origin(self, t: Any) -> str | None:
        entry = self.counted.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def found(self, args: Any, kwargs: dict[str, Any]) -> str | None:
        """How the first counted tensor among the arguments (in lists and tuples too) was made; None if none."""
        if not self.counted:
            return None
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                origin = self.origin(t)
                if origin is not None:
                    return origin
        return None


def keeps_values(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """``pos + 0`` (``arange(t) + past_seen_tokens`` with no cache): the values kept."""
    others = [a for a in (*args[1:], *kwargs.values()) if not isinstance(a, torch.Tensor)]
    return name in _ADDS and len(args) == 2 and not isinstance(args[1], torch.Tensor) and others == [0] and not (
        isinstance(args[1], Part))


_ADDS = frozenset({"add", "__add__", "__radd__", "sub", "__sub__", "__iadd__", "__isub__", "add_", "sub_"})
# Lookups by an index: (the looked-up tensor's place among the arguments, the index's, the dim looked up along;
# None: the dim argument after the tensor).
_LOOKUPS = {"embedding": (1, 0, 0), "index_select": (0, 2, None), "gather": (0, 2, None)}


def counts_the_part(args: Any, kwargs: dict[str, Any]) -> str | None:
    """``torch.arange(t)`` / ``arange(0, t)`` / ``arange(p, p + t)`` with ``p == 0`` and step 1, ``t`` the part's
    length as read: how it was read. None for any other arange given a part's length (refused: its values are
    the part's length computed with)."""
    given = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    start, end, step = (0, given[0], 1) if len(given) == 1 else (*given, 1)[:3] if given else (0, None, 1)
    start, end, step = kwargs.get("start", start), kwargs.get("end", end), kwargs.get("step", step)
    if not isinstance(end, PartLength) or end.length is None or int(end) != end.length:
        return None
    if isinstance(start, Part) or isinstance(step, Part) or start != 0 or step != 1:
        return None
    return end.origin


def constant_along(x: torch.Tensor, d: int) -> bool:
    """Whether ``x`` holds the same values at every index of dim ``d`` and keeps them (a buffer of zeros, Hugging
    Face's token-type zeros: its first rows are any rows). A tensor that requires grad (a parameter being
    trained: ``nn.Parameter(torch.zeros(1, T, d))``) is never: its values at the first call are not those after
    an update. Fake tensors (the Plan's prediction) hold none to compare: not constant."""
    if x.requires_grad or x.device.type == "meta" or (
            type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)):
        return False
    return bool((x == x.narrow(d, 0, 1)).all())
