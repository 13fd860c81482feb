"""Functional optimizers and learning-rate schedules: ``sw.optim.adamw(sw.optim.warmup_cosine(...))``.

Pure ``init`` / ``update`` pairs over parameter pytrees (optax's shape),
matching ``torch.optim.SGD`` and ``torch.optim.AdamW``.

>>> import torch, shardwise as sw
>>> opt = sw.optim.sgd(lr=0.1, momentum=0.9)
>>> params = {"w": torch.ones(2)}
>>> state = opt.init(params)
>>> params, state = opt.update({"w": torch.ones(2)}, state, params)
>>> params["w"]
tensor([0.9000, 0.9000])
"""

from .engine.optim.groups import Group, group
from .engine.optim.optimizers import AdamWState, Optimizer, SgdState, adamw, global_norm, sgd
from .engine.optim.schedules import (
    constant,
    cosine_decay,
    join,
    linear,
    linear_warmup,
    warmup_cosine,
)

__all__ = [
    "AdamWState",
    "Group",
    "Optimizer",
    "SgdState",
    "adamw",
    "constant",
    "cosine_decay",
    "global_norm",
    "group",
    "join",
    "linear",
    "linear_warmup",
    "sgd",
    "warmup_cosine",
]
