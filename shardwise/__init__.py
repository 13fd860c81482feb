"""shardwise: a JAX-style functional sharding engine for PyTorch.

Write the model as a chain of pure layers, build the single-device training
step, and let pure transforms make it distributed; every distributed step can
be checked against the single-device one.

>>> import torch, shardwise as sw
>>> chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)))
>>> step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1)), "dp", stage=3)
>>> def main():
...     mesh = sw.Mesh(dp=2)
...     state = step.init(params, mesh)
...     gen = torch.Generator().manual_seed(0)   # the same batch on every rank (thread ranks
...     batch = (torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen))  # share torch's)
...     state, metrics = step(state, batch)
...     return state.params["0"].shape       # each rank holds half of layer 0
>>> sw.launch(main, world=2)
[torch.Size([20]), torch.Size([20])]
"""

import warnings
from typing import Any

from . import (
    checkpoint,
    collectives,
    layout,
    optim,
    plan,
    policies,
    precision,
    schedules,
    testing,
    tp,
)
from .collectives import Mesh, launch
from .engine.layout.state import TrainState
from .engine.model.chain import Chain, Layer
from .engine.model.functionalize import FunctionalizeError, functionalize
from .engine.step.step import Step, train_step
from .plan_search import search
from .transforms.context_parallel import context_parallel
from .transforms.expert_parallel import expert_parallel, router_aux_loss
from .transforms.mixed_precision import mixed_precision
from .transforms.pipeline import pipeline, simulate
from .transforms.remat import remat
from .transforms.shard_params import shard_params
from .transforms.tensor_parallel import tensor_parallel

__version__ = "0.1.0"

# A traceback names an exception by its module: the public one, not where it happens to live.
FunctionalizeError.__module__ = __name__

# What a first program uses; everything else is one namespace down (docs/api.md lists all of it).
__all__ = [
    "Chain",
    "FunctionalizeError",
    "Layer",
    "Mesh",
    "Step",
    "TrainState",
    "checkpoint",
    "collectives",
    "context_parallel",
    "expert_parallel",
    "functionalize",
    "launch",
    "layout",
    "mixed_precision",
    "optim",
    "pipeline",
    "plan",
    "policies",
    "precision",
    "remat",
    "router_aux_loss",
    "schedules",
    "search",
    "shard_params",
    "simulate",
    "tensor_parallel",
    "testing",
    "tp",
    "train_step",
]

# Names that were top-level before 0.2, by the namespace that holds them now. They still work,
# for this release, with a DeprecationWarning that names the new place, so that old code runs
# and says what to change (plain aliases would keep it working silently, and never migrate).
_MOVED = {
    **{name: "collectives" for name in (
        "CollectiveError", "CollectiveTimeout", "CommRecord", "Group", "Handle", "Ledger", "RankAborted",
        "RankFailed", "RankHung", "all_gather", "all_gather_async", "all_to_all", "all_to_all_async",
        "axis_index", "axis_size", "broadcast", "broadcast_async", "comm_ledger", "current_mesh", "pmean",
        "ppermute", "ppermute_async", "psum", "psum_async", "psum_scatter", "psum_scatter_async", "pvary",
        "recv", "send",
    )},
    **{name: "checkpoint" for name in (
        "CheckpointError", "full_state_dict", "init_from_dcp", "init_from_pretrained", "init_from_state_dict",
        "read_dcp_state_dict",
    )},
    **{name: "layout" for name in ("LeafSpec", "Placement", "StateLayout", "TensorSplit")},
    **{name: "plan" for name in (
        "Action", "CommModel", "Plan", "PlanCosts", "PlanDeadlock", "PlanMismatch", "PlanTimeline",
    )},
    **{name: "policies" for name in ("checkpoint_name", "saved_bytes")},
    **{name: "precision" for name in ("DynamicLossScale", "Policy", "StaticLossScale")},
    "Schedule": "schedules",
    **{name: "tp" for name in (
        "Colwise", "Region", "Rowwise", "gpt2_plan", "llama_plan", "tiny_gpt_plan",
        "vocab_parallel_cross_entropy", "vocab_parallel_logsumexp",
    )},
}


def __getattr__(name: str) -> Any:
    namespace = _MOVED.get(name)
    if namespace is None:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r} (docs/api.md lists the public names)")
    warnings.warn(
        f"sw.{name} moved to sw.{namespace}.{name}; the top-level name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(globals()[namespace], name)
