"""expert_parallel: mixture-of-experts layers with their experts split over a mesh axis.

:func:`moe_dispatch_combine` is the layer's distributed core, a pure differentiable function over a
mesh axis (torchtitan EP; DeepSpeed-MoE; FairScale ``MOELayer``): route (``router.py``), count and
exchange counts, dispatch with an ``all_to_all``, run the local experts (``experts.py``: HF Mixtral's
fused 3-D weights), ``all_to_all`` back, combine; the capacity and drop rule in ``capacity.py``; the
router's load-balancing loss over the global batch in ``aux_loss.py``; bytes in ``volumes.py``.

How the ``expert_parallel(step, axis="ep", capacity_factor=None)`` spec will plug in, once the
engine's role protocols land (nothing of it exists yet):

* Role: a SHARDING of the expert parameters plus a REWRITE of the MoE layers. The sharding gives each
  fused expert weight (``*.experts.gate_up_proj``, ``*.experts.down_proj``: HF Mixtral, Qwen2-MoE and
  ``shardwise.testing.models.TopKMoE``) a split of dim 0 over ``axis`` in its shard spec, so each rank
  materializes and checkpoints only its ``E/ep`` experts; the rewrite replaces the MoE block's forward
  (router linear, then ``moe_dispatch_combine``) and maps the module's router class to a router name
  (``MixtralTopKRouter`` -> "softmax_topk_renormalized"; ``Qwen2MoeTopKRouter`` by ``norm_topk_prob``);
  a block whose router it does not recognise is refused, naming the module. Qwen2-MoE's shared expert
  is a dense MLP and stays replicated.
* Batch: the ``ep`` axis also splits the batch (each rank routes its own tokens), like a data axis.
* Gradients: the expert weights' gradients are complete on their owner (the all-to-all transposes
  brought every token's contribution) and are never reduced over ``ep``; under ``shard_params`` over a
  separate dp axis they reduce over dp only. Every other parameter (router, attention, norms, shared
  expert) is replicated over ``ep`` and its gradient is psum'd over ``ep`` (and dp).
* Loss: the auxiliary loss is invariant over ``ep``: added to each rank's loss, its gradient counts
  once; the step reports it once. Token-weighted losses divide by the global token count.
* Plan: per MoE layer an all-gather of counts, then two all-to-alls forward and two backward; their
  bytes depend on the routing, bounded by ``volumes.py`` with ``slots <= capacity`` (or the largest
  rank's token count), and the ledger records what ran.
"""

from .aux_loss import load_balancing_loss
from .capacity import Slots, assign_slots, expert_capacity
from .dispatch import MoEOutput, moe_dispatch_combine
from .experts import run_experts, shard_experts
from .router import ROUTERS, Routing, route
from .volumes import moe_all_to_all_bytes, moe_count_exchange_bytes

__all__ = [
    "ROUTERS",
    "MoEOutput",
    "Routing",
    "Slots",
    "assign_slots",
    "expert_capacity",
    "load_balancing_loss",
    "moe_all_to_all_bytes",
    "moe_count_exchange_bytes",
    "moe_dispatch_combine",
    "route",
    "run_experts",
    "shard_experts",
]
