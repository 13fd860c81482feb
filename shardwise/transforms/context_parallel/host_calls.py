"""Python's and numpy's calls that take a part's length in C, past its marks: watched while a layer's first call is.

A :class:`~.part_length.PartLength` keeps its mark through Python's arithmetic and is judged where ``__int__``,
``__float__``, numpy's protocols or a torch call take it. Some calls read an ``int`` subclass's value in C and ask
it nothing: ``range(t)`` (and so ``len(range(t))``, ``list(range(t))``), ``numpy.arange(t)``, and math's functions
of a float computed from one (``math.sqrt(1 / t)``; ``math.sqrt(t)`` asks ``__float__``, refused already) or of the
length as an integer (``math.isqrt(t)``, ``math.gcd(t, k)``). What they return is a plain number: the part's
positions counted ``0 .. t - 1``, or a value of the part's count. Each trained another model without an error
(TinyGPT, cp 2, float64, relative loss error at the second step: ``x * len(range(t)) / 8`` 8.0e-5; positions from
``list(range(t))``, from ``np.arange(t)``, and ``x * math.sqrt(1 / t)`` 1.3e-4 each).

numpy asks one only where it is among what a function dispatches on (``np.clip(t, ..)``), or converts a list holding
one; a size or a count it reads in C (``np.ones(t)``, ``np.zeros((b, t))``, ``np.linspace(0, 1, t)``), and an
array of the part's length is not followed (``np.ones(t).cumsum()`` counts the part's positions): relative loss
error 3.0e-6 for ``linspace``, 5.8e-4 for the two counts, without an error.

itertools' ``islice(it, t)`` and ``repeat(v, t)`` count their items in C too (positions from them: 5.6e-4, 5.8e-4).
(A list or tuple repeated, ``[1.0] * t``, asks the marked number: ``part_length.py`` refuses it.)

While any thread watches a layer's first call (``unsplit.watched``), :func:`calls_watched` puts watching stand-ins in
their places: ``builtins.range``, ``itertools.islice`` and ``itertools.repeat``, each of math's functions and each of
numpy's (its namespace's functions, not its ufuncs, which ask a marked number themselves, or its types). A
stand-in hands a marked number given by the watched layer's code (``part_length._by_the_model``: not torch's,
shardwise's, or another thread's) to the watch's refusal, and otherwise calls the original. ``math.ceil``,
``floor`` and ``trunc`` keep the mark (``t // k`` sized as ``math.ceil(t / k)``), as does ``math.prod`` (Python's
``*``): they are left as they are.
The stand-ins for the types are classes whose ``isinstance`` and ``issubclass`` answer for the originals. While they
stand (a layer's first call, per input shape), in every thread of the process: ``type(r) is range`` is False, and
pickle, which checks that a class or function is what its name finds, refuses a ``range`` object and a math or
numpy function taken before the watch (one taken during it pickles, by name).

A name bound before the watch (``from math import sqrt``, ``from numpy import arange`` at a module's top) is the
module's own binding of the original, which a stand-in in ``math`` leaves as it was: it trained another model as
silently (``sqrt(1 / t)``). So the watch also puts the stand-ins in the places of such bindings, in every imported
module that may be the model's code (:func:`_bindings`): not Python's standard library, torch, numpy, torch's
sympy and mpmath, or shardwise but its testing models. The modules are scanned once each (a few milliseconds for
a thousand), those imported since at the next watch.

What it cannot see: ``str(t)`` (a string is no value of the computation: a number parsed back from it would pass
unseen, while refusing it would refuse a model that logs its shapes), ``x.shape.numel()`` (``torch.Size``
multiplies its ints in C), and a name bound to the original elsewhere than a module's globals (a default argument,
a class attribute, a closure).
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import math
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from .part_length import Part, _by_the_model, _refuse

# Those that keep the mark: PartFloat's __ceil__, __floor__, __trunc__ (a size computed from the length), and prod,
# which multiplies with Python's ``*`` (a product of sizes).
_KEEPING = frozenset({"ceil", "floor", "trunc", "prod"})
# Not the model's code: their own bindings of the originals are left alone (torch's symbolic shapes call sympy).
_NOT_THE_MODEL = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "sympy", "mpmath", "shardwise"}
_lock = threading.Lock()
_watchers = [0]  # threads in a watched call now
_originals: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, stand-in) while they stand
# Per module name: (its globals' id, the names it binds to a watched original), from its scan (see _bindings)
_scanned: dict[str, tuple[int, tuple[str, ...]]] = {}
_made: dict[tuple[str, str, int], tuple[Any, Callable[..., Any]]] = {}  # (owner, name, id) -> (original, stand-in)


def _marked_in(values: Any, depth: int = 2) -> Any:
    """The first marked number among ``values`` (a list or tuple, one level into lists and tuples in it)."""
    for v in values:
        if isinstance(v, Part):
            return v
        if depth > 1 and isinstance(v, (list, tuple)):
            found = _marked_in(v, depth - 1)
            if found is not None:
                return found
    return None


class _WatchedType(type):
    """A type's stand-in (``range``, itertools' ``islice`` and ``repeat``): ``isinstance`` and ``issubclass`` answer
    for the original; a call given a marked number among its counts by the model's code is refused."""

    _original: type
    _counts: slice  # the positional arguments that are counts (``repeat(t, 3)`` repeats the marked number itself)
    _what: str
    _whose: str

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._original)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, cls._original)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        found = _marked_in((*args[cls._counts], *kwargs.values()), depth=1)
        if found is not None and _by_the_model():
            _refuse(found.origin, f"passes it to {cls._what}, whose {cls._whose} cannot be followed: positions or a "
                                  "count made of them are the part's")
        return cls._original(*args, **kwargs)


