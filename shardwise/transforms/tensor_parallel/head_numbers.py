"""The rank's head count and its head numbers, marked: right as sizes and indices, refused as values.

A rank holds 1/tp of the heads, numbered from 0 on each. A number read from a per-head view's heads dim
(``q.size(1)``, ``q.shape[1]``) or a count a Region divides (``self.n_heads``) is the rank's count, and
``torch.arange`` over it the rank's numbers 0 .. H/tp - 1. As a size (``view(b, h, t, d)``, ``expand``) and as an
index of the heads (``q[:, torch.arange(h)]``, index_fill_, scatter_) they are exact: they name the rank's own
heads in their places. As a value they are not: an ALiBi-like slope ``2.0 ** -(torch.arange(h) + 1)`` multiplied
into the scores, ``x / h``, a mask by head number combined with the heads' values (``(arange == 0) & (q > 0)``)
give every rank the first heads' values, another model trained without an error (2.4e-4 relative in the loss
after one step of the tests' tiny attention). They are refused, naming the line and the fix, rather than
renumbered: one arange serves both as an index (where the rank's numbering is right) and as a value (where the
whole's would be), and no rewrite of the op can tell which a later use is; a per-head table computed once at init
and split with the heads (``sw.tp.PerHead()``) is exact and needs no numbering at all.

:class:`HeadCount` is an ``int`` that keeps its origin through Python's arithmetic (``h * 2``, ``h - 1``; a
``float`` result is a :class:`HeadValue`); the ratio of two of them (``q.size(1) // k.size(1)``: grouped-query
attention's group) is the same on a rank as on the whole and is a plain number. :func:`count_misuse` judges a
torch call given one; :class:`HeadNumbers` follows the tensors computed from an arange over one.

Outside a Region (whose probe runs the module whole and compares), ``range(h)`` in the model's code is a
:class:`HeadRange` (head_host_calls.py) of :class:`HeadIndex` numbers: a loop's ``h`` is exact as an index of the
heads (``q[:, h]``, ``out[:, h] = ...``, ``torch.tensor([h])`` as an index, followed as head numbers), and Python's
arithmetic on it keeps the mark (``h + 1``; ``h + 1.0``, ``2 ** -h`` a :class:`HeadIndexValue`). A torch call
taking one as a value (``torch.as_tensor([h + 1.0 for h in ...])``, ``q[:, h] * h``), or as an index of a tensor
that holds no heads of its own (``table[h]`` of every head's values: the first heads' on every rank; an arange over
the count so too), is refused; a loop's number at the end of the first call, after head_loop_values.py, which names
the values that differ where the loop reads the heads. A list or tuple repeated by a count (``[1.0] * h``) or of
one item per head (``q.unbind(1)``) is a :class:`HeadSizedList` / :class:`HeadSizedTuple`: a tensor made of it has
the rank's heads along that dim (head_sized.py), and its ``len`` is the count, marked.

What it cannot see: a number that leaves Python's arithmetic for a plain one (``float(h)``, ``int(h)``, a Python
float on the left, ``1.0 / h`` and ``2.0 ** -h``: float's own method takes an int; ``len(list(range(h)))``; a
comparison, ``float(h == 0)`` and ``1.0 if h == 0 else 0.5``, outside a loop that reads the heads; math's and
numpy's functions are refused, head_host_calls.py), a Python list of every head's values indexed by a head number
(``slopes[h]``: list indexing reads the int in C), a marked tensor read back into Python (``.tolist()``,
``.item()``), and a count the model computes itself from a whole one (``config.num_attention_heads``, which stays
whole).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor


class _MarkedInt(int):
    """An ``int`` with ``origin``, what it was computed from; its copies (deepcopy, pickle) are plain numbers."""

    origin: str

    def __new__(cls, value: int, origin: str) -> Any:
        made = int.__new__(cls, value)
        made.origin = origin
        return made

    def __neg__(self) -> Any:
        return type(self)(-int(self), self.origin)

    def __reduce__(self) -> tuple[Any, ...]:
        return int, (int(self),)  # a copy (deepcopy, pickle) is a plain number: the mark is the first call's

    def __pos__(self) -> Any:
        return self


class _MarkedFloat(float):
    """A ``float`` with ``origin``, what it was computed from."""

    origin: str

    def __new__(cls, value: float, origin: str) -> Any:
        made = float.__new__(cls, value)
        made.origin = origin
        return made

    def __neg__(self) -> Any:
        return type(self)(-float.__float__(self), self.origin)

    def __reduce__(self) -> tuple[Any, ...]:
        return float, (float.__float__(self),)


class HeadCount(_MarkedInt):
    """An ``int`` made from the rank's head count; ``origin`` says how it was read (``q.size(1) (2)``)."""


