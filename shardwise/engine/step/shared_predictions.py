"""A pipeline's stage boundaries predicted once per process for what decides them, shared by the ranks there.

Every rank of a pipeline predicts the boundaries of every stage (``stage_boundaries``: the chain run on fake
tensors), and ``Step.plan`` predicts them per rank class. What they are follows from the chain, its stages, the
local shapes and compute dtypes of its parameters, the micro-batch's structure and leaves (shapes, dtypes), and
the sizes of the axes a split predicts over: not from a rank's coordinates ("every rank predicts the same for the
same micro-batch", ``plan/predict.py``). Thread ranks of one process, and the step run after its Plan, each ran
the same fake run again: a Plan then a step on two thread ranks predicted three times (now once).

A key that cannot be hashed (a micro-batch leaf that is not) shares nothing: the prediction is made as before.
The chain is held weakly: a step dropped takes its predictions with it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import optree
import torch

_lock = threading.Lock()
_by_chain: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()


def prediction_key(
    stages: Any, shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]],
    dtype_of: Callable[[str, torch.dtype], torch.dtype], inputs: Any, sizes: dict[str, int] | None,
) -> Hashable | None:
    """What decides the boundaries besides the chain (see the module docstring); None where it cannot be hashed."""
    leaves, structure = optree.tree_flatten(inputs, none_is_leaf=True)
    batch = tuple((tuple(t.shape), t.dtype, t.device.type, t.requires_grad) if isinstance(t, torch.Tensor) else t
                  for t in leaves)
    params = tuple(sorted((layer, tuple(sorted((name, tuple(shape), dtype_of(layer, dtype))
                                                for name, (shape, dtype) in tensors.items())))
                          for layer, tensors in shapes.items()))
    key = (tuple(tuple(s) for s in stages), params, structure, batch, tuple(sorted((sizes or {}).items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def shared(chain: Any, key: Hashable | None, predict: Callable[[], Any]) -> Any:
    """``predict()``'s result, made once per ``chain`` and ``key`` in this process (every time where key is None)."""
    if key is None:
        return predict()
    with _lock:
        known = _by_chain.get(chain, {})
        if key in known:
            return known[key]
    made = predict()  # (outside the lock: two threads may both predict, alike)
    with _lock:
        _by_chain.setdefault(chain, {})[key] = made
    return made
