"""The mixture-of-experts blocks expert_parallel recognizes (their forward with the experts split:
``block_forward.py``).

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
* ``JambaSparseMoeBlock`` (HF): its router ``router`` (a ``JambaTopKRouter``: softmax in float32, the top
  k, not renormalized) called as it is, as DeepSeek-V3's; its experts Mixtral's code. Jamba's hybrid
  layers (Mamba or attention, a MoE block or a dense ``JambaMLP``) hold one only where the config puts one.
* ``GptOssMLP`` (HF): its router ``router`` (a ``GptOssTopKRouter`` with a bias: the top k of the logits, a
  softmax over those k) called as it is; its experts ``GptOssExperts`` laid out otherwise
  (``gate_up_proj`` [E, H, 2I], gate and up interleaved, ``down_proj`` [E, I, H]) with biases, cut on
  dim 0 too, and computed as that class does (``experts.py``: its own clamped SwiGLU ``_apply_gate``); its
  forward returns the router's scores beside the output, as the block's does.
* ``PhimoeSparseMoeBlock`` (HF): its router ``router`` (a ``PhimoeTopKRouter``: ``sparsemixer``'s two
  experts a token) called as it is; its experts Mixtral's code. In training that router samples, which the
  ranks cannot draw as one device does: refused unless no draw changes its choice (``phimoe.py``).

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

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.model.calls import forward_calls
from ...engine.model.reproduced import check_reproduced, same_code
from . import phimoe
from .dispatch import moe_dispatch_combine

OWN = "own"  # a block of one's own whose forward calls moe_dispatch_combine: kept as written

EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")
KNOWN = ("TopKMoE", "MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "OlmoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock",
         "DeepseekV3MoE", "Glm4MoeMoE", "JambaSparseMoeBlock", "GptOssMLP", "PhimoeSparseMoeBlock")
_ROUTER_OF = {"MixtralSparseMoeBlock": "MixtralTopKRouter", "Qwen2MoeSparseMoeBlock": "Qwen2MoeTopKRouter",
              "OlmoeSparseMoeBlock": "OlmoeTopKRouter", "Qwen3MoeSparseMoeBlock": "Qwen3MoeTopKRouter",
              "DeepseekV3MoE": "DeepseekV3TopkRouter", "Glm4MoeMoE": "Glm4MoeTopkRouter",
              "JambaSparseMoeBlock": "JambaTopKRouter", "GptOssMLP": "GptOssTopKRouter",
              "PhimoeSparseMoeBlock": "PhimoeTopKRouter"}
# Blocks whose router is called as it is (it returns the logits, the top k's weights and indices): what
# expert_parallel reproduces is around their experts.
OWN_ROUTER = ("DeepseekV3MoE", "Glm4MoeMoE", "JambaSparseMoeBlock", "GptOssMLP", "PhimoeSparseMoeBlock")
# Those adding a dense shared expert (``shared_experts``, ungated) after the routed ones.
SHARED_EXPERTS = ("DeepseekV3MoE", "Glm4MoeMoE")
# Those without a softmax router, whose Hugging Face model has no load-balancing loss.
NO_AUX_LOSS = ("DeepseekV3MoE", "Glm4MoeMoE")
# The router's attribute where it is not ``gate``.
ROUTER_ATTR = {"JambaSparseMoeBlock": "router", "GptOssMLP": "router", "PhimoeSparseMoeBlock": "router"}
# The experts' tensors, each cut over the axis on dim 0, where not EXPERT_WEIGHTS: GPT-OSS's have biases.
EXPERT_TENSORS = {"GptOssMLP": (*EXPERT_WEIGHTS, "experts.gate_up_proj_bias", "experts.down_proj_bias")}
# The experts' class of each known HF block, defined beside it: expert_parallel runs its computation itself.
_EXPERTS_OF = {"MixtralSparseMoeBlock": "MixtralExperts", "Qwen2MoeSparseMoeBlock": "Qwen2MoeExperts",
               "OlmoeSparseMoeBlock": "OlmoeExperts", "Qwen3MoeSparseMoeBlock": "Qwen3MoeExperts",
               "DeepseekV3MoE": "DeepseekV3Experts", "Glm4MoeMoE": "Glm4MoeExperts",
               "JambaSparseMoeBlock": "JambaExperts", "GptOssMLP": "GptOssExperts",
               "PhimoeSparseMoeBlock": "PhimoeExperts"}
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
    "JambaSparseMoeBlock": "transformers.models.jamba.modeling_jamba",
    "GptOssMLP": "transformers.models.gpt_oss.modeling_gpt_oss",
    "PhimoeSparseMoeBlock": "transformers.models.phimoe.modeling_phimoe",
}


def router_of(module: Any, kind: str) -> Any:
    """The router module of a known ``kind`` block (``gate``, or Jamba's, GPT-OSS's and PhiMoE's ``router``)."""
    return getattr(module, ROUTER_ATTR.get(kind, "gate"))


def top_k_of(module: Any, kind: str) -> int:
    """How many experts a known block routes each token to: its router's ``top_k`` where the router has one (the
    router computes the top k, and its count is the one its forward reads: Mixtral's ``MixtralTopKRouter.top_k``,
    which the block's own ``top_k`` beside it does not change), else the block's."""
    if kind == "TopKMoE":
        return int(module.top_k)
    router = router_of(module, kind)
    return int(router.top_k if hasattr(router, "top_k") else module.top_k)


def refuse_hooks(block: nn.Module, kind: str, who: str, where: str) -> None:
    """Refuse a hook on a known block's router or experts (or a module inside them): ``who`` computes the router's
    logits and the experts' rows itself, not by calling those modules, so what a hook does there (the single-device
    step runs it) would be left out without an error. A hook on the block itself runs as it does on one device."""
    parts = {ROUTER_ATTR.get(kind, "gate"): router_of(block, kind), "experts": block.experts}
    for name, part in parts.items():
        if not isinstance(part, nn.Module):
            continue
        for path, sub in part.named_modules(prefix=name):
            hooked = [kind_ for kind_, hooks in (("forward pre-hook", sub._forward_pre_hooks),
                                                 ("forward hook", sub._forward_hooks),
                                                 ("backward hook", sub._backward_hooks),
                                                 ("backward pre-hook", sub._backward_pre_hooks))
                      if any(not _records_outputs(hook) for hook in hooks.values())]
            if hooked:
                raise ValueError(
                    f"{who}: {where}.{path} ({type(sub).__name__}) has a {' and a '.join(hooked)}, which the "
                    f"single-device step runs; {who} computes the {kind}'s routing and experts itself (not by "
                    "calling that module), so the hook's effect would be left out without an error. Remove the hook, "
                    "put it on the block itself (it runs there), or leave the block out"
                )


def _per_expert(experts: Any, count: int, where: str) -> tuple[str, ...]:
    """A block of one's own's experts' parameters besides the fused weights that hold one row per expert (dim 0 of
    ``count``), cut with them. Where ``count`` is also a size of the experts (the hidden or the intermediate width),
    a parameter of that many rows may be one shared by every expert (a bias [H] with H = E): refused, naming it."""
    weights = {f"experts.{name}" for name in ("gate_up_proj", "down_proj")}
    down = experts.down_proj.shape  # [E, H, I]; gate_up_proj [E, 2I, H]
    sizes = {int(down[1]), int(down[2]), int(experts.gate_up_proj.shape[1])}
    found = []
    for name, p in experts.named_parameters():
        if f"experts.{name}" in weights or not p.dim() or p.shape[0] != count:
            continue
        if count in sizes:
            raise ValueError(
                f"expert_parallel: {where}.experts.{name} (shape {tuple(p.shape)}) has {count} rows, as many as the "
                f"experts and as a width of theirs ({sorted(sizes)}): expert_parallel cannot tell whether it holds "
                "one row per expert (cut with the experts' weights) or is shared by every expert (kept whole). Move a "
                "shared tensor out of the experts module (onto the block), or give the model another count of experts"
            )
        found.append(f"experts.{name}")
    return tuple(found)


def _records_outputs(hook: Any) -> bool:
    """Whether ``hook`` is transformers' output recorder (installed on a model's first call, to collect its routers'
    logits where ``output_router_logits=True``): it changes nothing, and what it collects under expert_parallel is
    refused on its own (block_forward.py)."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


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
    # A block of one's own: its experts' other per-expert parameters (dim 0 of the experts' count, a bias [E, H]
    # an experts= callable adds), cut with the weights: each rank's callable then reads its own experts' rows.
    extra: tuple[str, ...] = ()

    def local_names(self) -> tuple[str, ...]:
        """The layer's local names of this block's expert weights."""
        prefix = self.prefix + (f"{self.path}." if self.path else "")
        return tuple(prefix + w for w in (*EXPERT_TENSORS.get(self.kind, EXPERT_WEIGHTS), *self.extra))


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
            experts = int(sub.experts.gate_up_proj.shape[0])
            extra = _per_expert(sub.experts, experts, f"{where}{'.' + path if path else ''}")
            found.append(Block(path, OWN, experts, prefix, extra))
            continue
        kind = known_kind(sub)
        router_cls = type(getattr(sub, ROUTER_ATTR.get(kind or "", "gate"), None))
        # Named in a refusal as the block calls it: Jamba's is `router`, not the known blocks' `gate`.
        described = next((type(getattr(sub, a)).__name__ for a in ("gate", "router") if hasattr(sub, a)), "none found")
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
        refuse_hooks(sub, kind, who, f"{where}{'.' + path if path else ''}")
        if kind != "TopKMoE":
            _check_reproduced_parts(sub, kind, who, f"{where}{'.' + path if path else ''}")
        if kind == phimoe.BLOCK:
            phimoe.check_code(sub, who, f"{where}{'.' + path if path else ''}")
            if who == "expert_parallel":  # its settings are known now: refused now, not at the first step
                phimoe.refuse_draws(sub, who, f"{where}{'.' + path if path else ''}")
        if kind in NO_AUX_LOSS and who == "router_aux_loss":
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
    gate = type(router_of(block, kind))
    named_router = gate.__name__ == _ROUTER_OF[kind] and gate.__module__ == _HOME[kind]
    if kind not in OWN_ROUTER and named_router:
        check_reproduced(gate, who, f"{where}.gate")
    elif kind in OWN_ROUTER and kind not in NO_AUX_LOSS and who == "router_aux_loss":  # this reads its logits
        attr = ROUTER_ATTR.get(kind, "gate")
        if named_router:
            check_reproduced(gate, who, f"{where}.{attr}")
        elif not same_code(gate, {_ROUTER_OF[kind]: _HOME[kind]}):
            raise ValueError(
                f"{who}: {where}.{attr} is a {gate.__name__} (from {gate.__module__}), not the {kind}'s own "
                f"{_ROUTER_OF[kind]} nor a copy of its code: {who} computes the router logits HF's loss reads as "
                f"that class does (the linear map of its weight and bias), so what yours computes otherwise would "
                f"be left out without an error. Use the model's router, or leave {who} out"
            )
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
