"""expert_parallel on MoE blocks whose router is their own: DeepSeek-V3's and GLM-4-MoE's.

Their routers score the experts by a sigmoid plus a correction bias (a buffer the training loop moves,
outside the gradient), keep the best ``topk_group`` groups of experts, take the top k there,
renormalize and scale. expert_parallel calls that router as it is and hands its experts and weights to
``moe_dispatch_combine(routing=...)``; the shared experts (a dense MLP) run on each rank's tokens.

float64 on thread ranks; the routers compute in float32 whatever the model's dtype (as HF's do), the
same on one device. The distributed block sums a token's k expert outputs in another order than HF's
loop over experts: equal to rounding (assert_equivalent's float64 default).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

transformers = pytest.importorskip("transformers")

VOCAB = 32
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=16, attn_implementation="eager", experts_implementation="eager",
              bos_token_id=0, eos_token_id=0, pad_token_id=1)
# Eight experts in four groups, the best two groups kept, two experts a token; the first layer dense.
ROUTING = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True,
               routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=12,
               intermediate_size=24)


def _deepseek_v3() -> tuple[Any, type]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = transformers.DeepseekV3Config(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                        v_head_dim=4, **ROUTING, **COMMON)
    return transformers.DeepseekV3ForCausalLM(cfg), DeepseekV3DecoderLayer


def _glm4_moe() -> tuple[Any, type]:
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    cfg = transformers.Glm4MoeConfig(head_dim=4, **ROUTING, **COMMON)
    return transformers.Glm4MoeForCausalLM(cfg), Glm4MoeDecoderLayer


def _dots1() -> tuple[Any, type]:
    from transformers.models.dots1.modeling_dots1 import Dots1DecoderLayer

    return transformers.Dots1ForCausalLM(transformers.Dots1Config(**ROUTING, **COMMON)), Dots1DecoderLayer


MODELS = {"DeepSeek-V3": _deepseek_v3, "GLM-4-MoE": _glm4_moe}


def _model(family: str) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model, layer = {**MODELS, **COPIES}[family]()
    model = model.double()
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():  # HF zero-initializes the routers: every score would tie
        if type(module).__name__.endswith("TopkRouter"):
            module.weight.data.normal_(0.0, 1.0, generator=gen)
            module.e_score_correction_bias.uniform_(-0.5, 0.5, generator=gen)
    data = [(torch.randint(VOCAB, (4, 6), generator=gen), torch.randint(VOCAB, (4, 6), generator=gen))
            for _ in range(2)]
    chain, params = sw.functionalize(model, units=layer, example_input=data[0][0])

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))

    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params, data


def _router_in_the_models_dtype(self: Any, hidden_states: torch.Tensor) -> Any:
    """HF's DeepseekV3TopkRouter.forward (Glm4MoeTopkRouter's is the same), in the model's dtype where HF
    computes in float32."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0]
    group_idx = torch.topk(group_scores.sum(dim=-1), k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores[..., 0]).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.reshape(-1, self.num_experts).bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def _ep(step: sw.Step, stack: str) -> tuple[sw.Step, sw.Mesh]:
    ep = sw.expert_parallel(step, "ep")
    if stack == "dp x ep zero3":
        return sw.shard_params(ep, "dp", 3), sw.Mesh(dp=2, ep=2)
    return ep, sw.Mesh(ep=2)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("stack", ["ep", "dp x ep zero3"])
