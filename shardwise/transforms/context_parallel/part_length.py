"""Numbers read from the length of the rank's part of the sequence, marked, and where they may go.

Under context_parallel a layer holds ``t / n`` positions. A number read from a shape along a dim that holds
them (``h.shape[1]``, ``x.size(1)``, ``x.numel()``) is the part's length where the model means
the sequence's: right as a size (``h.view(b, t, heads, d)``, ``x.new_zeros(b, t)``, ``h[:, :t]`` over the
whole dim), wrong as a value (``aux * t``, ``x / x.size(1)``, ``torch.full(.., t)``, ``torch.arange(t)``,
``torch.linspace(0, 1, t)``, ``math.sqrt(t)``). Shape reads reach no dispatcher as tensors, so the watched first
call (``unsplit.py``) returns them as :class:`PartLength`, an ``int`` that keeps its origin through Python's
arithmetic (``t * 2``, ``t // heads``; ``1 / t`` a :class:`PartFloat`), and judges every torch call given one
(:func:`judge_numbers`): as a size it passes, as anything else it is refused. Turning one into a Python
``float`` (``math.sqrt(t)``, ``math.log(t)``, ``float(t)``) is refused where it happens: what is made of the
float cannot be followed.

Python's bit operators and ``divmod`` keep the mark; numpy's ufuncs and functions given one (``np.sqrt(t)``,
``np.clip(t, ..)``) are refused (numpy asks an ``int`` subclass among the arguments first, through ``__array_ufunc__`` /
``__array_function__``). ``len(x)`` of a tensor whose dim 0 holds positions is refused where it is read
(CPython turns what ``__len__`` returns into a plain ``int``: it cannot be marked).

``int()`` of one, or of a float computed from one (``int(t)``, ``int(t * 0.5)``; numpy reading one as a
scalar or in a list, ``np.asarray(t)``, ``np.prod([t, 2])``), and ``float()`` of a float computed from one
(``float(1 / t)``; ``np.float64(t)``), are refused where the watched layer's code (or numpy's) takes them,
not torch's or shardwise's: CPython copies what ``__int__`` returns into a plain ``int``, so the mark cannot
survive it, and a size or a value cannot be told apart there (a size needs no ``int()``: the read is one).
A product of the length as read with plain ints keeps where its positions are (``rows``: ``b * t`` is
(batch, sequence) folded, ``t * h`` holds ``h`` inside each position, in the order written), so a new tensor
of that size holds positions (``shape_reads.sized_dims``).

Each marked number also carries ``whole``, what one device has in its place (a shape read's size times the
parts the sequence is cut into, and Python's arithmetic on it alongside): a comparison in the layer's code
(``if t > 1024``, ``t == 1``, ``min(t, window)``) that one device would answer otherwise is refused, as the
layer would take another branch; one answered alike (a bound the whole sequence is within) passes.

A number that leaves Python's arithmetic for a plain one through neither ``__int__`` nor ``__float__``
(``range(t)``, so ``len(range(t))`` too; ``numpy.arange(t)``; ``math.sqrt(1 / t)``: math reads a float subclass's
value in C) is refused where that call takes it (``host_calls.py``), also under a name the model's module bound
before the watch (``from math import sqrt``); so is a list or tuple repeated that many times (``[1.0] * t``: its
items are not followed); so are int's own methods that read its value (``t.bit_length()``), and a copy of one
(``copy.deepcopy``, pickle) is the same marked number. What it cannot see: ``str(t)``, ``x.shape.numel()``
(``torch.Size`` cannot be subclassed or patched and multiplies its ints in C; ``x.numel()`` is marked), and a number
read outside the watched first call.
"""

from __future__ import annotations

import math
import operator
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

_watch = threading.local()  # .refuse: while a watched call runs on this thread, what refuses a float made of one


