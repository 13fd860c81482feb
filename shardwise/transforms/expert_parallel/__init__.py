"""expert_parallel: mixture-of-experts layers with their experts split over a mesh axis.

:func:`moe_dispatch_combine` is the layer's distributed core, a pure differentiable function over a
mesh axis (torchtitan EP; DeepSpeed-MoE; FairScale ``MOELayer``): route (``router.py``), count and
exchange counts, dispatch with an ``all_to_all``, run the local experts (``experts.py``: HF Mixtral's
fused 3-D weights, or GPT-OSS's), ``all_to_all`` back, combine; the capacity and drop rule in ``capacity.py``;
the router's load-balancing loss over the global batch in ``aux_loss.py``; bytes in ``volumes.py``.
:func:`router_aux_loss` (``router_aux.py``, ``router_stats.py``) adds the routers' load-balancing loss
to a step's loss, HF Mixtral's, on one device and under this transform alike.

:func:`expert_parallel` (``spec.py``) is the transform: a SPLIT spec over its axis that cuts the MoE
blocks' experts (``blocks.py``) on dim 0, rewrites their forward to ``moe_dispatch_combine`` with the
all-to-alls' rows fixed at their bound, and sums every replicated parameter's gradient over the axis in
backward; its collectives record themselves through the engine's ``in_layer`` (``comm.py``), so the
engine predicts them on fake tensors for the Plan.
"""

from __future__ import annotations

from ...engine.stack.compose import add
from ...engine.step.step import Step
from .aux_loss import load_balancing_loss
from .blocks import OWN
from .capacity import Slots, assign_slots, expert_capacity
from .dispatch import MoEOutput, moe_dispatch_combine
from .experts import run_experts, run_gpt_oss_experts, shard_experts
from .router import ROUTERS, Routing, route
from .router_aux import RouterAuxLoss, RouterAuxSpec, router_aux_loss
from .router_stats import Carried, RouterStats
from .spec import EPSpec, resolve
from .volumes import moe_all_to_all_bytes, moe_count_exchange_bytes

__all__ = [
    "ROUTERS",
    "Carried",
    "EPSpec",
    "MoEOutput",
    "RouterAuxLoss",
    "RouterAuxSpec",
    "RouterStats",
    "Routing",
    "Slots",
    "assign_slots",
    "expert_capacity",
    "expert_parallel",
    "load_balancing_loss",
    "moe_all_to_all_bytes",
    "moe_count_exchange_bytes",
    "moe_dispatch_combine",
    "route",
    "router_aux_loss",
    "run_experts",
    "run_gpt_oss_experts",
    "shard_experts",
]


