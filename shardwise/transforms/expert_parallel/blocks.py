"""The mixture-of-experts blocks expert_parallel recognizes, and their forward with the experts split.

A block is a module with an ``experts`` child holding fused 3-D ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I] (HF ``MixtralExperts``' layout). Known kinds, by class name:

* ``TopKMoE`` (shardwise.testing.models): router ``gate`` (a Linear), renormalized when ``normalize``.
* ``MixtralSparseMoeBlock`` (HF): router ``gate`` a ``MixtralTopKRouter`` (softmax, top k, renormalized),
  activation ``experts.act_fn``; router jitter noise in training is refused (it draws per token).
* ``Qwen2MoeSparseMoeBlock`` (HF): router ``gate`` a ``Qwen2MoeTopKRouter`` (renormalized when
  ``norm_topk_prob``), plus its shared expert, a dense MLP gated by a sigmoid: replicated, added after.
* ``OlmoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock`` (HF): Qwen2-MoE's without the shared expert, their
  routers (``OlmoeTopKRouter``, ``Qwen3MoeTopKRouter``) line for line Qwen2-MoE's.
* ``DeepseekV3MoE``, ``Glm4MoeMoE`` (HF): routers of their own (``DeepseekV3TopkRouter``,
  ``Glm4MoeTopkRouter``: sigmoid scores plus a correction bias, the top k within the best groups of
  experts, renormalized and scaled), which are called as they are: their experts and weights go to
  ``moe_dispatch_combine(routing=...)``; plus their shared experts, a dense MLP, replicated, added after.
  They have no load-balancing loss (the bias balances them, updated outside the gradient):
  ``router_aux_loss`` refuses them.

A block of another transformers model whose forward is a known block's line for line (Hugging Face's
"Copied from": Dots1's of DeepSeek-V3's, FlexOlmo's of OLMoE's), with a router and experts of the known
ones' code too, is that kind (``engine/model/reproduced.py``'s ``same_code``); a known one by name must be
the code checked.

A block of any class whose own forward calls :func:`moe_dispatch_combine` (``engine/model/calls.py``
reads its code) routes with one of ``router.py``'s routers already: kind :data:`OWN`, split as written
(``own_block.py``). Any other module holding fused experts is refused, naming it: its router is not
known to compute what ``router.py``'s routers do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.model.calls import forward_calls
from ...engine.model.reproduced import check_reproduced, same_code
from .capacity import expert_capacity
from .dispatch import moe_dispatch_combine
from .router import Routing

OWN = "own"  # a block of one's own whose forward calls moe_dispatch_combine: kept as written

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")
KNOWN = ("TopKMoE", "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock",
         "DeepseekV3MoE", "Glm4MoeMoE")
_ROUTER_OF = {"MixtralSparseMoeBlock": "MixtralTopKRouter", "Qwen2MoeSparseMoeBlock": "Qwen2MoeTopKRouter",
              "OlmoeSparseMoeBlock": "OlmoeTopKRouter", "Qwen3MoeSparseMoeBlock": "Qwen3MoeTopKRouter",
              "DeepseekV3MoE": "DeepseekV3TopkRouter", "Glm4MoeMoE": "Glm4MoeTopkRouter"}
# Blocks whose router is called as it is (it returns the logits, the top k's weights and indices) and whose
# forward adds a dense shared expert: what expert_parallel reproduces around their experts.
OWN_ROUTER = ("DeepseekV3MoE", "Glm4MoeMoE")
# The experts' class of each known HF block, defined beside it: expert_parallel runs its computation itself.
_EXPERTS_OF = {"MixtralSparseMoeBlock": "MixtralExperts", "Qwen2MoeSparseMoeBlock": "Qwen2MoeExperts",
               "OlmoeSparseMoeBlock": "OlmoeExperts", "Qwen3MoeSparseMoeBlock": "Qwen3MoeExperts",
               "DeepseekV3MoE": "DeepseekV3Experts", "Glm4MoeMoE": "Glm4MoeExperts"}
# Where each known block is defined: a class of the same name elsewhere (a copy of HF's code, edited)
# is not the block whose forward expert_parallel reproduces.
_HOME = {
    "TopKMoE": "shardwise.testing.models",
    "MixtralSparseMoeBlock": "transformers.models.mixtral.modeling_mixtral",
    "Qwen2MoeSparseMoeBlock": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "OlmoeSparseMoeBlock": "transformers.models.olmoe.modeling_olmoe",
    "Qwen3MoeSparseMoeBlock": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "DeepseekV3MoE": "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "Glm4MoeMoE": "transformers.models.glm4_moe.modeling_glm4_moe",
}


def known_kind(module: nn.Module) -> str | None:
    """The known block ``module`` is (its class or a base, from the module that defines it), if the
    forward it runs is that block's own: expert_parallel replaces the forward with its reproduction,
    so a subclass's or a same-named copy's forward (added dropout, noise, scaling) would be lost."""
    for cls in type(module).__mro__:
        kind = cls.__name__ if _HOME.get(cls.__name__) == cls.__module__ else _kind_by_code(cls)
        if kind is not None:
            return kind if type(module).forward is getattr(cls, "forward", None) else None
    return None


def _kind_by_code(cls: type) -> str | None:
    """The known HF block whose forward ``cls`` (a transformers class) has line for line: another model's
    copy (Dots1's of DeepSeek-V3's, FlexOlmo's of OLMoE's), computed as the known one is."""
    return next((kind for kind, home in _HOME.items() if kind != "TopKMoE" and same_code(cls, {kind: home})), None)


def _router_known(kind: str | None, router: type) -> bool:
    """Whether the router of a ``kind`` block is one expert_parallel computes as the block does: any under a
    block that calls its router (OWN_ROUTER), else the known block's router class, or a copy of its code."""
    if kind == "TopKMoE" or kind in OWN_ROUTER:
        return True
    if kind not in _ROUTER_OF:
        return False
    want = {_ROUTER_OF[kind]: _HOME[kind]}
    return (router.__name__ == _ROUTER_OF[kind] and router.__module__ == _HOME[kind]) or same_code(router, want)