_AS_MANY = "items (as many as this rank's part has, plain values)"


def _watched_type(name: str, original: type, counts: slice, what: str, whose: str = _AS_MANY) -> type:
    return _WatchedType(name, (), {"_original": original, "_counts": counts, "_what": what, "_whose": whose})


_WatchedRange = _watched_type("range", range, slice(None), "range()",
                              "numbers (this rank's part counted 0 .. t - 1, plain ints)")
_TYPES = ((builtins, "range", _WatchedRange),
          (itertools, "islice", _watched_type("islice", itertools.islice, slice(1, None), "itertools.islice()")),
          (itertools, "repeat", _watched_type("repeat", itertools.repeat, slice(1, None), "itertools.repeat()")))


_RESULTS = {
    "math": "whose result is a plain number that cannot be followed: a value of the computation made of the part's "
            "count",
    "numpy": "whose result (a plain number, or an array whose length or values are the part's count: numpy's "
             "arrays are not followed) cannot be followed: a value of the computation, or the part's positions "
             "counted 0 .. t - 1",
}


def _watched_function(owner: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    result = _RESULTS[owner]

    def call(*args: Any, **kwargs: Any) -> Any:
        found = _marked_in((*args, *kwargs.values()))
        if found is not None and _by_the_model():
            _refuse(found.origin, f"passes it to {owner}.{name}, {result}")
        return original(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__module__ = getattr(original, "__module__", None) or owner  # pickled by reference, as the original
    call.__doc__ = original.__doc__
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def _numpy_function(value: Any) -> bool:
    """A function of numpy's namespace (Python's, C's, or one dispatching ``__array_function__``), not a ufunc or
    a type: ufuncs ask a marked number themselves (``__array_ufunc__``), and a stand-in would lose their methods."""
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType)) or (
        type(value).__name__ == "_ArrayFunctionDispatcher")


def _stand_ins() -> list[tuple[Any, str, Any]]:
    """(owner, name, stand-in) for every call watched: ``range``, math's functions (but those that keep the mark)
    and numpy's. numpy asks a marked number only where it is among what a function dispatches on (``np.clip(t,
    ..)``), or converts a list holding one (``np.prod([t, 2])``); a size or a count it reads in C (``np.ones(t)``,
    ``np.zeros((b, t))``, ``np.linspace(0, 1, t)``), and an array of it is not followed (``np.ones(t).cumsum()``
    counts the part's positions): each trained another model without an error."""
    out: list[tuple[Any, str, Any]] = list(_TYPES)
    for name in dir(math):
        original = getattr(math, name)
        if not name.startswith("_") and name not in _KEEPING and callable(original):
            out.append((math, name, _stand_in("math", name, original)))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        for name, original in list(vars(numpy).items()):  # (not dir(): numpy imports some names on first use)
            if not name.startswith("_") and _numpy_function(original):
                out.append((numpy, name, _stand_in("numpy", name, original)))
    return out


def _stand_in(owner: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """The stand-in of ``original``, made once per process (a watch puts back the same object each time)."""
    key = (owner, name, id(original))
    made = _made.get(key)
    if made is None or made[0] is not original:
        made = _made[key] = (original, _watched_function(owner, name, original))
    return made[1]


def _may_be_the_model(module_name: str) -> bool:
    top = module_name.partition(".")[0]
    return top not in _NOT_THE_MODEL or module_name.startswith("shardwise.testing")


def _bindings(originals: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """(module, name, original) for each global of a module that may be the model's code bound to one of
    ``originals`` (by id): ``from math import sqrt`` there. Each module's globals are scanned once (again where
    they were replaced, or while the module was still being imported)."""
    found = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or not _may_be_the_model(module_name):
            continue
        seen = _scanned.get(module_name)
        if seen is None or seen[0] != id(namespace):
            names = tuple(k for k, v in list(namespace.items()) if id(v) in originals and isinstance(k, str))
            if not getattr(getattr(module, "__spec__", None), "_initializing", False):
                _scanned[module_name] = (id(namespace), names)
        else:
            names = seen[1]
        found += [(module, k, namespace[k]) for k in names if id(namespace.get(k)) in originals]
    return found


@contextlib.contextmanager
def calls_watched() -> Iterator[None]:
    """Within (on any thread, while any thread is within): the stand-ins in the places of the calls watched,
    and of the model's modules' own bindings of them."""
    with _lock:
        if _watchers[0] == 0:
            standing: dict[int, Any] = {}  # id(original) -> its stand-in
            for owner, name, stand_in in _stand_ins():
                original = getattr(owner, name)
                _originals.append((owner, name, original, stand_in))
                setattr(owner, name, stand_in)
                if not isinstance(stand_in, _WatchedType):  # (only functions: a type bound elsewhere stays it)
                    standing[id(original)] = stand_in
            for module, name, original in _bindings(standing):
                _originals.append((module, name, original, standing[id(original)]))
                setattr(module, name, standing[id(original)])
        _watchers[0] += 1
    try:
        yield
    finally:
        with _lock:
            _watchers[0] -= 1
            if _watchers[0] == 0:
                for owner, name, original, stand_in in reversed(_originals):
                    if getattr(owner, name) is stand_in:  # (not where another hand set its own since)
                        setattr(owner, name, original)
                _originals.clear()
