"""Where a model computes its values in a coarser dtype than its parameters: a float64 model whose RMSNorm
upcasts to float32 (Gemma's ``self._norm(x.float()) * (1.0 + self.weight.float())``, Mamba's
``self.A_log.float()``). A sum over the batch and a sum over its parts (ranks, micro-batches) then round apart
at float32's precision, not float64's, and an optimizer's update carries that on (Adam scales a small gradient
up to the learning rate): :func:`~shardwise.testing.assert_equivalent` at float64's tolerance fails on a correct
step. Found by running the reference's layers once on the first batch and following the values computed from
the parameters and the batch's floating tensors (not the ones computed from positions alone, a rotary
embedding's float32 table) until one is in a coarser dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine.model import host_random


class _Follow(TorchDispatchMode):
    """Marks each op's results computed from a marked tensor; notes the first in a coarser dtype than ``finer``."""

    def __init__(self, finer: torch.dtype, seeds: Sequence[Tensor]) -> None:
        super().__init__()
        self.eps = torch.finfo(finer).eps
        self.marked: dict[int, weakref.ref[Tensor]] = {}
        self.found: tuple[str, torch.dtype] | None = None
        for t in seeds:
            self._mark(t)

    def _mark(self, t: Tensor) -> None:
        self.marked[id(t)] = weakref.ref(t)

    def _is_marked(self, t: Tensor) -> bool:
        ref = self.marked.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given: Any = (args, kwargs or {})
        marked = [t for t in optree.tree_leaves(given) if isinstance(t, Tensor) and self._is_marked(t)]
        if self.found is None and marked:
            # A cast from a finer float to a coarser one rounds; one from an exact value (a bool mask) does not.
            finest = min((torch.finfo(t.dtype).eps for t in marked if t.is_floating_point()), default=None)
            for t in optree.tree_leaves(out):
                if isinstance(t, Tensor):
                    self._mark(t)
                    if t.is_floating_point() and finest is not None and torch.finfo(t.dtype).eps > finest and \
                            torch.finfo(t.dtype).eps > self.eps:
                        self.found = (str(func.overloadpacket.__name__), t.dtype)
        return out


def coarser_compute(step: Any, params: Any, batch: Any) -> tuple[str, str, torch.dtype] | None:
    """(layer name, op, dtype) of the first value ``step``'s model computes from its parameters or the batch
    in a coarser dtype than the parameters', on ``batch``'s inputs; None if there is none or it cannot tell."""
    chain = getattr(step, "base_chain", None)
    if chain is None or not (isinstance(batch, tuple | list) and len(batch) == 2):
        return None
    floats = [t for t in optree.tree_leaves(params) if isinstance(t, Tensor) and t.is_floating_point()]
    if not floats:
        return None
    finer = max((t.dtype for t in floats), key=lambda d: -torch.finfo(d).eps)
    seeds = floats + [t for t in optree.tree_leaves(batch[0]) if isinstance(t, Tensor) and t.is_floating_point()]
    x = batch[0]
    try:
        with torch.no_grad(), torch.random.fork_rng(), host_random.kept(), _Follow(finer, seeds) as follow:
            for layer in chain:
                x = layer(chain.layer_params(params, layer), x)
                if follow.found is not None:
                    return layer.name, *follow.found
    except Exception:  # a hint only: a model that cannot run here is judged as it is
        return None
    return None
