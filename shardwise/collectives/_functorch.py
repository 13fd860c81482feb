"""torch.func's tensor wrappers, the one private torch API the collectives touch.

A collective must hand plain tensors to its backend: under ``torch.func.grad``
the caller's tensors are wrappers that belong to the calling thread's
transform stack, and the threads backend computes results on another rank's
thread. ``tests/collectives/test_functorch_private.py`` fails loudly if torch
changes these functions.
"""

from __future__ import annotations

import torch
from torch._C import _functorch


def unwrap(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under any torch.func wrappers (vmap's batched tensors are refused)."""
    while _functorch.is_functorch_wrapped_tensor(x):
        if _functorch.is_batchedtensor(x):
            raise NotImplementedError("shardwise collectives do not support torch.func.vmap")
        x = _functorch.get_unwrapped(x)
    return x