def expert_parallel(
    step: Step, axis: str = "ep", capacity_factor: float | None = None, *, drop_per_rank: bool = False
) -> Step:
    """Split the experts of ``step``'s mixture-of-experts blocks over mesh ``axis`` (torchtitan EP, DeepSpeed-MoE).

    Each rank of ``axis`` holds (materializes, initializes, checkpoints) ``E / size`` experts of every
    MoE block (``TopKMoE``; HF ``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``
    and ``Qwen2MoeSparseMoeBlock``, whose shared expert stays replicated; ``DeepseekV3MoE`` and
    ``Glm4MoeMoE``, whose own router is called as it is and whose shared experts stay replicated;
    ``JambaSparseMoeBlock``, on the layers of Jamba's Mamba/attention hybrid that have one, and
    ``GptOssMLP``, whose experts carry biases and their own clamped SwiGLU, and ``PhimoeSparseMoeBlock``
    (whose router's sampling in training is refused unless no draw can change its choice, naming the
    setting), their routers called as they are; a block
    of any class with fused
    experts whose forward calls :func:`moe_dispatch_combine` over ``axis`` itself, kept as written) and
    routes its own share of the batch: the axis also cuts the batch, like a data-parallel one. Tokens go to
    their experts' owners and back by two all-to-alls; every other parameter is replicated, and its
    gradient is summed over ``axis`` in
    backward (the mean of the ranks' shares, as data parallel); the experts' gradients are complete on
    their owner. ``capacity_factor=None`` drops no token and equals the single-device step; otherwise
    each rank sends each expert at most ``ceil(f * tokens * top_k / E)`` assignments (each token's first
    choice in token order, then its second, ...). An assignment over that capacity would be dropped,
    by each rank on its own tokens: which ones depends on how the mesh cuts the batch, and the
    single-device step (the modules' own forwards) drops none. So a step that would drop one is
    refused, naming the block and the count (every rank of the axis learns them from the routing
    counts it gathers anyway: no extra collective), unless ``drop_per_rank=True`` says that per-rank
    drop is the model you want; a factor that drops nothing on a batch is the single-device step.
    The all-to-alls carry that bound of rows per (rank, expert) (without a capacity: the rank's
    tokens), so the Plan states their bytes exactly. The modules' own forwards add no auxiliary loss,
    and neither does this: :func:`router_aux_loss` does, counted once over the whole batch.

    It composes with ``shard_params`` over another axis (ZeRO shards each rank's experts and
    replicated parameters over ``dp``), ``pipeline`` over another (each stage routes its micro-batches'
    tokens; under a zero-bubble schedule the all-to-alls' backward runs in both the input and the
    weight pass), ``tensor_parallel`` over another (attention split over ``tp``, the experts over
    ``ep``; a tensor-parallel plan must leave the MoE block itself alone; under its sequence parallel
    each (tp, ep) rank routes its slice of the sequence of its share of the batch, dispatches over ``ep``
    among the ranks of its tp index (a capacity is counted over the slice's tokens, as Megatron's
    is, and ``drop_per_rank`` drops each slice's overflow), and its experts' gradients are summed over
    ``tp`` too, while ``router_aux_loss`` over a slice is refused), ``mixed_precision`` and
    ``remat``, and ``context_parallel`` over another (each rank routes its sequence part's tokens).

    >>> import torch, shardwise as sw
    >>> from shardwise.testing.models import TopKMoE
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), TopKMoE(8, 8, num_experts=4, top_k=2)).double()
    >>> chain, params = sw.functionalize(model)
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1, momentum=0.9))
    >>> ep = expert_parallel(step, "ep")
    >>> batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
    >>> plan = ep.plan(sw.Mesh(ep=2), params, batch)
    >>> sorted({c.op for c in plan.collectives(0)})
    ['all_gather', 'all_to_all', 'psum']
    >>> _ = sw.testing.assert_equivalent(ep, step, sw.Mesh(ep=2), [batch, batch], params)
    """
    if not isinstance(step, Step):
        raise TypeError(f"expert_parallel(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"expert_parallel(axis={axis!r}): the axis is a mesh axis name such as 'ep'")
    expert_capacity(1, 1, 1, capacity_factor)  # a factor that cannot work is refused now
    if not isinstance(drop_per_rank, bool):
        raise TypeError(f"expert_parallel(drop_per_rank={drop_per_rank!r}): True or False")
    if drop_per_rank and capacity_factor is None:
        raise ValueError(
            "expert_parallel(drop_per_rank=True) without capacity_factor= drops nothing: give the capacity factor "
            "whose overflow each rank may drop, or leave drop_per_rank False"
        )
    spec = EPSpec(axis, None if capacity_factor is None else float(capacity_factor), drop_per_rank)
    blocks = resolve(step.base_chain)  # a chain without a known MoE block is refused now, not at the first step
    own = [f"{layer}.{b.path}" if b.path else layer for layer, found in blocks.items() for b in found if b.kind == OWN]
    if capacity_factor is not None and len(own) == sum(len(found) for found in blocks.values()):
        raise ValueError(
            f"expert_parallel(capacity_factor={capacity_factor!r}) sets the capacity of the blocks it rewrites, and "
            f"{', '.join(own)} {'is a block' if len(own) == 1 else 'are blocks'} of your own, which pass their own "
            "capacity_factor to moe_dispatch_combine: pass it there, and leave expert_parallel's None"
        )
    return add(step, spec)