class HeadValue(_MarkedFloat):
    """A ``float`` computed from the rank's head count (``1 / h``, ``h * 0.5``)."""


class HeadIndex(_MarkedInt):
    """An ``int`` that numbers one of the rank's heads from 0 (a loop's ``h`` of ``range(q.size(1))``), or is
    computed from one by Python's integer arithmetic (``h + 1``): right as an index of the heads, refused as a
    value."""


class HeadIndexValue(_MarkedFloat):
    """A ``float`` computed from a head number (``h + 1.0``, ``2 ** -h``, ``h / 4``)."""


Marked = (HeadCount, HeadValue, HeadIndex, HeadIndexValue)
Numbered = (HeadIndex, HeadIndexValue)  # (a head's number, and what is computed from it)


def _plain(x: Any) -> Any:
    return int.__int__(x) if isinstance(x, (HeadCount, HeadIndex)) else (
        float.__float__(x) if isinstance(x, (HeadValue, HeadIndexValue)) else x)


def _binary(op: Callable[[Any, Any], Any], reflected: bool) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        if op is operator.mul and type(other) in (list, tuple) and isinstance(self, HeadCount):
            return repeated(other, self)  # ``[1.0] * h``: as many items as the rank has heads (head_sized.py)
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            return NotImplemented  # a tensor's reflected method takes it (and the watch sees the number there)
        a, b = (_plain(other), _plain(self)) if reflected else (_plain(self), _plain(other))
        value = op(a, b)
        numbered = isinstance(self, Numbered) or isinstance(other, Numbered)
        if isinstance(other, Marked) and op in (operator.floordiv, operator.truediv) and not numbered:
            return value  # a ratio of two of the rank's counts: the whole's (query heads per key head)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        origin = other.origin if isinstance(other, Numbered) and not isinstance(self, Numbered) else self.origin
        if numbered:
            return HeadIndex(value, origin) if isinstance(value, int) else HeadIndexValue(value, origin)
        return HeadCount(value, origin) if isinstance(value, int) else HeadValue(value, origin)

    return method


_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
               "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow}
for _name, _op in _ARITHMETIC.items():
    for _cls in Marked:
        setattr(_cls, f"__{_name}__", _binary(_op, False))
        setattr(_cls, f"__r{_name}__", _binary(_op, True))


class HeadSizedList(list[Any]):
    """A list of as many items as the rank has heads (``[1.0] * h``); ``origin`` says how it was made."""

    origin: str


class HeadSizedTuple(tuple[Any, ...]):
    """A tuple of as many items as the rank has heads (``(1.0,) * h``, ``q.unbind(1)``); ``origin``: how made."""

    origin: str


PerHeadItems = (HeadSizedList, HeadSizedTuple)


def repeated(items: list[Any] | tuple[Any, ...], count: HeadCount) -> list[Any] | tuple[Any, ...]:
    """``items * count`` (Python's repeat), marked with the count: a tensor made of it holds the rank's heads."""
    made: HeadSizedList | HeadSizedTuple = (
        HeadSizedList(items * int(count)) if isinstance(items, list) else HeadSizedTuple(items * int(count)))
    made.origin = f"a {type(items).__name__} repeated by {count.origin}"
    return made


def one_per_head(items: tuple[Any, ...], origin: str) -> HeadSizedTuple:
    """``items`` (one per head of the rank: ``q.unbind(1)``), marked: its ``len`` is the rank's count."""
    made = HeadSizedTuple(items)
    made.origin = origin
    return made


class HeadRange:
    """``range(h)`` of the rank's head count in the model's code, outside a Region: the same numbers, each a
    :class:`HeadIndex` (head_host_calls.py makes it)."""

    def __init__(self, numbers: range, origin: str) -> None:
        self._numbers, self.origin = numbers, origin  # (origin: what each number says it is)

    def __iter__(self) -> Iterator[HeadIndex]:
        return (HeadIndex(n, self.origin) for n in self._numbers)

    def __reversed__(self) -> Iterator[HeadIndex]:
        return (HeadIndex(n, self.origin) for n in reversed(self._numbers))

    def __len__(self) -> int:
        return len(self._numbers)

    def __getitem__(self, at: Any) -> Any:
        found = self._numbers[at]
        return HeadRange(found, self.origin) if isinstance(found, range) else HeadIndex(found, self.origin)

    def __contains__(self, n: Any) -> bool:
        return n in self._numbers

    def __eq__(self, other: Any) -> bool:
        return self._numbers == (other._numbers if isinstance(other, HeadRange) else other)

    def __hash__(self) -> int:
        return hash(self._numbers)

    def __repr__(self) -> str:
        return repr(self._numbers)

    def index(self, n: Any) -> int:
        return self._numbers.index(n)

    def count(self, n: Any) -> int:
        return self._numbers.count(n)

    @property
    def start(self) -> int:
        return self._numbers.start

    @property
    def stop(self) -> int:
        return self._numbers.stop

    @property
    def step(self) -> int:
        return self._numbers.step


