"""remat: activation checkpointing of a Step's layers under JAX-style save policies.

``remat(step, policy)`` rewrites the chain so that each selected layer runs
under torch's non-reentrant checkpoint with a selective-checkpoint policy:
backward recomputes whatever the policy does not save. A policy is a predicate
``policy(op, *args, **kwargs) -> bool`` over the aten ops of the layer's
forward (after ``jax.checkpoint``): :data:`nothing_saveable` (the default),
:data:`everything_saveable`, :data:`dots_saveable`,
:func:`save_only_these_names` with :func:`checkpoint_name` tags in layer
code, and :func:`offload_to_cpu`. Results are bitwise those of the step
without remat; :func:`saved_bytes` measures what each layer keeps for backward.

>>> import torch, shardwise as sw
>>> from shardwise.testing.models import TinyGPT
>>> from shardwise.transforms.remat import remat, dots_saveable, saved_bytes
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = TinyGPT(vocab=16, d_model=8, n_heads=2, n_layers=2, seq_len=4)
>>> chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
>>> loss = lambda logits, targets: torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
>>> step = sw.train_step(chain, loss, sw.optim.sgd(lr=0.1))
>>> fast = remat(step, dots_saveable, layers="blocks.*")
>>> idx = torch.randint(16, (2, 4))
>>> batch = (idx, idx.roll(-1, 1))
>>> (_, a), (_, b) = step(step.init(params), batch), fast(fast.init(params), batch)
>>> bool(a["loss"] == b["loss"])
True
>>> saved_bytes(step, params, batch)
{'tok_emb': 64, 'blocks.0': 4352, 'blocks.1': 4352, 'head': 576}
>>> saved_bytes(fast, params, batch)
{'tok_emb': 64, 'blocks.0': 2880, 'blocks.1': 2880, 'head': 576}
>>> saved_bytes(remat(step), params, batch)
{'tok_emb': 64, 'blocks.0': 256, 'blocks.1': 256, 'head': 256}
"""

from .accounting import saved_bytes
from .names import CHECKPOINT_NAME_OP, checkpoint_name
from .policies import (
    DOT_OPS,
    DotsSaveable,
    EverythingSaveable,
    NothingSaveable,
    OffloadToCpu,
    SaveOnlyTheseNames,
    dots_saveable,
    everything_saveable,
    nothing_saveable,
    offload_to_cpu,
    save_only_these_names,
)
from .rewrite import POLICIES, Remat, remat

__all__ = [
    "CHECKPOINT_NAME_OP",
    "DOT_OPS",
    "POLICIES",
    "DotsSaveable",
    "EverythingSaveable",
    "NothingSaveable",
    "OffloadToCpu",
    "Remat",
    "SaveOnlyTheseNames",
    "checkpoint_name",
    "dots_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload_to_cpu",
    "remat",
    "save_only_these_names",
    "saved_bytes",
]
