"""A loss that reads the parameters of the model given to ``functionalize``: refused (``model/given_params.py``).

The first call of each ``loss_fn`` (per process) runs under a TorchFunctionMode that looks at every op's tensor
arguments; one that is a trainable parameter of a module given to functionalize is refused, naming it: the step
trains its own copies, and a term of the given module's parameters is a constant of their initial values.
Later calls cost one dict lookup.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..model.given_params import any_given, given

_WATCHED: set[int] = set()  # id of each loss_fn watched once (a later function of the same id goes unwatched)
_LOCK = threading.Lock()


class _GivenReads(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves: list[Any] = optree.tree_leaves((args, kwargs or {}), none_is_leaf=False)  # type: ignore[arg-type]
        for t in leaves:
            found = given(t) if isinstance(t, torch.Tensor) else None
            if found is not None:
                name, model = found
                raise ValueError(
                    f"loss_fn reads {name!r}, a parameter of the {model} given to functionalize: the step trains its "
                    "state's copies of the parameters, and that module keeps its initial values, so a term of them "
                    "(a weight penalty) is a constant that trains nothing. Use the optimizer's weight decay "
                    "(sw.optim.adamw(..., weight_decay=...), sgd(weight_decay=...)), or compute the term in the "
                    "model's forward and return it with the output, for loss_fn to add"
                )
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watching_given_reads(loss_fn: Callable[..., Any]) -> Iterator[None]:
    """The first call of ``loss_fn`` watched for reads of a given module's parameters; later ones not."""
    key = id(loss_fn)
    if key in _WATCHED or not any_given():
        yield
        return
    with _LOCK:
        _WATCHED.add(key)
    with _GivenReads():
        yield
