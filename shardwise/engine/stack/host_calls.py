"""Python's and numpy's calls that read an ``int`` subclass's value in C, watched while a transform watches a call.

A transform that marks the numbers a layer reads (an ``int`` subclass that keeps its origin through Python's
arithmetic and is judged where a torch call takes it) cannot see the calls that read such a number's value in C and
ask it nothing: ``range(n)``, ``itertools.islice(it, n)`` and ``itertools.repeat(v, n)``, ``enumerate(it, start=n)``,
``operator.index(n)`` (an exact ``int`` since Python 3.10, read without asking ``__index__``), ``len`` and ``sum``
of a marked sequence given whole (a judge may mark what they return), math's functions
(``math.log2(n)`` reads an int directly; others ask ``__float__``), and numpy's functions (numpy asks the number only
where it is among what a function dispatches on: a size or a count it reads in C, ``np.linspace(0, 1, n)``). Their
results are plain numbers, or arrays and items that are not followed.

A transform registers its marked types with a :data:`Judge` (:func:`register`) and watches a call inside
:func:`calls_watched`: while any thread is inside, the calls above are stand-ins, in their modules and in the places
of a module's own bindings of them (``from math import sqrt``) wherever that module may be the model's code (not
Python's standard library, torch, numpy, torch's sympy and mpmath, or shardwise but its testing models: each module
scanned once, a few milliseconds for a thousand). A stand-in given a marked number (in its arguments, or one level
into a list or tuple of them) hands it to its type's judge, with the module of the code that called it, what was
called and its kind; the judge refuses it, or lets it pass, and the stand-in calls the original and returns its
result, or what the judge makes of it where the judge says (one that follows the numbers a ``range`` over its count
gives). ``math.ceil``, ``floor``, ``trunc`` and ``prod`` are left as they are (a marked number keeps its mark
through them, a size).

The stand-ins for the types are classes whose ``isinstance`` and ``issubclass`` answer for the originals. While they
stand, in every thread of the process: ``type(r) is range`` (or ``enumerate``) is False, a class the watched code
derives from one of them is not one, and pickle, which checks that a class or function is what its name finds,
refuses a ``range`` or ``enumerate`` object and a math or numpy function taken before the watch (one taken during
it pickles, by name). What none of them sees: a name bound to an original
elsewhere than a module's globals (a default argument, a class attribute, a closure).
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import math
import operator
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

# (the marked number, the module of the code that called, the call named as a message says it, its kind: "math",
# "numpy", "operator", or for the types "range", "islice", "repeat", "enumerate") -> None, or what to make of the
# call's result in its place (a transform that follows the numbers a ``range`` of its count gives)
Judge = Callable[[Any, str, str, str], "Callable[[Any], Any] | None"]

# Those that keep the mark: a marked float's __ceil__, __floor__, __trunc__ (a size computed from a count), and
# prod, which multiplies with Python's ``*`` (a product of sizes).
_KEEPING = frozenset({"ceil", "floor", "trunc", "prod"})
# Not the model's code: their own bindings of the originals are left alone (torch's symbolic shapes call sympy).
_NOT_THE_MODEL = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "sympy", "mpmath", "shardwise"}
_judges: dict[type, Judge] = {}
# Read by the stand-ins without the lock: replaced whole under it (a registration while another thread watches)
_registered: list[tuple[tuple[type, Judge], ...]] = [()]
_marked_types: list[tuple[type, ...]] = [()]
_lock = threading.Lock()
_watchers = [0]  # threads in a watched call now
_originals: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, stand-in) while they stand
# The modules scanned (see _bindings), and those that bind a watched original: (the module, the names)
_scanned: dict[str, int] = {}  # module name -> id of the module scanned
_bound: dict[str, tuple[Any, tuple[str, ...]]] = {}
_scanned_for: list[frozenset[int]] = [frozenset()]  # the originals (by id) the scans looked for
# sys.modules as the last scan saw it: its names, their modules' ids, the modules themselves (held to the next
# scan, so that no module made since takes a scanned one's id: a replacement at a freed one's address read as
# the module scanned, and went unwatched), and whether that scan left none to scan again (one mid-import)
_modules_scanned: list[tuple[list[str], list[int], tuple[Any, ...], bool] | None] = [None]
_listed: list[tuple[Any, list[tuple[Any, str, Any]]]] = []  # (the namespaces listed, by id and size; the list)
_made: dict[tuple[str, str, int], tuple[Any, Callable[..., Any]]] = {}  # (owner, name, id) -> (original, stand-in)
_made_in_place: dict[str, tuple[type, ...]] = {}  # a watched type's kind -> what judges make in place of its results


def reads_as(kind: str, made: type) -> None:
    """Let ``made``, what a judge makes in place of a watched type's result (``kind``: ``"range"``), answer
    ``isinstance`` for that type while the stand-ins stand."""
    with _lock:
        _made_in_place[kind] = (*_made_in_place.get(kind, ()), made)


def register(marked: tuple[type, ...], judge: Judge) -> None:
    """Hand the numbers of the ``marked`` types that a watched call takes to ``judge``."""
    with _lock:
        for cls in marked:
            _judges[cls] = judge
        _registered[0] = tuple(_judges.items())
        _marked_types[0] = tuple(_judges)


def _marked_in(values: Any, depth: int = 2) -> Any:
    """The first marked number among ``values`` (a list or tuple, one level into lists and tuples in it)."""
    marked = _marked_types[0]
    for v in values:
        if isinstance(v, marked):
            return v
        if depth > 1 and isinstance(v, (list, tuple)):
            found = _marked_in(v, depth - 1)
            if found is not None:
                return found
    return None


def _judge(found: Any, call: str, kind: str) -> Callable[[Any], Any] | None:
    """Hand ``found`` to its type's judge, with the module of the code that called the stand-in; what the judge
    makes of the call's result, if anything."""
    caller = str(sys._getframe(2).f_globals.get("__name__", ""))
    judge = next(j for cls, j in _registered[0] if isinstance(found, cls))
    return judge(found, caller, call, kind)


