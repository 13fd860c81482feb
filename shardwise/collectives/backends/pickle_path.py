"""Where in a task the object that will not pickle is: ``step.chain.layers[0].fn...lock``.

Pickle's own error names only the type ("cannot pickle '_thread.lock' object"), and a repr of
the task prints every tensor; descending into the parts that fail to pickle names the culprit.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Iterator
from typing import Any

_MODULE_DICTS = ("_modules", "_parameters", "_buffers")  # an nn.Module's children, by their names
_DEPTH = 40


def unpicklable(obj: Any, path: str) -> tuple[str, Any, Exception] | None:
    """The deepest part of ``obj`` that fails to pickle, as (path, object, error), or None."""
    return _search(obj, path, set(), 0)


def _search(obj: Any, path: str, seen: set[int], depth: int) -> tuple[str, Any, Exception] | None:
    try:
        pickle.dumps(obj)
    except Exception as exc:
        if depth < _DEPTH and id(obj) not in seen:
            seen.add(id(obj))
            for child_path, child in _children(obj, path):
                found = _search(child, child_path, seen, depth + 1)
                if found is not None:
                    return found
        return path, obj, exc
    return None


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, functools.partial):
        yield from _partial_children(obj, path)
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple: by field name
        yield from ((f"{path}.{f}", getattr(obj, f)) for f in obj._fields)
    elif isinstance(obj, (tuple, list)):
        yield from ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, dict):
        yield from ((f"{path}[{k!r}]", v) for k, v in obj.items())
    else:
        yield from _attribute_children(obj, path)


def _partial_children(obj: functools.partial, path: str) -> Iterator[tuple[str, Any]]:
    """A partial's arguments by the names its function gives them (``step``, not ``args[0]``)."""
    try:
        names = list(inspect.signature(obj.func).parameters)
    except (TypeError, ValueError):
        names = []
    yield f"{path}.func", obj.func
    for i, value in enumerate(obj.args):
        yield (names[i] if i < len(names) else f"{path}.args[{i}]"), value
    yield from obj.keywords.items()


def _attribute_children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        for key, value in state.items():
            if key in _MODULE_DICTS and isinstance(value, dict):
                yield from ((f"{path}.{k}", v) for k, v in value.items())
            else:
                yield f"{path}.{key}", value
    for slot in getattr(type(obj), "__slots__", ()):
        if isinstance(slot, str) and hasattr(obj, slot):
            yield f"{path}.{slot}", getattr(obj, slot)