@dataclass(frozen=True)
class Block:
    """One MoE block of a layer: its path in the layer's module, its experts and its router."""

    path: str  # in the module the layer calls ("" for the module itself)
    kind: str  # one of KNOWN, or OWN
    num_experts: int
    prefix: str = ""  # what the layer's local names of that module's tensors start with

    def local_names(self) -> tuple[str, ...]:
        """The layer's local names of this block's expert weights."""
        prefix = self.prefix + (f"{self.path}." if self.path else "")
        return tuple(prefix + w for w in EXPERT_WEIGHTS)


def holds_experts(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    weights = [getattr(experts, w, None) for w in ("gate_up_proj", "down_proj")]
    return all(isinstance(w, torch.Tensor) and w.ndim == 3 for w in weights)


def find_blocks(module: nn.Module, where: str, prefix: str = "", who: str = "expert_parallel") -> list[Block]:
    """Every MoE block in ``module`` (the top-most of nested ones), refusing one it does not know; ``who``
    (the transform that asks) begins the refusal."""
    found: list[Block] = []
    for path, sub in module.named_modules():
        if not holds_experts(sub) or any(path.startswith(f"{b.path}.") or not b.path for b in found):
            continue
        name = type(sub).__name__
        if forward_calls(sub, (moe_dispatch_combine,)):
            if who != "expert_parallel":
                raise ValueError(
                    f"{who}: {where}{'.' + path if path else ''} ({name}) is a block of your own whose forward calls "
                    f"moe_dispatch_combine; {who} reads the routers of the blocks it knows ({', '.join(KNOWN)}) and "
                    "cannot see what yours routes. Leave it out, or use a known block"
                )
            found.append(Block(path, OWN, int(sub.experts.gate_up_proj.shape[0]), prefix))
            continue
        router_cls = type(getattr(sub, "gate", None))
        # Named in a refusal as the block calls it: Jamba's is `router`, not the known blocks' `gate`.
        described = next((type(getattr(sub, a)).__name__ for a in ("gate", "router") if hasattr(sub, a)), "none found")
        kind = known_kind(sub)
        # A block of one's own is split as written by expert_parallel only (router_aux_loss cannot read it).
        own = ("write its forward to call moe_dispatch_combine (the expert-parallel core, with one of its "
               "routers) on its experts' weights over the transform's axis" if who == "expert_parallel"
               else f"leave {who} out")
        router_known = _router_known(kind, router_cls)
        if kind is None and any(c.__name__ in KNOWN for c in type(sub).__mro__):
            raise ValueError(
                f"{who}: {where}{'.' + path if path else ''} is a {name} whose forward is not "
                f"{', '.join(KNOWN)}'s own (a subclass overriding it, or a copy of the class defined in "
                f"{type(sub).__module__}): {who} reproduces the known block's routing (expert_parallel its whole "
                "forward), so what yours adds (dropout, noise, scaling) would be lost without an error. Use "
                f"the library's class unchanged, or {own}"
            )
        if not router_known:
            raise ValueError(
                f"{who}: {where}{'.' + path if path else ''} ({name}, router {described}) holds fused experts, "
                f"but its router is not one {who} knows ({', '.join(KNOWN)} with their routers): it cannot "
                f"tell which experts each token goes to. Use a known block, or {own}"
            )
        assert kind is not None  # router_known implies a known kind
        if kind != "TopKMoE":
            _check_reproduced_parts(sub, kind, who, f"{where}{'.' + path if path else ''}")
        if kind in OWN_ROUTER and who == "router_aux_loss":
            raise ValueError(
                f"router_aux_loss: {where}{'.' + path if path else ''} ({name}) routes by sigmoid scores plus a "
                "correction bias, which balances its experts without a loss (its Hugging Face model computes none); "
                "router_aux_loss adds the load-balancing loss of a softmax router, which this block does not have. "
                "Leave router_aux_loss out (expert_parallel splits the block without it)"
            )
        found.append(Block(path, kind, int(sub.experts.gate_up_proj.shape[0]), prefix))
    return found


def _check_reproduced_parts(block: nn.Module, kind: str, who: str, where: str) -> None:
    """The known HF block's forward, its router's (where reproduced, not called) and its experts' must be the
    code the reproduction was checked against (``engine/model/reproduced.py``): by name, the checked code;
    another model's copy was recognised by its code already. Experts of another class than the block's own
    (swapped in) are refused, as their forward is replaced too."""
    named = [c for c in type(block).__mro__ if c.__name__ == kind and c.__module__ == _HOME[kind]]
    if named:
        check_reproduced(named[0], who, where)
    gate = type(block.gate)
    if kind not in OWN_ROUTER and gate.__name__ == _ROUTER_OF[kind] and gate.__module__ == _HOME[kind]:
        check_reproduced(gate, who, f"{where}.gate")
    experts, want = type(block.experts), {_EXPERTS_OF[kind]: _HOME[kind]}
    if experts.__name__ == _EXPERTS_OF[kind] and experts.__module__ == _HOME[kind]:
        check_reproduced(experts, who, f"{where}.experts")
    elif not same_code(experts, want):
        raise ValueError(
            f"{who}: {where}.experts is a {experts.__name__} (from {experts.__module__}), not the {kind}'s own "
            f"{_EXPERTS_OF[kind]} nor a copy of its code, whose forward {who} reproduces on the split experts: "
            f"what yours computes otherwise would be left out without an error. Use the model's experts, or "
            f"leave {who} out"
        )


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

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        m: Any = self.module  # a known block (find_blocks): its router and experts are there
        if self.block.kind == "MixtralSparseMoeBlock" and m.training and m.jitter_noise > 0:
            raise ValueError(
                f"expert_parallel: {self.where} has router_jitter_noise={m.jitter_noise}, which scales each token by "
                "random noise in training; set config.router_jitter_noise = 0"
            )
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        n, top_k = flat.shape[0], int(m.top_k if hasattr(m, "top_k") else m.gate.top_k)
        capacity = expert_capacity(n, top_k, self.block.num_experts, self.capacity_factor)
        if self.block.kind in OWN_ROUTER:  # the model's own router, as its forward calls it
            logits, weights, experts = m.gate(hidden_states)
            routed: dict[str, Any] = {"routing": Routing(experts, weights)}
            act = m.experts.act_fn
        else:
            logits_of, router, act = _router(m, self.block.kind)
            logits, routed = logits_of(flat), {"router": router}
        out = moe_dispatch_combine(
            flat, logits, m.experts.gate_up_proj, m.experts.down_proj, self.axis, top_k=top_k,
            capacity_factor=self.capacity_factor, act=act, slots=max(1, n if capacity is None else min(capacity, n)),
            aux_loss=False, **routed,
        )
        if out.dropped and not self.drop_per_rank:
            raise ValueError(
                f"expert_parallel(capacity_factor={self.capacity_factor!r}): {self.where} would drop {out.dropped} "
                f"token assignments over its experts' capacity (ceil({self.capacity_factor!r} x tokens x top_k / "
                f"{self.block.num_experts}), counted per rank over the rank's own tokens). Which ones drop depends on "
                "how the mesh cuts the batch, and the single-device step drops none: this step would train another "
                "model, without an error. Pass expert_parallel(..., drop_per_rank=True) to drop them knowingly, or "
                "a larger capacity_factor (None drops nothing)"
            )
        output = out.output
        if self.block.kind == "Qwen2MoeSparseMoeBlock":  # the shared expert: dense, on this rank's tokens
            output = output + torch.sigmoid(m.shared_expert_gate(flat)) * m.shared_expert(flat)
        elif self.block.kind in OWN_ROUTER:  # DeepSeek-V3's shared experts: dense, ungated
            output = output + m.shared_experts(flat)
        return output.view(hidden_states.shape)