class PartLength(int):
    """An ``int`` made from the length of the rank's part of the sequence; ``origin`` says how it was read."""

    origin: str
    length: int | None  # the part's length it was read as (None: a product with other dims, or computed)
    rows: tuple[int, int] | None  # a product of it with plain ints: the stride range its positions count in
    whole: Any  # the number one device computes in its place (of the whole sequence's length); None: not known

    def __new__(cls, value: int, origin: str, length: int | None = None,
                rows: tuple[int, int] | None = None, whole: Any = None) -> PartLength:
        made = super().__new__(cls, value)
        made.origin, made.length, made.rows, made.whole = origin, length, rows, whole
        return made

    def __float__(self) -> float:
        _refuse_float(self.origin, "float")
        return float(int.__int__(self))

    def __int__(self) -> int:
        # (CPython copies what __int__ returns into a plain int: the mark cannot survive it, only be seen)
        if _by_the_model():
            _refuse(self.origin, "turns it into a plain int (int(...)), which cannot be followed: a value made of "
                                 "it is the part's count (a size needs no int(): pass the read as it is)")
        return int.__int__(self)

    def __ceil__(self) -> PartLength:
        return self

    __floor__ = __trunc__ = __ceil__

    def __round__(self, ndigits: Any = None) -> PartLength:
        return self

    def __neg__(self) -> PartLength:
        return PartLength(-int.__int__(self), self.origin, whole=_unary(operator.neg, self))

    def __abs__(self) -> PartLength:
        return PartLength(abs(int.__int__(self)), self.origin, whole=_unary(abs, self))

    def __pos__(self) -> PartLength:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # (copy.copy(t), copy.deepcopy(x.shape), pickle: the same marked number, not a TypeError of __new__'s)
        return PartLength, (int.__int__(self), self.origin, self.length, self.rows, self.whole)

    def bit_length(self) -> int:
        # (int's own methods read the value in C: one that gives a number of it would carry the count unmarked)
        if _by_the_model():
            _refuse(self.origin, "reads its bits (bit_length()), a plain int that cannot be followed")
        return int.bit_length(self)

    def bit_count(self) -> int:
        if _by_the_model():
            _refuse(self.origin, "reads its bits (bit_count()), a plain int that cannot be followed")
        return int.bit_count(self)

    def to_bytes(self, *args: Any, **kwargs: Any) -> bytes:
        if _by_the_model():
            _refuse(self.origin, "turns it into bytes (to_bytes()), which cannot be followed")
        return int.to_bytes(self, *args, **kwargs)

    def as_integer_ratio(self) -> tuple[int, Literal[1]]:
        return self, 1

    def conjugate(self) -> PartLength:
        return self

    @property
    def real(self) -> PartLength:
        return self

    @property
    def numerator(self) -> PartLength:
        return self


class PartFloat(float):
    """A ``float`` computed from the length of the rank's part (``1 / t``, ``t ** 0.5``)."""

    origin: str
    whole: Any  # as PartLength's

    def __new__(cls, value: float, origin: str, whole: Any = None) -> PartFloat:
        made = super().__new__(cls, value)
        made.origin, made.whole = origin, whole
        return made

    def __float__(self) -> float:
        # (float(1 / t); math's functions read a float subclass's value in C, unseen: math.sqrt(1 / t))
        if _by_the_model():
            _refuse_float(self.origin, "float")
        return float.__float__(self)

    def __int__(self) -> int:
        if _by_the_model():
            _refuse(self.origin, "turns a float computed from it into a plain int (int(...)), which cannot be "
                                 "followed (a size computed from it keeps the mark as t // k)")
        return int(float.__float__(self))

    def __ceil__(self) -> PartLength:
        return PartLength(math.ceil(float.__float__(self)), self.origin, whole=_unary(math.ceil, self))

    def __floor__(self) -> PartLength:
        return PartLength(math.floor(float.__float__(self)), self.origin, whole=_unary(math.floor, self))

    def __trunc__(self) -> PartLength:
        return PartLength(math.trunc(float.__float__(self)), self.origin, whole=_unary(math.trunc, self))

    def __round__(self, ndigits: Any = None) -> Any:
        if ndigits is None:
            return PartLength(round(float.__float__(self)), self.origin, whole=_unary(round, self))
        return PartFloat(round(float.__float__(self), ndigits), self.origin,
                         whole=_unary(lambda w: round(w, ndigits), self))

    def __neg__(self) -> PartFloat:
        return PartFloat(-float.__float__(self), self.origin, whole=_unary(operator.neg, self))

    def __abs__(self) -> PartFloat:
        return PartFloat(abs(float.__float__(self)), self.origin, whole=_unary(abs, self))

    def __pos__(self) -> PartFloat:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return PartFloat, (float.__float__(self), self.origin, self.whole)