Sequence.register(HeadRange)  # (random.sample and the like ask; isinstance(r, range) too: head_host_calls.py)


def _found(a: Any) -> Iterator[Any]:
    if isinstance(a, Marked):
        yield a
    elif isinstance(a, (list, tuple)):
        for e in a:
            yield from _found(e)
    elif isinstance(a, slice):
        yield from (e for e in (a.start, a.stop, a.step) if isinstance(e, Marked))
    elif isinstance(a, HeadRange):
        yield HeadIndex(a.start, a.origin)  # (its numbers: torch.tensor(range(h)) is a tensor of head numbers)


def counts_in(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The marked numbers among a torch call's arguments (in lists, tuples and slices too)."""
    return [n for a in (*args, *kwargs.values()) for n in _found(a)]


# Calls whose numbers are sizes of their output or of its pieces: the values they make do not depend on them.
_SIZES = frozenset({
    "view", "reshape", "_reshape_alias", "expand", "broadcast_to", "unflatten", "repeat", "tile", "new_empty",
    "new_zeros", "new_ones", "empty", "zeros", "ones", "rand", "randn", "empty_strided", "new_empty_strided",
    "split", "split_with_sizes", "tensor_split", "chunk", "pad", "constant_pad_nd", "unfold", "repeat_interleave",
    "size", "__get__", "numel", "dim", "layer_norm", "rms_norm", "group_norm", "interpolate", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d",
})
_FILLED = {"full": 0, "new_full": 1}  # their size argument's place (the fill value is a value)
_PLACES = frozenset({"__getitem__", "__setitem__", "select", "narrow"})  # (their numbers are places)


def count_misuse(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], per_head: Callable[[Any], bool]
) -> tuple[str, bool] | None:
    """How a torch call uses a marked number among its arguments as a value, and whether as a scalar (a scale,
    a fill value: the fix is the whole count, not a per-head table); None where only as a size (an ``arange``
    over it too: its result is followed, :class:`HeadNumbers`). ``per_head(t)``: whether ``t`` is a per-head
    tensor (whose indices head_views.py judges)."""
    found = counts_in(args, kwargs)
    if not found or name in _SIZES or name == "arange":
        return None
    numbered = next((n for n in found if isinstance(n, Numbered)), None)
    if numbered is not None:
        return _numbered_misuse(name, args, kwargs, numbered, per_head)
    origin = found[0].origin
    if name in _FILLED:
        at = _FILLED[name]
        rest = counts_in([a for k, a in enumerate(args) if k != at], {k: v for k, v in kwargs.items() if k != "size"})
        return (f"fills a tensor with {origin} ({name})", True) if rest else None
    if name == "__setitem__" and counts_in(args[2:], kwargs):
        return f"writes {origin} into a tensor as a value", True
    if name in _PLACES and args and per_head(args[0]):
        return None  # an index of a per-head tensor (q[:, :h], q[:, (h + 1) % H]): head_views.py judges it
    if name in _PLACES:
        return (f"indexes a tensor of shape {list(args[0].shape)} that holds no heads of its own by {origin} ({name}): "
                "the first heads' rows of a table on every rank, not this rank's"), False
    return f"passes {origin} to {name} as a value", True


# Calls that make a tensor of the numbers they are given: of head numbers, a tensor of them (HeadNumbers follows it).
_MADE = frozenset({"tensor", "as_tensor", "asarray", "new_tensor", "LongTensor", "IntTensor"})


def _numbered_misuse(
    name: str, args: Sequence[Any], kwargs: dict[str, Any], numbered: Any, per_head: Callable[[Any], bool]
) -> tuple[str, bool] | None:
    """How a torch call uses a head number (a loop's ``h``) as a value, or as an index of a tensor that holds no
    heads of its own (a table of every head's values: the first heads' on every rank); None where only as an index
    of the heads, a place or a size (or made into a tensor of head numbers, which is followed)."""
    if name == "__setitem__" and counts_in(args[2:], kwargs):
        return f"writes {numbered.origin} into a tensor as a value", False
    if name in _PLACES and args and isinstance(args[0], torch.Tensor) and not per_head(args[0]):
        return (f"indexes a tensor of shape {list(args[0].shape)} that holds no heads of its own by "
                f"{numbered.origin} ({name}): the first heads' rows of a table on every rank, not this rank's"), False
    if name in _PLACES:
        return None  # q[:, h], out[:, h] = ..., select(1, h): the rank's head h in its place
    if name in _MADE and all(isinstance(n, HeadIndex) for n in counts_in(args, kwargs)):
        return None  # torch.tensor([h]): an index of the heads, followed (HeadNumbers)
    return f"passes {numbered.origin}, this rank's head number, to {name} as a value", False


