"""A known mixture-of-experts block's forward with its experts split over the axis (``blocks.py`` knows them).

Its router, reproduced (``router.py``'s softmax top k over the gate's logits) or, for the blocks of
:data:`~.blocks.OWN_ROUTER`, called as the block's own forward calls it; then :func:`moe_dispatch_combine`
dispatches each token to its experts' owners, runs them there as the block's experts class computes them
(GPT-OSS's: ``experts.py``'s :func:`~.experts.run_gpt_oss_experts`), and combines; a shared expert
(Qwen2-MoE's gated one, DeepSeek-V3's) runs on this rank's tokens, replicated.

Given rows of tokens it returns those tokens' rows, each from its own row alone (a drop over a capacity,
which would make a token's row depend on the others, is refused unless ``drop_per_rank``): it runs through
``engine/model/token_wise.py``'s :func:`run_token_wise`, so that tensor_parallel's sequence-parallel guard,
which cannot follow the dispatch over the expert axis op by op, takes it as one per-token op on the rank's
slice of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.model.hf_collecting import collecting_now
from ...engine.model.token_wise import run_token_wise
from . import phimoe
from .blocks import OWN_ROUTER, SHARED_EXPERTS, Block, refuse_hooks, router_of, top_k_of
from .capacity import expert_capacity
from .dispatch import moe_dispatch_combine
from .experts import run_gpt_oss_experts
from .router import Routing

# Own routers called with the block's input as it came ([batch, sequence, hidden]); the others get it flat.
_ROUTER_GETS_3D = ("DeepseekV3MoE", "Glm4MoeMoE")


def _router(module: Any, kind: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], str, Any]:
    """(the router's logits of flat tokens, the router's name, the experts' activation) of a block."""
    if kind == "TopKMoE":
        router = "softmax_topk_renormalized" if module.normalize else "softmax_topk"
        return module.gate, router, F.silu
    # HF's routers take their softmax, top k and renormalization in float32 whatever the dtype: so does this.
    renormalized = kind == "MixtralSparseMoeBlock" or bool(module.gate.norm_topk_prob)
    router = "softmax_topk_renormalized" if renormalized else "softmax_topk"
    return lambda x: F.linear(x, module.gate.weight).float(), router, module.experts.act_fn


class EPForward:
    """A block's forward with its experts split over ``axis``: router, then moe_dispatch_combine.

    The all-to-alls carry ``slots`` rows per (rank, expert), fixed at their bound: the capacity when
    there is one, else the rank's token count (a token picks an expert once), so the bytes do not
    depend on the routing and the Plan states them exactly."""

    def __init__(self, module: nn.Module, block: Block, axis: str, capacity_factor: float | None, where: str,
                 drop_per_rank: bool = False) -> None:
        self.module, self.block, self.axis, self.where = module, block, axis, where
        self.capacity_factor, self.drop_per_rank = capacity_factor, drop_per_rank

    def __call__(self, hidden_states: torch.Tensor) -> Any:
        return run_token_wise(lambda: self._forward(hidden_states), hidden_states, self.where)

    def _forward(self, hidden_states: torch.Tensor) -> Any:
        m: Any = self.module  # a known block (find_blocks): its router and experts are there
        kind = self.block.kind
        if "router_logits" in collecting_now():
            # The model collects them by hooks on its router modules, which this forward does not call the way
            # the block does: the model's forward would find none (transformers' raw IndexError) or too few.
            raise ValueError(
                f"expert_parallel: the model collects its routers' logits (output_router_logits=True), which "
                f"{self.where}'s routing under expert_parallel does not hand it; set config.output_router_logits = "
                "False before functionalize (sw.router_aux_loss adds the load-balancing loss over the whole batch)"
            )
        if kind == "MixtralSparseMoeBlock" and m.training and m.jitter_noise > 0:
            raise ValueError(
                f"expert_parallel: {self.where} has router_jitter_noise={m.jitter_noise}, which scales each token by "
                "random noise in training; set config.router_jitter_noise = 0"
            )
        refuse_hooks(m, kind, "expert_parallel", self.where)  # (one added since the transform: a few dict reads)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        n = flat.shape[0]
        if kind == phimoe.BLOCK:  # its router samples in training (refused where a draw could change the choice):
            phimoe.refuse_draws(m, "expert_parallel", self.where)  # the mode may have changed since the transform
        if kind in OWN_ROUTER:  # the model's own router, as its forward calls it
            logits, weights, experts = router_of(m, kind)(hidden_states if kind in _ROUTER_GETS_3D else flat)
            if kind == phimoe.BLOCK:
                phimoe.refuse_ties(logits, m, "expert_parallel", self.where)
            top_k = int(experts.shape[-1])  # what it returns (PhiMoE's sparsemixer: two, whatever the config)
            routed: dict[str, Any] = {"routing": Routing(experts, weights)}
            if kind == "GptOssMLP":  # its own layout, biases and activation
                routed["experts"] = lambda rows: run_gpt_oss_experts(rows, m.experts)
                act = F.silu  # unused: the experts' function computes theirs
            else:
                act = m.experts.act_fn
        else:
            top_k = top_k_of(m, kind)
            logits_of, router, act = _router(m, kind)
            logits, routed = logits_of(flat), {"router": router}
        capacity = expert_capacity(n, top_k, self.block.num_experts, self.capacity_factor)
        out = moe_dispatch_combine(
            flat, logits, m.experts.gate_up_proj, m.experts.down_proj, self.axis, top_k=top_k,
            capacity_factor=self.capacity_factor, act=act, slots=max(1, n if capacity is None else min(capacity, n)),
            aux_loss=False, **routed,
        )
        if out.dropped and not self.drop_per_rank:
            raise ValueError(
                f"expert_parallel(capacity_factor={self.capacity_factor!r}): {self.where} would drop {out.dropped} "
                f"token assignments over its experts' capacity (ceil({self.capacity_factor!r} x tokens x top_k / "
                f"{self.block.num_experts}), counted per rank over the rank's own tokens: its share of the batch, and "
                "under sequence parallel its slice of the sequence). Which ones drop depends on how the mesh cuts "
                "the batch (and the sequence), and the single-device step drops none: this step would train another "
                "model, without an error. Pass expert_parallel(..., drop_per_rank=True) to drop them knowingly, or "
                "a larger capacity_factor (None drops nothing)"
            )
        output = out.output
        if kind == "Qwen2MoeSparseMoeBlock":  # the shared expert: dense, on this rank's tokens
            output = output + torch.sigmoid(m.shared_expert_gate(flat)) * m.shared_expert(flat)
        elif kind in SHARED_EXPERTS:  # DeepSeek-V3's shared experts: dense, ungated
            output = output + m.shared_experts(flat)
        if kind == "GptOssMLP":  # its forward returns the router's scores too (its decoder layer drops them)
            return output.view(hidden_states.shape), weights
        return output.view(hidden_states.shape)
