"""The engine's stand-ins for Python's and numpy's calls that read an int subclass in C (engine/stack/host_calls.py):
a registered marked number reaches its judge with the caller's module, the call and its kind; plain numbers and
other threads' calls pass; the originals are back after."""

from __future__ import annotations

import itertools
import math
import operator
import threading
from typing import Any

import numpy as np

from shardwise.engine.stack.host_calls import calls_watched, register


class _Marked(int):
    pass


_seen: list[tuple[str, str, str]] = []


def _judge(number: Any, caller: str, call: str, kind: str) -> None:
    _seen.append((caller, call, kind))


register((_Marked,), _judge)


def test_a_marked_number_reaches_its_judge_naming_the_caller_the_call_and_its_kind() -> None:
    n = _Marked(4)
    originals = (range, itertools.islice, itertools.repeat, enumerate, operator.index, math.sqrt, np.linspace)
    _seen.clear()
    with calls_watched():
        assert list(range(n)) == [0, 1, 2, 3] and isinstance(range(2), range)
        assert list(itertools.islice(itertools.count(), n)) == [0, 1, 2, 3]
        assert list(itertools.repeat(n, 2)) == [4, 4]  # the number repeated, not a count of it: not judged
        assert list(enumerate("ab", start=n)) == [(4, "a"), (5, "b")] and isinstance(enumerate([]), enumerate)
        assert list(enumerate([n])) == [(0, 4)]  # the number inside what is enumerated: not judged
        assert enumerate[int] == type(enumerate([]))[int]  # (a type hint of the original)
        assert operator.index(n) == 4 and type(operator.index(n)) is int  # (an exact int since Python 3.10)
        assert math.sqrt(n) == 2.0 and math.ceil(n) == 4  # (ceil keeps a mark: no stand-in)
        assert np.linspace(0, 1, n).shape == (4,) and np.zeros((2, n)).shape == (2, 4)
        assert math.sqrt(4) == 2.0 and list(range(2)) == [0, 1]  # plain numbers: nothing judged
    # numpy's linspace takes operator.index of its count in Python: judged too, naming numpy's module as the caller
    assert any(caller.startswith("numpy.") and call == "operator.index" for caller, call, _ in _seen)
    assert [seen for seen in _seen if seen[0] == __name__] == [
        (__name__, "range()", "range"), (__name__, "itertools.islice()", "islice"),
        (__name__, "enumerate()", "enumerate"), (__name__, "operator.index", "operator"),
        (__name__, "operator.index", "operator"), (__name__, "math.sqrt", "math"),
        (__name__, "numpy.linspace", "numpy"), (__name__, "numpy.zeros", "numpy")]
    assert (range, itertools.islice, itertools.repeat, enumerate, operator.index, math.sqrt, np.linspace) == originals


def test_the_stand_ins_stand_while_any_thread_is_inside_and_go_when_the_last_leaves() -> None:
    inside, leave = threading.Event(), threading.Event()

    def watch() -> None:
        with calls_watched():
            inside.set()
            leave.wait(timeout=10)

    other = threading.Thread(target=watch)
    other.start()
    try:
        assert inside.wait(timeout=10)
        assert hasattr(math.sqrt, "__wrapped__")  # a stand-in, seen from this thread
        with calls_watched():
            pass
        assert hasattr(math.sqrt, "__wrapped__")  # still standing: the other thread is inside
    finally:
        leave.set()
        other.join(timeout=10)
    assert not hasattr(math.sqrt, "__wrapped__")


def test_a_module_imported_after_a_watch_or_replaced_since_has_its_bindings_watched_at_the_next() -> None:
    """A model's module's own binding (``from math import sqrt``) stands in while watched, also for a module that
    came after the watches before (each module is scanned once), and for one replaced in ``sys.modules`` since."""
    import sys
    import types

    with calls_watched():
        pass
    for attempt in range(2):  # the first module, then another one in its place
        module = types.ModuleType("a_model_module_of_the_test")
        module.sqrt = math.sqrt  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module
        try:
            with calls_watched():
                assert module.sqrt is math.sqrt and hasattr(module.sqrt, "__wrapped__"), attempt  # type: ignore
            assert module.sqrt is math.sqrt and not hasattr(math.sqrt, "__wrapped__")  # type: ignore[attr-defined]
        finally:
            del sys.modules[module.__name__]


def test_a_module_still_being_imported_at_a_watch_has_its_bindings_watched_at_the_next_with_nothing_new() -> None:
    """A module in ``sys.modules`` mid-import at a watch (its spec's ``_initializing``) binds ``sqrt`` afterwards:
    the next watch scans it again, though ``sys.modules`` has not changed since (a watch skips its scan only
    where the modules are those of a scan that left none mid-import)."""
    import importlib.machinery
    import sys
    import types

    module = types.ModuleType("a_model_module_being_imported")
    module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    module.__spec__._initializing = True  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        with calls_watched():
            pass
        module.sqrt = math.sqrt  # type: ignore[attr-defined]
        module.__spec__._initializing = False  # type: ignore[attr-defined]
        with calls_watched():
            assert hasattr(module.sqrt, "__wrapped__")  # type: ignore[attr-defined]
        with calls_watched():  # and at a watch after, with nothing new since either
            assert hasattr(module.sqrt, "__wrapped__")  # type: ignore[attr-defined]
        assert not hasattr(module.sqrt, "__wrapped__")  # type: ignore[attr-defined]
    finally:
        del sys.modules[module.__name__]


def test_a_module_replaced_by_an_equal_object_or_at_a_freed_ones_address_is_scanned_again() -> None:
    """A watch skips its scan where ``sys.modules`` holds what it held at the last one: the same objects, not equal
    ones (a namespace replaced by a copy of it binds ``sqrt`` in the copy), and not a module made at the address of
    one freed since (the record holds the modules it scanned to the next scan, so none is freed before); a module
    removed is let go of at the next watch."""
    import gc
    import sys
    import types
    import weakref

    class Namespace(types.SimpleNamespace):  # (compares by value, as SimpleNamespace; weakly referable)
        pass

    name = "a_model_namespace_of_the_test"
    sys.modules[name] = Namespace(sqrt=math.sqrt)
    try:
        with calls_watched():
            assert hasattr(sys.modules[name].sqrt, "__wrapped__")
        copy = Namespace(sqrt=math.sqrt)
        assert copy == sys.modules[name] and copy is not sys.modules[name]
        sys.modules[name] = copy
        with calls_watched():
            assert hasattr(copy.sqrt, "__wrapped__")
    finally:
        del sys.modules[name]
    del copy
    from shardwise.engine.stack import host_calls

    # A module binding nothing watched, removed and replaced by one binding sqrt: with no watch between (the old
    # one held by the record), and with one (the old one freed before the new one is made, and forgotten).
    for watch_between in (False, True):
        for attempt in range(5):
            old = types.ModuleType(name)
            sys.modules[name] = old
            with calls_watched():
                pass
            gone = weakref.ref(old)
            del old, sys.modules[name]
            if watch_between:
                with calls_watched():
                    pass
                assert name not in host_calls._scanned  # forgotten with it: a module made at its address is scanned
            new = types.ModuleType(name)
            new.sqrt = math.sqrt  # type: ignore[attr-defined]
            sys.modules[name] = new
            try:
                with calls_watched():
                    assert hasattr(new.sqrt, "__wrapped__"), (watch_between, attempt)  # type: ignore[attr-defined]
            finally:
                del sys.modules[name], new
            gc.collect()
            assert gone() is None  # let go of by the watch after its removal
