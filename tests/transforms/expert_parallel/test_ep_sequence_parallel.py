"""sw.expert_parallel with sw.tensor_parallel's sequence parallel (Megatron's TP + SP + EP).

Inside a sequence-parallel block each (tp, ep) rank holds its batch share (cut over ep) and its slice of
the sequence (cut over tp). Its MoE block routes those tokens and dispatches them over ep only (the ranks
of its tp index); the experts it owns compute what they receive. The guard (positions.py) takes
expert_parallel's block forward as one per-token op (engine/model/token_wise.py's run_token_wise), and the
owned experts' gradients, computed on one slice of the sequence, are summed over tp (tensor_parallel's
vary) as the router's are over tp and ep. float64 on thread ranks, equal to the single-device step at
rtol=1e-9; the ledger of every rank equals its Plan; aux losses over a slice stay refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw

transformers = pytest.importorskip("transformers")

# The models, batches and attention plan of tensor parallel's own MoE-on-slices tests.
from ..tensor_parallel.test_sequence_parallel_moe import ATTENTION_ONLY, BLOCKS, VOCAB, _batches, _model  # noqa: E402


def _problem(family: str, clip_norm: float | None = None) -> tuple[sw.Step, Any, list[Any]]:
    model, block = _model(family)
    batches = _batches()
    chain, params = sw.functionalize(model, units=block, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y),
                         sw.optim.sgd(0.1, momentum=0.9), clip_norm=clip_norm)
    return step, params, batches


def _tp_sp_ep(step: sw.Step, ep_first: bool = False) -> sw.Step:
    if ep_first:
        return sw.tensor_parallel(sw.expert_parallel(step, "ep"), "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)
    return sw.expert_parallel(sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS), "ep")


@pytest.mark.parametrize(("family", "ep_first"), [
    ("qwen3_moe", False), ("mixtral", False), ("qwen2_moe", False), ("qwen3_moe", True),
])
def test_tp_2_sp_by_ep_2_equals_the_single_device_step(family: str, ep_first: bool) -> None:
    step, params, batches = _problem(family)
    composed = _tp_sp_ep(step, ep_first)
    mesh = sw.Mesh(ep=2, tp=2)
    cut = {name: c.axis for (_layer, name), c in composed.split.tensor_splits(composed.base_chain, mesh).items()
           if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(cut) == 4 and set(cut.values()) == {"ep"}, cut  # two layers' experts, over ep only
    sw.testing.assert_equivalent(composed, step, mesh, batches, params, rtol=1e-9)


def test_dp_by_tp_sp_by_ep_with_zero_3_and_clipping_equals_the_single_device_step() -> None:
    """clip_norm below the gradient's norm: the global norm counts every expert's summed gradient once
    (each ep index its own experts, one tp index of them)."""
    step, params, batches = _problem("qwen3_moe", clip_norm=0.05)
    composed = sw.shard_params(_tp_sp_ep(step), "dp", 3)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, ep=2, tp=2), batches, params, rtol=1e-9)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_every_rank_issues_exactly_the_collectives_its_plan_lists(family: str) -> None:
    step, params, batches = _problem(family)
    plan = sw.testing.assert_plan_is_run(_tp_sp_ep(step), sw.Mesh(ep=2, tp=2), params, batches[0])
    ops = {(c.axis, c.op) for c in plan.collectives(0)}
    assert {("ep", "all_to_all"), ("tp", "all_gather"), ("tp", "psum_scatter")} <= ops, ops


def test_router_logits_collected_over_a_slice_are_refused_naming_the_setting() -> None:
    """output_router_logits=True (the model whole, one unit) collects each router's logits for its aux loss;
    expert_parallel refuses the model adding that loss on any mesh, and with router_aux_loss_coef=0 the
    logits are still collected, which under sequence parallel would be this rank's slice's: refused where
    expert_parallel's block forward runs as one op in the sequence-parallel block."""
    model, _ = _model("mixtral", output_router_logits=True, router_aux_loss_coef=0.0)
    batches = _batches()
    chain, params = sw.functionalize(model, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y), sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"output_router_logits=True.*'model\.model\.layers\.0\.mlp' sees only "
                                         r"this rank's slice.*config\.output_router_logits = False"):
        _tp_sp_ep(step).plan(sw.Mesh(ep=2, tp=2), params, batches[0])


def test_router_logits_collected_under_expert_parallel_alone_are_refused_naming_the_setting() -> None:
    """Without sequence parallel too: the model collects its routers' logits by hooks on the router modules,
    which expert_parallel's routing does not call as the block does; transformers then failed with a raw
    IndexError (no logits collected). Refused, naming the setting."""
    model, _ = _model("mixtral", output_router_logits=True, router_aux_loss_coef=0.0)
    batches = _batches()
    chain, params = sw.functionalize(model, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                         sw.optim.sgd(0.1))
    with pytest.raises(sw.collectives.RankFailed, match=r"expert_parallel: the model collects its routers' logits "
                                                        r"\(output_router_logits=True\).*output_router_logits = False"):
        sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), batches, params)


@pytest.mark.parametrize("ep_first", [False, True])
def test_router_aux_loss_with_sequence_parallel_is_refused(ep_first: bool) -> None:
    """tensor_parallel refuses it for the experts it knows (transformers'), expert_parallel for any
    (test_ep_tensor_parallel.py's TopKMoE)."""
    step, _, _ = _problem("qwen3_moe")
    with pytest.raises(ValueError, match=r"under router_aux_loss.*'model\.layers\.0\.mlp\.experts' routes only "
                                         r"this rank's slice"):
        _tp_sp_ep(sw.router_aux_loss(step, 0.01), ep_first)


def test_gpt_oss_tp_2_sp_by_ep_2_equals_the_single_device_step() -> None:
    """GPT-OSS's MLP returns its router's scores beside its output, a row per token ([tokens, experts]):
    the guard holds them as rows of the slice (its decoder layer drops them). Attention with sinks split by
    heads (sw.tp.gpt_oss_plan), a sliding-window layer, float64 at rtol=1e-9; the ledger is the Plan."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        sliding_window=4, attn_implementation="eager", experts_implementation="eager", pad_token_id=0,
        eos_token_id=1, bos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = transformers.GptOssForCausalLM(config).double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    batches = _batches()
    chain, params = sw.functionalize(model, units=GptOssDecoderLayer, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y),
                         sw.optim.sgd(0.1, momentum=0.9))
    composed = sw.expert_parallel(sw.tensor_parallel(step, "tp", sw.tp.gpt_oss_plan(), sequence_parallel=BLOCKS), "ep")
    mesh = sw.Mesh(ep=2, tp=2)
    sw.testing.assert_equivalent(composed, step, mesh, batches, params, rtol=1e-9)
    sw.testing.assert_plan_is_run(composed, mesh, params, batches[0])
