"""sw.expert_parallel beside sw.context_parallel: the batch cut over ep, every sequence over cp.

Each rank routes the tokens of its batch share's sequence part; the ring passes keys and values
among the ranks of one ep index, the all-to-alls go among the ranks of one cp index. Every replicated
parameter's gradient is summed over both axes inside the layers; the router aux loss sums its counts
over both. float64 on thread ranks, equal to the single-device step to rounding
(assert_equivalent's float64 default); the ledger equals the Plan on both axes.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw

from .test_ep_step import _ledger, _lm_loss, batches, moe_model


@pytest.mark.parametrize("ep_first", [True, False])
def test_cp_2_by_ep_2_equals_the_single_device_step(ep_first: bool) -> None:
    step, params = moe_model()
    if ep_first:
        composed = sw.context_parallel(sw.expert_parallel(step, "ep"), "cp")
    else:
        composed = sw.expert_parallel(sw.context_parallel(step, "cp"), "ep")
    sw.testing.assert_equivalent(composed, step, sw.Mesh(ep=2, cp=2), batches(), params)


def test_with_the_aux_loss_the_counts_are_summed_over_both_axes_and_the_ledger_is_the_plan() -> None:
    step, params = moe_model()
    reference = sw.router_aux_loss(step, 0.1)
    composed = sw.context_parallel(sw.expert_parallel(reference, "ep", capacity_factor=1.0, drop_per_rank=True), "cp")
    mesh, batch = sw.Mesh(ep=2, cp=2), batches(1)[0]
    sw.testing.assert_equivalent(sw.context_parallel(sw.expert_parallel(reference, "ep"), "cp"), reference, mesh,
                                 batches(), params)
    plan = composed.plan(mesh, params, batch)
    assert [(a.op, a.axis) for a in plan.actions[0] if a.label == "router aux counts"] == [("psum", "ep"),
                                                                                          ("psum", "cp")]
    assert {"ppermute", "all_to_all"} <= {c.op for c in plan.collectives(0)}
    for rank, got in enumerate(_ledger(composed, mesh, params, batch)):
        want = [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert got == want, f"rank {rank}\nledger: {got}\nplan:   {want}"


def test_dp_by_cp_by_ep_with_zero_3_equals_the_single_device_step() -> None:
    step, params = moe_model()
    composed = sw.shard_params(sw.context_parallel(sw.expert_parallel(step, "ep"), "cp"), "dp", 3)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, ep=2, cp=2), batches(size=16), params)


def test_hf_mixtral_on_sdpa_cp_2_by_ep_2_equals_the_single_device_step() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        router_jitter_noise=0.0, attn_implementation="sdpa", experts_implementation="eager", bos_token_id=0,
        eos_token_id=0, sliding_window=None,
    )
    model = transformers.MixtralForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 8), generator=gen), torch.randint(32, (4, 8), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=MixtralDecoderLayer, example_input=data[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    reference = sw.router_aux_loss(step, 0.02)
    composed = sw.context_parallel(sw.expert_parallel(reference, "ep"), "cp")
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(ep=2, cp=2), data, params)
