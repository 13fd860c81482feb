"""The trainable parameters of the module given to ``functionalize``, which no step trains.

A step trains its state's copies of a model's parameters (``step.init`` copies them); the module the user
built keeps its initial values, and nothing flows into it. A loss that reads them with gradients on (a weight
penalty written as ``lam * sum(p.pow(2).sum() for p in model.parameters())``, as many training loops write it)
computes a constant of the initial weights, and the step trained without the penalty, on one device too (the
review: 1e-2 in the loss, 3e-2 in a weight after three steps), without an error. ``functionalize`` notes each
chain's module's parameters here (weakly: a module or chain dropped is forgotten); ``run/loss_reads.py`` refuses a
loss of a step of that chain that reads one. Another model's (a teacher given to functionalize for a step of its
own) is not this step's, and a read under ``torch.no_grad()`` (a reference model, on purpose) computes no gradient.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Mapping

from torch import Tensor, nn

# id of a chain -> (the chain, weakly; id of each trainable parameter of its module -> (the parameter, its name,
# its model's class))
Given = Mapping[int, tuple[weakref.ref[Tensor], str, str]]
_BY_CHAIN: dict[int, tuple[weakref.ref[object], Given]] = {}
_LOCK = threading.Lock()


def remember(chain: object, module: nn.Module) -> None:
    """Note ``module``'s trainable parameters as ``chain``'s (of a model built with values: a meta one holds none)."""
    given: dict[int, tuple[weakref.ref[Tensor], str, str]] = {
        id(p): (weakref.ref(p), name, type(module).__name__)
        for name, p in module.named_parameters() if p.requires_grad and not p.is_meta}
    if not given:
        return
    key = id(chain)
    with _LOCK:
        _BY_CHAIN[key] = (weakref.ref(chain, functools.partial(_forget, key)), given)


def _forget(key: int, _: object = None) -> None:
    with _LOCK:
        _BY_CHAIN.pop(key, None)


def given_of(chain: object) -> Given | None:
    """The parameters of the module ``chain`` was made from, or None (a meta build, a chain built by hand)."""
    found = _BY_CHAIN.get(id(chain))
    if found is None or found[0]() is not chain:
        return None
    return found[1]


def given_name(given: Given, t: Tensor) -> tuple[str, str] | None:
    """``(name, model class)`` where ``t`` is one of ``given``'s parameters, else None."""
    found = given.get(id(t))
    if found is None or found[0]() is not t:
        return None
    return found[1], found[2]
