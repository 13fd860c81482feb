"""The one place that touches torch's checkpoint machinery.

Everything torch-version-specific about remat lives here: non-reentrant
``torch.utils.checkpoint.checkpoint``, the experimental selective-checkpoint
API (``create_selective_checkpoint_contexts``, ``CheckpointPolicy``,
``SelectiveCheckpointContext.op_output``) and saved-tensor hooks. Remat
policies stay plain predicates ``policy(op, *args, **kwargs) -> bool``;
:func:`sac_policy_fn` adapts one to torch. ``tests/transforms/remat`` checks
every assumption made here, so a torch upgrade that changes them fails loudly.

Assumptions (torch 2.13):

* non-reentrant checkpoint keeps the tensor positional arguments through
  autograd's saved-tensor machinery, so *outer* saved-tensor hooks see them
  (and can offload or measure them), while ops inside the region are packed
  by checkpoint's own hooks as placeholders that hold no memory;
* selective checkpoint calls ``policy_fn(ctx, op, *args, **kwargs)`` once per
  op in forward, after the op ran, with its output in ``ctx.op_output``; it
  caches the outputs of ops answered ``MUST_SAVE`` outside autograd, in a
  ``storage`` mapping (op -> invocation index -> entry) shared by the two
  modes that ``create_selective_checkpoint_contexts`` returns.

torch marks a cache entry consumed once a recomputation has used it, so a
region can be backpropagated only once. A zero-bubble pipeline schedule
computes input and weight gradients in two backward calls, each of which
recomputes the region; :func:`selective_contexts` therefore gives both modes a
storage whose entries, once written in forward, are never overwritten. The
cache then lives as long as the region's autograd graph (until the layer's
last backward) instead of being dropped entry by entry.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ...engine._storage import storage_key as engine_storage_key
from ...engine.accounting import current_observer
from .policies import EverythingSaveable, NothingSaveable, OffloadToCpu

Observer = Callable[[torch.Tensor], None]
Predicate = Callable[..., Any]

def storage_key(t: torch.Tensor) -> Any:
    """Identifies the memory a tensor lives in (the engine's key, which also tells meta storages apart)."""
    return engine_storage_key(t)


class _WriteOnce(dict[Any, Any]):
    """One op's cache entries: the forward writes each once; the 'consumed' mark is ignored."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self:
            super().__setitem__(key, value)


def selective_contexts(policy_fn: Callable[..., CheckpointPolicy]) -> tuple[Any, Any]:
    """``create_selective_checkpoint_contexts(policy_fn)`` whose cache survives repeated backward calls."""
    caching, cached = create_selective_checkpoint_contexts(policy_fn)
    storage: defaultdict[Any, _WriteOnce] = defaultdict(_WriteOnce)
    caching.storage = cached.storage = storage
    return caching, cached


def sac_policy_fn(predicate: Predicate, observe: Observer | None = None) -> Callable[..., CheckpointPolicy]:
    """Adapt ``predicate(op, *args, **kwargs) -> bool`` to torch's selective-checkpoint policy_fn."""

    def policy_fn(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        save = predicate(op, *args, **kwargs)
        if not isinstance(save, bool):
            # Not a TypeError: torch turns a TypeError raised inside an operator like `@` into NotImplemented.
            raise ValueError(
                f"remat policy {predicate!r} returned {save!r} for {op}; a policy answers True (save) or False (recompute)"
            )
        if save and observe is not None:
            for t in optree.tree_leaves(ctx.op_output):
                if isinstance(t, torch.Tensor):
                    observe(t)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy_fn


class _KeepForBackward(saved_tensors_hooks):
    """Saved-tensor hooks: show each saved tensor to ``observer``; optionally move it to the CPU.

    Tensors whose storage is in ``stay`` (the layer's parameters and buffers,
    which live on regardless) and tensors already on the CPU are never moved.
    """

    def __init__(self, observer: Observer | None, *, offload: bool, pin_memory: bool, stay: frozenset[Any]) -> None:
        def pack(t: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
            if observer is not None:
                observer(t)
            if not offload or t.device.type == "cpu" or storage_key(t) in stay:
                return None, t
            pin = pin_memory and torch.cuda.is_available() and not t.is_sparse
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return t.device, host

        def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
            device, t = packed
            return t if device is None else t.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


def run_layer(fn: Callable[[Any, Any], Any], tensors: Mapping[str, torch.Tensor], x: Any, policy: Predicate) -> Any:
    """``fn(tensors, x)`` with backward recomputing what ``policy`` does not save.

    ``everything_saveable`` runs ``fn`` as it is (torch's selective checkpoint
    with every op saved would cache more than autograd keeps), and
    ``nothing_saveable`` is plain non-reentrant checkpoint; any other
    predicate goes through selective checkpoint. The region's tensors are
    passed to checkpoint as flat positional arguments so that they are the
    saved inputs that outer hooks see.
    """
    observe = current_observer()  # set while the engine's accounting measures what layers keep
    offload = isinstance(policy, OffloadToCpu)
    inner = policy.policy if isinstance(policy, OffloadToCpu) else policy
    hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if offload or observe is not None:
        stay = frozenset(storage_key(t) for t in tensors.values() if isinstance(t, torch.Tensor))
        pin = policy.pin_memory if isinstance(policy, OffloadToCpu) else False
        hooks = _KeepForBackward(observe, offload=offload, pin_memory=pin, stay=stay)
    with hooks:
        if isinstance(inner, EverythingSaveable):
            return fn(dict(tensors), x)
        region_args: Any = (dict(tensors), x)
        leaves, spec = optree.tree_flatten(region_args, none_is_leaf=True)

        def region(*flat: Any) -> Any:
            region_tensors, region_x = optree.tree_unflatten(spec, list(flat))
            return fn(region_tensors, region_x)

        if isinstance(inner, NothingSaveable):
            return checkpoint(region, *leaves, use_reentrant=False)
        context_fn = functools.partial(selective_contexts, sac_policy_fn(inner, observe))
        return checkpoint(region, *leaves, use_reentrant=False, context_fn=context_fn)