class _WatchedType(type):
    """A type's stand-in: ``isinstance`` and ``issubclass`` answer for the original; a call given a marked number
    among its counts is judged."""

    _original: type
    _counts: slice  # the positional arguments that are counts (``repeat(n, 3)`` repeats the marked number itself)
    _call: str
    _kind: str

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (cls._original, *_made_in_place.get(cls._kind, ())))

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, cls._original)

    def __getitem__(cls, item: Any) -> Any:
        return cls._original[item]  # type: ignore[index]  # (a type hint: enumerate[int])

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        found = _marked_in((*args[cls._counts], *kwargs.values()), depth=1)
        made = _judge(found, cls._call, cls._kind) if found is not None else None
        result = cls._original(*args, **kwargs)
        return result if made is None else made(result)


def _watched_type(name: str, original: type, counts: slice, call: str) -> type:
    return _WatchedType(name, (), {"_original": original, "_counts": counts, "_call": call, "_kind": name})


_TYPES = ((builtins, "range", _watched_type("range", range, slice(None), "range()")),
          (itertools, "islice", _watched_type("islice", itertools.islice, slice(1, None), "itertools.islice()")),
          (itertools, "repeat", _watched_type("repeat", itertools.repeat, slice(1, None), "itertools.repeat()")),
          (builtins, "enumerate", _watched_type("enumerate", enumerate, slice(None), "enumerate()")))
# Python's own that a judge may mark the results of (``len`` of a list a count repeated): the marked value given
# whole, not an item of it (a scan of every list's items at each ``len`` would cost what the list holds).
_WHOLE_ONLY = ("len", "sum")


def _watched_function(owner: str, name: str, original: Callable[..., Any], depth: int = 2) -> Callable[..., Any]:
    call_name = f"{owner}.{name}"

    def call(*args: Any, **kwargs: Any) -> Any:
        found = _marked_in((*args, *kwargs.values()), depth)
        made = _judge(found, call_name, owner) if found is not None else None
        result = original(*args, **kwargs)
        return result if made is None else made(result)

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
    """(owner, name, stand-in) for every call watched (listed again only where math's or numpy's names changed)."""
    numpy = sys.modules.get("numpy")
    key = (len(vars(math)), id(numpy), len(vars(numpy)) if numpy is not None else 0)
    if _listed and _listed[0][0] == key:
        return _listed[0][1]
    out = _list_stand_ins()
    _listed[:] = [(key, out)]
    return out