def test_a_block_with_its_own_router_equals_the_single_device_step(
        family: str, stack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the router in float64, as the rest of the model, equal to float64 rounding."""
    step, params, data = _model(family)
    router = {"DeepSeek-V3": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
              "GLM-4-MoE": "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter"}[family]
    monkeypatch.setattr(f"{router}.forward", _router_in_the_models_dtype)
    ep, mesh = _ep(step, stack)
    split = sorted(name for (_layer, name) in ep.split.tensor_splits(ep.chain, mesh))
    assert split == [f"model.layers.{i}.mlp.experts.{w}" for i in (1, 2) for w in ("down_proj", "gate_up_proj")]
    sw.testing.assert_equivalent(ep, step, mesh, data, params)


@pytest.mark.parametrize("stack", ["ep", "dp x ep zero3"])
def test_with_hfs_float32_router_it_equals_the_single_device_step_to_float32s_rounding(stack: str) -> None:
    """HF's routers compute in float32 in a float64 model: the router's matmul, and its weight's gradient (a
    float32 sum over the tokens), on a rank's share of the tokens. The CPU's float32 kernels may round a share
    otherwise than the whole batch (which kernel runs depends on the rows: on an AMD EPYC the first step's
    loss differed by 2.5e-12 and each router weight by 6e-8 of its update, every other weight by float64
    rounding; on the machine this was written on, the first step was exact), and after the first step the
    parameters differ by float64 rounding too, which the cast to float32 can turn into a routing weight one
    float32 ulp apart (1.1e-9 relative at the second step): within 1e-6, float32's precision, from the first
    step on. With the router in float64 (above) the step equals the single device to 1e-10. (GLM-4-MoE's router
    is the same code.)"""
    step, params, data = _model("DeepSeek-V3")
    ep, mesh = _ep(step, stack)
    sw.testing.assert_equivalent(ep, step, mesh, data, params, rtol=1e-6)


def test_the_routers_groups_and_bias_decide_the_experts() -> None:
    """The check above is not vacuous: the groups and the correction bias change which experts a token
    goes to (another routing, the softmax top k of the same logits, would pick others)."""
    model, _ = _deepseek_v3()
    gate = model.model.layers[1].mlp.gate
    gen = torch.Generator().manual_seed(3)
    gate.weight.data.normal_(0.0, 1.0, generator=gen)
    gate.e_score_correction_bias.uniform_(-0.5, 0.5, generator=gen)
    x = torch.randn(64, 16, generator=gen)
    logits, _weights, experts = gate(x)
    softmax_top = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices
    assert not torch.equal(experts.sort(-1).values, softmax_top.sort(-1).values)


def test_router_aux_loss_refuses_a_router_without_a_softmax() -> None:
    step, _params, _data = _model("DeepSeek-V3")
    with pytest.raises(ValueError, match=r"router_aux_loss: .*DeepseekV3MoE.*sigmoid scores plus a correction bias"
                                         r".*Leave router_aux_loss out"):
        sw.router_aux_loss(step, 0.01)


def test_a_given_routing_is_checked_against_the_tokens() -> None:
    from shardwise.transforms.expert_parallel import moe_dispatch_combine
    from shardwise.transforms.expert_parallel.router import Routing

    x, logits = torch.randn(4, 3), torch.randn(4, 2)
    gate_up, down = torch.randn(2, 4, 3), torch.randn(2, 3, 2)
    good = Routing(torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1))
    out = moe_dispatch_combine(x, logits, gate_up, down, "ep", top_k=1, routing=good, aux_loss=False)
    assert out.tokens_per_expert.tolist() == [4, 0]
    with pytest.raises(ValueError, match=r"routing\.experts must be \[tokens, top_k\] = \(4, 2\)"):
        moe_dispatch_combine(x, logits, gate_up, down, "ep", top_k=2, routing=good, aux_loss=False)
    with pytest.raises(ValueError, match=r"no softmax over the experts.*aux_loss=False"):
        moe_dispatch_combine(x, logits, gate_up, down, "ep", top_k=1, routing=good)


def test_every_rank_issues_exactly_the_collectives_its_plan_lists() -> None:
    """The Plan runs the model's own router on fake tensors; the all-to-alls carry their bound of rows."""
    step, params, data = _model("DeepSeek-V3")
    ep, mesh = _ep(step, "dp x ep zero3")
    plan = ep.plan(mesh, params, data[0])

    def run() -> list[tuple[str, str, str, int]]:
        state = ep.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            ep(state, data[0])
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    for rank, got in enumerate(sw.launch(run, mesh.size, timeout=120)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"
    # Two MoE layers, each a dispatch and a combine forward and their transposes in backward.
    assert sum(c.op == "all_to_all" for c in plan.collectives(0)) == 2 * 2 * 2


def _flex_olmo() -> tuple[Any, type]:
    from transformers.models.flex_olmo.modeling_flex_olmo import FlexOlmoDecoderLayer

    config = transformers.FlexOlmoConfig(intermediate_size=12, num_experts=4, num_experts_per_tok=2, **COMMON)
    return transformers.FlexOlmoForCausalLM(config), FlexOlmoDecoderLayer


# Blocks of other models whose code is a known block's line for line (Hugging Face's "Copied from"), their
# routers and experts too: Dots1's is DeepSeek-V3's, FlexOlmo's OLMoE's (its softmax router reproduced).
COPIES = {"Dots1": _dots1, "FlexOlmo": _flex_olmo}


@pytest.mark.parametrize("family", list(COPIES))
def test_another_models_copy_of_a_known_block_is_split_by_its_code(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if family == "Dots1":  # its router in float64, as above (HF's computes in float32)
        monkeypatch.setattr("transformers.models.dots1.modeling_dots1.Dots1TopkRouter.forward",
                            _router_in_the_models_dtype)
    step, params, data = _model(family)
    ep, mesh = _ep(step, "dp x ep zero3")
    assert sorted(name for (_layer, name) in ep.split.tensor_splits(ep.chain, mesh))
    sw.testing.assert_equivalent(ep, step, mesh, data, params)


def test_experts_in_another_layout_are_named_not_called_no_mixture_of_experts() -> None:
    """NemotronH's MoE (experts.up_proj and experts.down_proj, no gate) and JetMoE's (input_linear,
    output_linear) are layouts expert_parallel does not split. It said the chain had no mixture-of-experts
    block, "nothing to do", to a user holding one; it now names the blocks it found and the way out."""
    cfg = transformers.NemotronHConfig(layers_block_type=["attention", "moe"], head_dim=4, n_routed_experts=4,
                                       moe_intermediate_size=8, moe_shared_expert_intermediate_size=8,
                                       intermediate_size=24, **{**COMMON, "num_hidden_layers": 2})
    model = transformers.NemotronHForCausalLM(cfg).double()
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock
    chain, _ = sw.functionalize(model, units=NemotronHBlock, example_input=torch.randint(0, VOCAB, (2, 8)))
    step = sw.train_step(chain, lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                         sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=(
            r"no mixture-of-experts block .*; the model's experts are in another layout, which expert_parallel "
            r"does not split: model.layers.1.mixer \(NemotronHMoE: experts.up_proj, experts.down_proj\)\. "
            r"Leave expert_parallel out for this model")):
        sw.expert_parallel(step, "ep")
