"""The user's ``init_fn`` for a meta-built module: its two accepted forms, and the model's own init
methods that a meta build would not run by itself.

``init_fn(module)`` is applied as ``model.apply(init_fn)`` would apply it. ``init_fn(module, path)``
also gets the module's path in the model (``""`` for the model itself), so a rule a constructor
states by name after ``apply`` can be replayed: nanoGPT's
``for pn, p in self.named_parameters(): if pn.endswith('c_proj.weight'): normal_(p, ...)``
becomes ``if path.endswith("c_proj"): normal_(module.weight, ...)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

InitFn = Callable[[nn.Module], Any] | Callable[[nn.Module, str], Any]
PathInit = Callable[[nn.Module, str], Any]

# Methods by which models initialize themselves (nanoGPT's and minGPT's _init_weights, torchtitan's
# and timm's init_weights); torch.nn's own modules define none of them.
OWN_INIT_METHODS = ("init_weights", "_init_weights")

__all__ = ["OWN_INIT_METHODS", "InitFn", "PathInit", "as_path_init", "own_init_methods"]


def as_path_init(init_fn: InitFn) -> PathInit:
    """``init_fn`` called as ``fn(module, path)``: one that takes two positional arguments without
    defaults gets the path, any other is called as ``fn(module)`` (the original form: a bound
    ``model._init_weights``, an ``fn(module, std=0.02)``). Refuses one that needs more."""
    required = _required_positional(init_fn)
    if required is None or required <= 1:
        return lambda module, path: init_fn(module)  # type: ignore[call-arg]
    if required == 2:
        return init_fn  # type: ignore[return-value]
    raise TypeError(
        f"functionalize(init_fn=...): {getattr(init_fn, '__qualname__', repr(init_fn))} needs {required} "
        "positional arguments; it is called as fn(module), or as fn(module, path) with the module's path "
        "in the model ('' for the model itself). Give the others defaults or bind them "
        "(functools.partial)."
    )


def _required_positional(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments ``fn`` needs; None where its signature cannot be read (a
    builtin), which is then called the original way."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty)


def own_init_methods(model: nn.Module, skip: frozenset[int] | set[int] = frozenset()) -> list[str]:
    """``Class.method`` for each init method (``OWN_INIT_METHODS``) that a module class of ``model``
    defines: the model's own init code, which a meta build runs only through an ``init_fn``. ``skip``: the
    ids of modules not to ask (those a wrapped transformers model initializes itself)."""
    found: dict[str, None] = {}
    for module in model.modules():
        if id(module) in skip:
            continue
        for cls in type(module).__mro__:
            if cls.__module__.startswith("torch."):
                continue
            for name in OWN_INIT_METHODS:
                if callable(cls.__dict__.get(name)):
                    found[f"{cls.__qualname__}.{name}"] = None
    return list(found)