def _list_stand_ins() -> list[tuple[Any, str, Any]]:
    out: list[tuple[Any, str, Any]] = list(_TYPES)
    out.append((operator, "index", _stand_in("operator", "index", operator.index)))
    out += [(builtins, name, _stand_in("builtins", name, getattr(builtins, name), depth=1)) for name in _WHOLE_ONLY]
    for name, original in list(vars(math).items()):
        if not name.startswith("_") and name not in _KEEPING and callable(original):
            out.append((math, name, _stand_in("math", name, original)))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        for name, original in list(vars(numpy).items()):  # (not dir(): numpy imports some names on first use)
            if not name.startswith("_") and _numpy_function(original):
                out.append((numpy, name, _stand_in("numpy", name, original)))
    return out


def _stand_in(owner: str, name: str, original: Callable[..., Any], depth: int = 2) -> Callable[..., Any]:
    """The stand-in of ``original``, made once per process (a watch puts back the same object each time)."""
    key = (owner, name, id(original))
    made = _made.get(key)
    if made is None or made[0] is not original:
        made = _made[key] = (original, _watched_function(owner, name, original, depth))
    return made[1]


def may_be_the_model(module_name: str) -> bool:
    """Whether code of this module may be the model's: not Python's standard library, torch, numpy, torch's sympy
    and mpmath, or shardwise but its testing models."""
    top = module_name.partition(".")[0]
    return top not in _NOT_THE_MODEL or module_name.startswith("shardwise.testing")


def _scan(originals: dict[int, Any]) -> None:
    """Scan the modules new, or replaced, since their scan (``_bindings``)."""
    modules = dict(sys.modules)
    pending = False
    current = {module_name: id(module) for module_name, module in modules.items()}
    for gone in _scanned.keys() - current.keys():  # removed: a module made later at its address is another
        del _scanned[gone]
    for module_name, module_id in current.items() - _scanned.items():  # new, or replaced since its scan
        module = modules[module_name]
        _bound.pop(module_name, None)
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and may_be_the_model(module_name):
            names = tuple(k for k, v in list(namespace.items()) if id(v) in originals and isinstance(k, str))
            if names:
                _bound[module_name] = (module, names)
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                pending = True
                continue  # still being imported: scanned again at the next watch
        _scanned[module_name] = module_id
    _modules_scanned[0] = (list(modules), list(map(id, modules.values())), tuple(modules.values()), not pending)


def _unchanged(scanned: tuple[list[str], list[int], tuple[Any, ...], bool] | None) -> bool:
    """Whether ``sys.modules`` holds the modules it held at the complete scan ``scanned`` (their names and ids, in
    order: one replaced since, even by an object that compares equal, is a change), compared in C."""
    if scanned is None:
        return False
    names, ids, _, complete = scanned
    modules = sys.modules
    return complete and len(modules) == len(names) and list(map(id, modules.values())) == ids \
        and list(modules) == names


def _bindings(originals: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """(module, name, original) for each global of a module that may be the model's code bound to one of
    ``originals`` (by id): ``from math import sqrt`` there. Each module is scanned once, at the first watch after
    its import (one still being imported, again at the next; one replaced in ``sys.modules`` since, again; every
    one again where the originals are others)."""
    watched = frozenset(originals)
    if _scanned_for[0] != watched:  # other originals than the scans looked for (numpy imported since): again
        _scanned.clear()
        _bound.clear()
        _scanned_for[0] = watched
        _modules_scanned[0] = None
    # Unchanged since a scan that left none to scan again: nothing new, in a tenth of a millisecond; the scan's
    # walk over sys.modules, thousands of entries with torch's and transformers', took one at every watch (2% of
    # the suite's time).
    if not _unchanged(_modules_scanned[0]):
        _scan(originals)
    found = []
    for module_name, (module, names) in list(_bound.items()):
        if sys.modules.get(module_name) is not module:  # removed since
            del _bound[module_name]
            continue
        namespace = module.__dict__
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
