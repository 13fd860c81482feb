"""Remat's save policies (``jax.checkpoint_policies``) and the names they can keep.

``sw.remat(step, policy=sw.policies.dots_saveable)`` recomputes in the backward
what the policy does not save: ``nothing_saveable`` (recompute everything),
``everything_saveable``, ``dots_saveable`` (keep matmul outputs),
``save_only_these_names(*names)`` (keep what ``checkpoint_name(x, name)`` tagged),
``offload_to_cpu``. ``saved_bytes(step, params, batch)`` measures what each layer
keeps for its backward under a step's policy.

>>> import torch, shardwise as sw
>>> keep_attention = sw.policies.save_only_these_names("attn_out")
>>> x = sw.policies.checkpoint_name(torch.ones(2), "attn_out")   # tags x; equal to it
>>> keep_attention.names, torch.equal(x, torch.ones(2))
(frozenset({'attn_out'}), True)
"""

from .transforms.remat import (
    DotsSaveable,
    EverythingSaveable,
    NothingSaveable,
    OffloadToCpu,
    SaveOnlyTheseNames,
    checkpoint_name,
    dots_saveable,
    everything_saveable,
    nothing_saveable,
    offload_to_cpu,
    save_only_these_names,
    saved_bytes,
)

__all__ = [
    "DotsSaveable",
    "EverythingSaveable",
    "NothingSaveable",
    "OffloadToCpu",
    "SaveOnlyTheseNames",
    "checkpoint_name",
    "dots_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload_to_cpu",
    "save_only_these_names",
    "saved_bytes",
]
