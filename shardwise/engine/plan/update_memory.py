"""What the optimizer's update allocates beyond its inputs, predicted on meta tensors.

The update runs once on meta copies of a rank's parameters, gradients and optimizer state (shapes
and dtypes flow, no arithmetic is done) while a dispatch mode follows every storage an op makes:
its bytes count from the op that makes it until the last tensor on it is gone. The figure is the
most those hold at once: an out-of-place update's new parameters and state (they live beside the
old ones until the update returns) and its temporaries (a weight decay's ``g + wd * p`` over every
leaf at once, Adam's denominators).
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..torch_api import storage_key

__all__ = ["predict_update_bytes"]


class _NewStorages(TorchDispatchMode):
    """Bytes of the storages made under it that are still alive: now and at most."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.live = 0
        self.peak = 0

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.known.discard(key)  # the address may be reused by a later storage

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or storage_key(t) in self.known:
                continue  # an in-place op's result, or a view of a storage already counted
            key, nbytes = storage_key(t), t.untyped_storage().nbytes()
            self.known.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key, nbytes)
        return out


def _stand_in(t: Any) -> Any:
    """A meta copy of a tensor; a scalar (the update count, read as a number) real, at 1: a step
    after the first, the steady state (SGD's first update starts its momentum from a copy instead)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dim() == 0:
        return torch.ones((), dtype=t.dtype)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def predict_update_bytes(update: Any, params: Any, grads: Any, state: Any) -> int:
    """The most memory ``update(grads, state, params)`` holds at once beyond its inputs (given as
    meta or real tensors, left untouched): see the module docstring."""
    mp, mg, ms = (optree.tree_map(_stand_in, tree) for tree in (params, grads, state))
    leaves: list[Any] = [*optree.tree_leaves(mp), *optree.tree_leaves(mg), *optree.tree_leaves(ms)]
    known = {storage_key(t) for t in leaves if isinstance(t, torch.Tensor)}
    tracker = _NewStorages(known)
    with tracker:
        result = update(mg, ms, mp)
    del result
    return tracker.peak
