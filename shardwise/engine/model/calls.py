"""Whether a module's own forward calls one of given functions, read from its code without running it.

A split transform replaces the modules it knows; a module of a user's own that already calls the
split's distributed core (ring attention, the MoE dispatch) is split as written, and the transform
must tell it apart from one that computes over its rank's part alone, before any input exists. The
forward's code names what it calls: a global (``ring_attention(...)``, also under another name, as
``from m import ring_attention as ra``), an attribute of a module global (``cp.ring_attention(...)``)
or a variable of an enclosing function (a forward made in a closure). Each is resolved to the object
itself and compared by identity, so a function of the same name from elsewhere does not count.

What it cannot see: a call made by a helper the forward calls (the helper's own code is not read), or
a function fetched at run time (``getattr(m, name)``). Such a module is treated as not calling them.

>>> import math, torch
>>> class Scaled(torch.nn.Module):
...     def forward(self, x):
...         return math.sqrt(x)
>>> forward_calls(Scaled(), (math.sqrt,)), forward_calls(Scaled(), (math.exp,))
(True, False)
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Collection, Iterator
from typing import Any

from torch import nn


def forward_calls(module: nn.Module, functions: Collection[Callable[..., Any]]) -> bool:
    """Whether the forward of ``module``'s class names one of ``functions`` (see the module docstring)."""
    wanted = {id(f) for f in functions}
    return forward_uses(module, lambda obj: id(obj) in wanted)


def forward_uses(module: nn.Module, test: Callable[[Any], bool]) -> bool:
    """Whether the forward of ``module``'s class names an object for which ``test`` holds (an instance of a
    dispatch table's class, as transformers' ``ALL_ATTENTION_FUNCTIONS``)."""
    forward = inspect.unwrap(getattr(type(module), "forward", None) or (lambda: None))
    if not isinstance(forward, types.FunctionType):
        return False
    return any(test(obj) for obj in _named_objects(forward))


def _named_objects(fn: types.FunctionType) -> Iterator[Any]:
    """Every object ``fn``'s code (and the code nested in it: comprehensions, lambdas) names: its globals,
    their attributes the code reads, and its closure's variables."""
    names = set(_names(fn.__code__))
    scope = dict(fn.__globals__)
    scope.update(zip(fn.__code__.co_freevars, (_cell(c) for c in fn.__closure__ or ()), strict=True))
    for name in names:
        obj = scope.get(name)
        if obj is None:
            continue
        yield obj
        if isinstance(obj, types.ModuleType):  # m.ring_attention: the attribute is among the names too
            for attribute in names:
                yield getattr(obj, attribute, None)


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    yield from code.co_freevars
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return None
