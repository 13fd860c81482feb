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

from . import optim, testing
from .collectives import (
    CollectiveError,
    CollectiveTimeout,
    CommRecord,
    Group,
    Handle,
    Ledger,
    Mesh,
    RankAborted,
    RankFailed,
    RankHung,
    all_gather,
    all_gather_async,
    all_to_all,
    all_to_all_async,
    axis_index,
    axis_size,
    broadcast,
    broadcast_async,
    comm_ledger,
    current_mesh,
    launch,
    pmean,
    ppermute,
    ppermute_async,
    psum,
    psum_async,
    psum_scatter,
    psum_scatter_async,
    pvary,
    recv,
    send,
)
from .engine.checkpoint import save_load as checkpoint
from .engine.checkpoint.file_format import CheckpointError
from .engine.checkpoint.state_dict import full_state_dict, init_from_state_dict, read_dcp_state_dict
from .engine.checkpoint.weights import init_from_dcp, init_from_pretrained
from .engine.layout.state import TrainState
from .engine.layout.state_layout import LeafSpec, Placement, StateLayout, TensorSplit
from .engine.model.chain import Chain, Layer
from .engine.model.functionalize import FunctionalizeError, functionalize
from .engine.plan.actions import Action, Plan
from .engine.step.step import Step, train_step
from .transforms.expert_parallel import expert_parallel
from .transforms.mixed_precision import DynamicLossScale, Policy, StaticLossScale, mixed_precision
from .transforms.pipeline import (
    CommModel,
    PlanCosts,
    PlanDeadlock,
    PlanMismatch,
    PlanTimeline,
    Schedule,
    pipeline,
    simulate,
)
from .transforms.remat import checkpoint_name, policies, remat, saved_bytes
from .transforms.shard_params import shard_params
from .transforms.tensor_parallel import (
    Colwise,
    Region,
    Rowwise,
    gpt2_plan,
    llama_plan,
    tensor_parallel,
    tiny_gpt_plan,
    vocab_parallel_cross_entropy,
    vocab_parallel_logsumexp,
)

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Chain",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeout",
    "Colwise",
    "CommModel",
    "CommRecord",
    "DynamicLossScale",
    "FunctionalizeError",
    "Group",
    "Handle",
    "Layer",
    "LeafSpec",
    "Ledger",
    "Mesh",
    "Placement",
    "Plan",
    "PlanCosts",
    "PlanDeadlock",
    "PlanMismatch",
    "PlanTimeline",
    "Policy",
    "RankAborted",
    "RankFailed",
    "RankHung",
    "Region",
    "Rowwise",
    "Schedule",
    "StateLayout",
    "StaticLossScale",
    "Step",
    "TensorSplit",
    "TrainState",
    "all_gather",
    "all_gather_async",
    "all_to_all",
    "all_to_all_async",
    "axis_index",
    "axis_size",
    "broadcast",
    "broadcast_async",
    "checkpoint",
    "checkpoint_name",
    "comm_ledger",
    "current_mesh",
    "expert_parallel",
    "full_state_dict",
    "functionalize",
    "gpt2_plan",
    "init_from_dcp",
    "init_from_pretrained",
    "init_from_state_dict",
    "launch",
    "llama_plan",
    "mixed_precision",
    "optim",
    "pipeline",
    "pmean",
    "policies",
    "ppermute",
    "ppermute_async",
    "psum",
    "psum_async",
    "psum_scatter",
    "psum_scatter_async",
    "pvary",
    "read_dcp_state_dict",
    "recv",
    "remat",
    "saved_bytes",
    "send",
    "shard_params",
    "simulate",
    "tensor_parallel",
    "testing",
    "tiny_gpt_plan",
    "train_step",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logsumexp",
]