Part = (PartLength, PartFloat)


def _plain(x: Any) -> Any:
    if isinstance(x, PartLength):
        return int.__int__(x)
    if isinstance(x, PartFloat):
        return float.__float__(x)
    return x


def _marked(value: Any, origin: str, whole: Any = None) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return PartLength(value, origin, whole=whole) if isinstance(value, int) else PartFloat(value, origin, whole)


def _whole(x: Any) -> Any:
    """What one device has in the place of ``x``: a marked number's ``whole``, a plain number itself."""
    return x.whole if isinstance(x, Part) else x


def _unary(op: Callable[[Any], Any], x: Any) -> Any:
    w = _whole(x)
    return None if w is None else op(w)


def _shadow(op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """``op`` of what one device has in the places of ``a`` and ``b`` (None where either is not known)."""
    a, b = _whole(a), _whole(b)
    if a is None or b is None:
        return None
    try:
        return op(a, b)
    except (ArithmeticError, ValueError):
        return None


def _binary(op: Callable[[Any, Any], Any], reflected: bool) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        if op is operator.mul and isinstance(other, (list, tuple)) and isinstance(self, PartLength) and (
                _by_the_model()):
            # ``[1.0] * t``: Python repeats the list, reading the int in C; its items are not followed, so what is
            # counted from them (a cumulative sum of it as a tensor) is the part's positions
            _refuse(self.origin, f"repeats a {type(other).__name__} that many times, whose items (as many as this "
                                 "rank's part has, plain values) cannot be followed: positions or a count made of "
                                 "them are the part's")
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            return NotImplemented  # a tensor's reflected method takes it (and the watch sees the number there)
        a, b = (_plain(other), _plain(self)) if reflected else (_plain(self), _plain(other))
        value = op(a, b)
        whole = _shadow(op, other, self) if reflected else _shadow(op, self, other)
        if type(value) is int and isinstance(self, PartLength) and value == int.__int__(self) and whole == self.whole:
            return self  # (t + 0, t * 1: the length as read)
        if op is operator.mul and type(value) is int and type(other) is int and isinstance(self, PartLength):
            return PartLength(value, self.origin, rows=_rows(self, other, reflected), whole=whole)
        return _marked(value, self.origin, whole)

    return method


def _rows(part: PartLength, k: int, outer: bool) -> tuple[int, int] | None:
    """The stride range of the positions in rows ``k * part`` (``outer``: ``b * t``, (batch, sequence) folded, in
    the order written) or ``part * k`` (``t * h``: ``k`` inside each position), where ``part`` is the length as
    read or such a product (see ``sequence_tags.py``); None for any other number."""
    if part.rows is not None:
        lo, hi = part.rows
    elif part.length is not None and int.__int__(part) == part.length:
        lo, hi = 1, part.length
    else:
        return None
    return (lo, hi) if outer else (lo * k, hi * k)


_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
               "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow}
for _name, _op in _ARITHMETIC.items():
    for _cls in Part:
        setattr(_cls, f"__{_name}__", _binary(_op, False))
        setattr(_cls, f"__r{_name}__", _binary(_op, True))


# Python's bit operators (``t << 1``, ``t & mask``) exist on ints only; ``divmod`` gives a pair.
_BITWISE = {"lshift": operator.lshift, "rshift": operator.rshift, "and": operator.and_, "or": operator.or_,
            "xor": operator.xor}
for _name, _op in _BITWISE.items():
    setattr(PartLength, f"__{_name}__", _binary(_op, False))
    setattr(PartLength, f"__r{_name}__", _binary(_op, True))


def _divmod(reflected: bool) -> Callable[[Any, Any], Any]:
    quotient, remainder = _binary(operator.floordiv, reflected), _binary(operator.mod, reflected)

    def method(self: Any, other: Any) -> Any:
        q = quotient(self, other)
        return q if q is NotImplemented else (q, remainder(self, other))

    return method


def _compare(op: Callable[[Any, Any], bool], sign: str) -> Callable[[Any, Any], Any]:
    """A comparison (``if t > 1024``, ``min(t, window)``), refused in the watched layer's code where one device,
    comparing the whole sequence's number, would get the other answer: the layer would take another branch."""

    def method(self: Any, other: Any) -> Any:
        if isinstance(other, bool) or not isinstance(other, (int, float)):
            return NotImplemented
        answer = op(_plain(self), _plain(other))
        whole = _shadow(op, self, other)
        if whole is not None and whole != answer and _by_the_model():
            _refuse(self.origin, f"compares it ({sign} {_plain(other)}): {answer} here, {whole} for the whole "
                                 "sequence on one device, so the layer would take another branch")
        return answer

    return method


_COMPARISONS = {"lt": (operator.lt, "<"), "le": (operator.le, "<="), "gt": (operator.gt, ">"),
                "ge": (operator.ge, ">="), "eq": (operator.eq, "=="), "ne": (operator.ne, "!=")}
for _cls in Part:
    for _name, (_op, _sign) in _COMPARISONS.items():
        setattr(_cls, f"__{_name}__", _compare(_op, _sign))
PartLength.__hash__ = int.__hash__  # type: ignore[method-assign]
PartFloat.__hash__ = float.__hash__  # type: ignore[method-assign]


def _array_ufunc(self: Any, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
    """numpy's ufuncs (``np.sqrt(t)``, ``np.log2(t)``) ask an int subclass first: refused while watching."""
    _refuse(self.origin, f"passes it to numpy.{ufunc.__name__}, whose result is then a value of the computation")
    return getattr(ufunc, method)(*(_plain(i) for i in inputs), **kwargs)


def _array_function(self: Any, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """numpy's functions given one (``np.clip(t, ..)``; one inside a list, ``np.prod([t, 2])``, is refused at
    the ``int()`` numpy takes of it): refused while watching."""
    _refuse(self.origin, f"passes it to numpy.{func.__name__}, whose result is then a value of the computation")
    return func._implementation(*(_plain(a) for a in args), **{k: _plain(v) for k, v in kwargs.items()})


_METHODS = {"__divmod__": _divmod(False), "__rdivmod__": _divmod(True), "__array_ufunc__": _array_ufunc,
            "__array_function__": _array_function}
for _cls in Part:
    for _name, _method in _METHODS.items():
        setattr(_cls, _name, _method)


def _refuse(origin: str, what: str) -> None:
    refuse = getattr(_watch, "refuse", None)
    if refuse is not None:
        refuse(origin, what)


_OWN = ("torch.", "shardwise.", "transformers.masking_utils")


def _by_the_model() -> bool:
    """Whether the int() / float() or comparison being taken is the watched layer's code's (or numpy's, on its
    behalf: what it returns is not judged again): not torch's (a torch call's result is judged by
    ``judge_numbers``), shardwise's own (its watch reads the marked numbers as plain ones), or transformers'
    mask making's (replaced)."""
    return by_the_model_at(str(sys._getframe(2).f_globals.get("__name__", "")))


def by_the_model_at(caller: str) -> bool:
    """Whether code of the module ``caller`` taking a marked number is the watched layer's (see
    :func:`_by_the_model`), on a thread that watches."""
    return getattr(_watch, "refuse", None) is not None and (
        not caller.startswith(_OWN) or caller.startswith("shardwise.testing"))


def _refuse_float(origin: str, how: str) -> None:
    _refuse(origin, f"turns it into a Python float ({how}), which is then a value of the computation")


def watching(refuse: Callable[[str, str], None] | None) -> Callable[[str, str], None] | None:
    """Set this thread's refusal of a float made of a part's length (None: not watching); the one before."""
    before: Callable[[str, str], None] | None = getattr(_watch, "refuse", None)
    _watch.refuse = refuse
    return before


def numbers_in(args: Any, kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """``(number, where)``: each part's length among a torch call's arguments (in lists, tuples and slices
    too), with the argument or slice it was found in."""
    for a in (*args, *kwargs.values()):
        yield from _found(a, a)


def _found(a: Any, where: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(a, Part):
        yield a, where
    elif isinstance(a, (list, tuple)):
        for e in a:
            yield from _found(e, a if not isinstance(e, (list, tuple, slice)) else e)
    elif isinstance(a, slice):
        for e in (a.start, a.stop, a.step):
            if isinstance(e, Part):
                yield e, a
