"""The optimizer state's containers, recorded by ``save``, so that ``load`` can rebuild a state nothing predicts.

``load`` reads a checkpoint into an optimizer state it builds empty (``load_state._template``): what the step's
optimizer's ``init`` makes, or what one of its updates makes of that on meta tensors. A user's optimizer that
makes its state at its first update, and whose update reads a value (``.item()``, ``if g.abs().max() > 0``),
has neither: its update cannot run on meta tensors. So ``save`` records the state's containers, and ``load``
rebuilds from that record where the optimizer's own state is not predicted (the step then confirms the loaded
state by what its first update makes of it, as for a pickled one: ``step/state_check.py``).

The record is JSON, one list per node:

- ``["none"]``; ``["mirror"]``: a subtree shaped like the tree the optimizer updates (a momentum: its tensors are
  saved per parameter, resharded on load; their dtypes are the checkpoint's record of them); ``["scalar"]``: any
  other tensor (a step count), saved whole, its shape and dtype in the checkpoint's record too;
- ``["dict", keys, children]`` (``str`` or ``int`` keys, in order), ``["list", children]``,
  ``["tuple", children]``, ``["namedtuple", module, qualname, fields, children]``;
- ``["other", "module.qualname"]``: any other container (an ``OrderedDict``, a ``list`` subclass), recorded so
  that ``load`` refuses it naming its type rather than rebuild it as another.

A NamedTuple's class is looked up among the modules already imported (the optimizer's own module is: the
step was built from it), never imported by a name a file carries, and must have the recorded fields.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .cut import is_mirror
from .file_format import CheckpointError, dtype_of

Record = list[Any]


def record_structure(opt_state: Any, like: Any) -> Record:
    """The record of ``opt_state``'s containers (see the module's docstring); ``like`` is the tree the
    optimizer updates, which a mirror is shaped like (as ``cut.split_opt_state`` tells them)."""

    def node(value: Any, root: bool) -> Record:
        if value is None:
            return ["none"]
        if not root and is_mirror(value, like):
            return ["mirror"]
        if isinstance(value, torch.Tensor):
            return ["scalar"]
        kind = type(value)
        if kind is dict and all(type(k) in (str, int) for k in value):
            return ["dict", list(value), [node(v, False) for v in value.values()]]
        if kind is list or kind is tuple:
            return [kind.__name__, [node(v, False) for v in value]]
        if isinstance(value, tuple) and kind.__bases__ == (tuple,) and hasattr(kind, "_fields"):
            return ["namedtuple", kind.__module__, kind.__qualname__, list(kind._fields),
                    [node(v, False) for v in value]]
        return ["other", f"{kind.__module__}.{kind.__qualname__}"]

    return node(opt_state, True)


def update_name(optimizer: Any) -> str:
    """The name of ``optimizer``'s update (its function's, or its callable's class): a record is rebuilt only for
    the optimizer whose update saved it (a state of another one would reach this one's update unchecked)."""
    update = getattr(optimizer, "update", optimizer)
    named = update if inspect.isfunction(update) or inspect.ismethod(update) else type(update)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', type(named).__name__)}"


def record_digest(record: Record) -> str:
    """A short text that differs where two records do (the ranks compare theirs at save)."""
    return hashlib.sha256(json.dumps(record).encode()).hexdigest()


def template_from_record(record: Record, mirror_like: Callable[[str], Any],
                         scalar_like: Callable[[str], torch.Tensor], where: str) -> Any:
    """The optimizer state ``record`` describes, its mirrors ``mirror_like(path)`` and its other tensors
    ``scalar_like(path)`` (meta tensors), each by its path as ``cut.split_opt_state`` names it; ``where``
    names the checkpoint in a refusal."""

    def build(node: Record, path: str) -> Any:
        kind = node[0]
        if kind == "none":
            return None
        if kind == "mirror":
            return mirror_like(path)
        if kind == "scalar":
            return scalar_like(path)
        if kind == "dict":
            return {k: build(child, _join(path, str(k))) for k, child in zip(node[1], node[2], strict=True)}
        if kind in ("list", "tuple"):
            values = [build(child, _join(path, str(i))) for i, child in enumerate(node[1])]
            return values if kind == "list" else tuple(values)
        if kind == "namedtuple":
            _, module, qualname, fields, children = node
            cls = _named_tuple(module, qualname, fields, path, where)
            return cls(*(build(child, _join(path, f)) for f, child in zip(fields, children, strict=True)))
        if kind == "other":
            raise CheckpointError(
                f"{where}: its optimizer state's {path or '<root>'} is a {node[1]}, a container load cannot "
                "rebuild (it rebuilds dicts, lists, tuples and NamedTuples of tensors); this optimizer's state is "
                "known only from the record save made of it, as its update reads values and cannot be predicted. "
                "Keep the optimizer's state in those containers, or make its whole state in its init"
            )
        raise CheckpointError(f"{where}: its record of the optimizer state has an unknown node {node!r}")

    return build(record, "")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _named_tuple(module: str, qualname: str, fields: list[str], path: str, where: str) -> type:
    """The NamedTuple class ``module.qualname`` among the imported modules, with ``fields``."""
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    name = f"{module}.{qualname}({', '.join(fields)})"
    if found is None or "<locals>" in qualname:
        raise CheckpointError(
            f"{where}: its optimizer state's {path or '<root>'} is a {name}, which cannot be found: "
            + ("a class defined inside a function cannot be looked up by its name; define it at a module's top "
               "level" if "<locals>" in qualname else
               f"load never imports a module a checkpoint names; import {module} before loading")
        )
    if not (isinstance(found, type) and issubclass(found, tuple) and list(getattr(found, "_fields", ())) == fields):
        have = list(getattr(found, "_fields", ())) if isinstance(found, type) else type(found).__name__
        raise CheckpointError(
            f"{where}: its optimizer state's {path or '<root>'} is a {name}, but {module}.{qualname} is now "
            f"{have}: not the state that was saved. Load it with the optimizer that saved it"
        )
    return found


def mirror_dtypes(saved: Mapping[str, Any], path: str, keys: list[str], where: str) -> torch.dtype:
    """The one dtype the checkpoint records for mirror ``path``'s tensors of the parameters ``keys`` (its saved
    names): what one tensor the rank keeps of them (a slice, or a ZeRO unit's flat shard) is read as."""
    names = {saved.get(f"optim.{path}.{key}", {}).get("dtype") for key in keys}
    if None in names:
        raise CheckpointError(f"{where}: its optimizer state's {path} of {keys} is missing from its tensors")
    if len(names) != 1:
        raise CheckpointError(
            f"{where}: its optimizer state's {path} holds {sorted(names)} for the parameters {keys}, which this "
            "rank keeps as one flat ZeRO shard of one dtype; load it under the layout that saved it"
        )
    return dtype_of(names.pop(), f"{where}: optim.{path}")
