"""What the optimizer's update allocates beyond its inputs, predicted on fake tensors.

The update runs once on fake copies of a rank's parameters, gradients and optimizer state (shapes
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

from ..torch_api import fake_tensors, storage_key

__all__ = ["predict_update_held"]


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


def _scalar_as_int(t: Any) -> Any:
    """The update count (a 0-d integer tensor, read as a number) as the int 1: a step after the
    first, the steady state (SGD's first update starts its momentum from a copy instead). A 0-d
    floating tensor is a scalar parameter's state (a learned temperature's moments), kept a tensor:
    made an int, the optimizer's foreach ops were handed a number among its tensors and the Plan
    raised a TypeError."""
    if isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.is_floating_point() or t.is_complex()):
        return 1
    return t


def predict_update_held(
    update: Any, params: Any, grads: Any, state: Any, device: torch.device | str = "cpu", runs: Any = None,
) -> tuple[int, int]:
    """(the most memory ``update(grads, state, params)`` holds at once beyond its inputs, the bytes of
    new storages its result keeps: an out-of-place update's new parameters and state, none in place).

    The inputs are given as meta or real tensors, left untouched; the update runs on fake tensors on
    ``device`` (it groups its temporaries by device: bounded ranges on a CPU, one on an
    accelerator): see the module docstring. ``runs``: the groups' options per leaf, as the step passes
    them to a grouped optimizer's update (None: not passed)."""
    state = optree.tree_map(_scalar_as_int, state)
    with fake_tensors(device) as fake:
        fp, fg, fs = (optree.tree_map(fake, tree) for tree in (params, grads, state))
        leaves: list[Any] = [*optree.tree_leaves(fp), *optree.tree_leaves(fg), *optree.tree_leaves(fs)]
        known = {storage_key(t) for t in leaves if isinstance(t, torch.Tensor)}
        tracker = _NewStorages(known)
        with tracker:
            result = update(fg, fs, fp) if runs is None else update(fg, fs, fp, runs=runs)
        kept = tracker.live
        del result
    return tracker.peak, kept