# Where a call takes indices (a tensor of head numbers there names the rank's heads in their places: exact).
_INDEX_AT = {
    "__getitem__": 1, "__setitem__": 1, "index_select": 2, "index_fill": 2, "index_fill_": 2, "index_copy": 2,
    "index_copy_": 2, "index_add": 2, "index_add_": 2, "index_reduce": 2, "index_reduce_": 2, "scatter": 2,
    "scatter_": 2, "scatter_add": 2, "scatter_add_": 2, "scatter_reduce": 2, "scatter_reduce_": 2, "gather": 2,
    "take_along_dim": 1, "index_put": 1, "index_put_": 1, "take": 1,
}
# Calls whose other tensors give only a shape or a dtype (expand_as(q)), and calls that gather tensors whole.
_REFERENCE = frozenset({"expand_as", "view_as", "reshape_as", "type_as", "broadcast_to", "to"})
_GATHERING = frozenset({"cat", "concat", "concatenate", "stack", "broadcast_tensors", "meshgrid", "hstack", "vstack"})


class HeadNumbers:
    """The tensors whose values are the rank's head numbers, or computed from them (an arange over the count)."""

    def __init__(self) -> None:
        self._marked: dict[int, tuple[weakref.ref[Tensor], str]] = {}

    def origin(self, t: Any) -> str | None:
        found = self._marked.get(id(t)) if isinstance(t, Tensor) else None
        return found[1] if found is not None and found[0]() is t else None

    def mark(self, out: Any, origin: str) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self._marked[id(t)] = (weakref.ref(t), origin)

    def see(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any,
            per_head: Callable[[Any], bool] = lambda t: True) -> str | None:
        """Follow the head numbers into ``out``; how the call uses them as values with other tensors, or as an
        index of a tensor that holds no heads of its own (``per_head`` says which do; None: as indices of the
        heads, or among themselves and Python numbers)."""
        if name == "arange":
            counted = counts_in(args, kwargs)
            if counted:
                self.mark(out, f"torch.arange over {counted[0].origin}")
            return None
        if name in _MADE:
            numbered = [n for n in counts_in(args, kwargs) if isinstance(n, HeadIndex)]
            if numbered:
                self.mark(out, f"torch.{name} of {numbered[0].origin}")
                return None
        if not self._marked:
            return None
        at = _INDEX_AT.get(name)
        values = [(k, a) for k, a in _positions(args, kwargs) if k != at and k != "index"]
        numbers = [n for n in (self.origin(t) for _, t in values) if n is not None]
        if not numbers:
            index = [self.origin(t) for k, t in _positions(args, kwargs) if k == at or k == "index"]
            first = args[0] if args else None
            if at is not None and any(index) and isinstance(first, Tensor) and self.origin(first) is None and (
                    not per_head(first)):
                return (f"indexes a tensor of shape {list(first.shape)} that holds no heads of its own by "
                        f"{next(n for n in index if n)} ({name}): the first heads' rows of a table on every rank, "
                        "not this rank's")
            return None  # indices only (or none): the indexed tensor's values, in the rank's heads' places
        others = [t for k, t in values if self.origin(t) is None and not (name in _REFERENCE and k != 0)]
        if others and name not in _GATHERING:
            return (f"computes {name} of {numbers[0]}, this rank's head numbers 0 .. H/tp - 1, with a tensor of "
                    f"shape {list(others[0].shape)}: as values, not as an index of the heads")
        self.mark(out, numbers[0])
        return None


def _positions(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Tensor]]:
    """The tensors among a call's arguments, each with its place (an int, or the keyword), in lists too."""
    for k, a in (*enumerate(args), *kwargs.items()):
        if k in ("index", "indices"):
            k = "index"
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, Tensor):
                yield k, t


def is_count_read(func: Any, name: str) -> bool:
    return name in ("size", "__get__") and (name != "__get__" or func == _SHAPE_GET)


_SHAPE_GET = torch.Tensor.shape.__get__  # type: ignore[attr-defined]


def mark_count(out: Any, dim: int, t: Tensor, args: Sequence[Any], origin: Callable[[str], str]) -> Any:
    """A shape read ``out`` of ``t`` (``size()``, ``size(d)``, ``.shape``) with the heads dim ``dim`` marked."""
    if isinstance(out, int):
        d = args[1] if len(args) > 1 else None
        return HeadCount(out, origin(f"size({d}) ({out})")) if isinstance(d, int) and d % t.dim() == dim else out
    return torch.Size([HeadCount(v, origin(f"shape[{dim}] ({v})")) if k == dim else v for k, v in enumerate(out)])
