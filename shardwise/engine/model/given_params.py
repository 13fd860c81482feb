"""The trainable parameters of the modules given to ``functionalize``, which no step trains.

A step trains its state's copies of a model's parameters (``step.init`` copies them); the module the user
built keeps its initial values, and nothing flows into it. A loss that reads them (a weight penalty written as
``lam * sum(p.pow(2).sum() for p in model.parameters())``, as many training loops write it) computes a constant
of the initial weights, and the step trained without the penalty, on one device too (the review: 1e-2 in the
loss, 3e-2 in a weight after three steps), without an error. ``functionalize`` notes them here (weakly: a
module dropped is forgotten); ``run/loss_reads.py`` refuses a loss that reads one.
"""

from __future__ import annotations

import functools
import threading
import weakref

from torch import Tensor, nn

_GIVEN: dict[int, tuple[weakref.ref[Tensor], str, str]] = {}  # id -> (the parameter, its name, its model's class)
_LOCK = threading.Lock()


def remember(module: nn.Module) -> None:
    """Note ``module``'s trainable parameters (of a model built with values: a meta one holds none to read)."""
    for name, p in module.named_parameters():
        if p.requires_grad and not p.is_meta:
            key = id(p)
            with _LOCK:
                _GIVEN[key] = (weakref.ref(p, functools.partial(_forget, key)), name, type(module).__name__)


def _forget(key: int, _: object) -> None:
    with _LOCK:
        _GIVEN.pop(key, None)


def given(t: Tensor) -> tuple[str, str] | None:
    """``(name, model class)`` where ``t`` is a parameter of a module given to functionalize, else None."""
    found = _GIVEN.get(id(t))
    if found is None or found[0]() is not t:
        return None
    return found[1], found[2]


def any_given() -> bool:
    return bool(_GIVEN)
