"""A loss that reads the parameters of the module its step's chain was made from: refused (``model/given_params.py``).

The first call of each ``loss_fn`` (once per process, on a step whose chain knows its module) runs under a
TorchFunctionMode that looks at every op's tensor arguments; an op that reads the values of one of those
parameters (not its shape, dtype or device: ``labels.to(model.device)`` is no read) with gradients on is refused,
naming it: the step trains its own copies, and a term of the given module's parameters is a constant of their
initial values. Later calls cost a lookup.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..model.given_params import Given, given_name
from ..model.tensor_reads import reads_values

# Each loss_fn watched once (weakly where it can be; else by id, where a later function of a reused id goes
# unwatched: a gap)
_WATCHED: weakref.WeakKeyDictionary[Any, None] = weakref.WeakKeyDictionary()
_WATCHED_IDS: set[int] = set()
_LOCK = threading.Lock()


class _GivenReads(TorchFunctionMode):
    def __init__(self, given: Given) -> None:
        super().__init__()
        self.given = given

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not torch.is_grad_enabled() or not reads_values(func, out):
            return out
        leaves: list[Any] = optree.tree_leaves((args, kwargs or {}), none_is_leaf=False)  # type: ignore[arg-type]
        for t in leaves:
            found = given_name(self.given, t) if isinstance(t, torch.Tensor) else None
            if found is not None:
                name, model = found
                raise ValueError(
                    f"loss_fn reads {name!r}, a parameter of the {model} given to functionalize: the step trains its "
                    "state's copies of the parameters, and that module keeps its initial values, so a term of them "
                    "(a weight penalty) is a constant that trains nothing. Use the optimizer's weight decay "
                    "(sw.optim.adamw(..., weight_decay=...), sgd(weight_decay=...)), or compute the term in the "
                    "model's forward and return it with the output, for loss_fn to add; a constant on purpose (a "
                    "reference model's output) is computed under torch.no_grad()"
                )
        return out


def _first_call(loss_fn: Callable[..., Any]) -> bool:
    with _LOCK:
        try:
            if loss_fn in _WATCHED:
                return False
            _WATCHED[loss_fn] = None
            return True
        except TypeError:  # (not weakly referable)
            if id(loss_fn) in _WATCHED_IDS:
                return False
            _WATCHED_IDS.add(id(loss_fn))
            return True


@contextlib.contextmanager
def watching_given_reads(loss_fn: Callable[..., Any], given: Given | None) -> Iterator[None]:
    """The first call of ``loss_fn`` watched for value reads of ``given`` (its step's module's parameters)."""
    if not given or not _first_call(loss_fn):
        yield
        return
    with _GivenReads(given):
        yield
