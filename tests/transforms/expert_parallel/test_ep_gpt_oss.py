"""expert_parallel on GPT-OSS: ``GptOssMLP``'s router called as it is, its experts run as ``GptOssExperts`` does.

The router (``GptOssTopKRouter``, with a bias) takes the top k of its logits and a softmax over those k; the
experts hold ``gate_up_proj`` [E, H, 2I] (gate and up interleaved) and ``down_proj`` [E, I, H], each with
a bias [E, 2I] / [E, H] cut over the axis with it, and their activation is the class's own clamped SwiGLU
(``_apply_gate``: ``swiglu_limit`` and ``swiglu_alpha``). HF initializes the expert biases to zero and
the router near uniform: here they are drawn, and the limit is small enough to clamp, so that every part
counts.

float64 on thread ranks; the distributed block sums a token's k expert outputs in another order than HF's
loop over experts: equal to float64 rounding (assert_equivalent's default).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw

transformers = pytest.importorskip("transformers")

from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

from ._hf_family import (  # noqa: E402
    VOCAB,
    all_to_alls_of_a_plan_run,
    assert_equal_under_both_stacks,
    assert_router_aux_loss_is_hfs,
    token_batches,
)
from ._hf_family import changed as _changed  # noqa: E402
from ._hf_family import lm_loss as _loss  # noqa: E402
from ._hf_family import under_ep as _ep  # noqa: E402

EXPERT_TENSORS = ("down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias")


def _config() -> Any:
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        swiglu_limit=0.5, max_position_embeddings=16, attn_implementation="eager", experts_implementation="eager",
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )


def _drawn(model: Any, gen: torch.Generator) -> Any:
    for module in model.modules():
        if isinstance(module, modeling_gpt_oss.GptOssTopKRouter):
            module.weight.data.normal_(0.0, 1.0, generator=gen)
            module.bias.data.normal_(0.0, 1.0, generator=gen)
        elif isinstance(module, modeling_gpt_oss.GptOssExperts):
            for p in (module.gate_up_proj, module.down_proj):
                p.data.normal_(0.0, 0.5, generator=gen)
            for p in (module.gate_up_proj_bias, module.down_proj_bias):
                p.data.normal_(0.0, 0.5, generator=gen)
    return model


def _model() -> tuple[Any, sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    model = _drawn(transformers.GptOssForCausalLM(_config()).double(), gen)
    data = token_batches(gen)
    chain, params = sw.functionalize(model, units=modeling_gpt_oss.GptOssDecoderLayer, example_input=data[0][0])
    return model, sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9)), params, data


@pytest.mark.parametrize("stack", ["ep", "dp x ep zero3"])
def test_gpt_oss_under_ep_equals_the_single_device_step(stack: str) -> None:
    """The experts' weights and biases are split; equal to float64 rounding over two steps."""
    _, step, params, data = _model()
    ep, mesh = _ep(step, stack)
    split = sorted(name for (_layer, name) in ep.split.tensor_splits(ep.chain, mesh))
    assert split == [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in EXPERT_TENSORS]
    sw.testing.assert_equivalent(ep, step, mesh, data, params)


def test_the_split_block_computes_the_blocks_output_and_router_scores() -> None:
    """On one device the rewritten forward is GptOssMLP's: the same output (to rounding: another summation
    order) and the router's scores it returns beside it. The clamp and the biases count here: without them
    the output differs."""
    from shardwise.transforms.expert_parallel.block_forward import EPForward
    from shardwise.transforms.expert_parallel.blocks import find_blocks

    gen = torch.Generator().manual_seed(5)
    block = _drawn(modeling_gpt_oss.GptOssMLP(_config()).double(), gen)
    x = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    (found,) = find_blocks(block, "mlp")
    want, want_scores = block(x)
    got, scores = EPForward(block, found, "ep", None, "mlp")(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(scores, want_scores)
    with torch.no_grad():
        block.experts.limit = 1e9  # no clamp
        assert not torch.allclose(block(x)[0], want, rtol=1e-3)
        block.experts.limit = 0.5
        block.experts.down_proj_bias.zero_()
        assert not torch.allclose(block(x)[0], want, rtol=1e-3)


def test_on_one_device_router_aux_loss_is_hf_gpt_osss_and_under_ep_it_equals_the_single_device_step() -> None:
    """HF GPT-OSS's aux loss (``output_router_logits=True``) is of its router's logits with the bias: the
    softmax over all experts, the top k counted (Mixtral's ``load_balancing_loss_func``, summed in float32:
    agreement to float32's rounding)."""
    model, step, params, data = _model()
    assert_router_aux_loss_is_hfs(model, step, params, data[0], 0.5)
    assert_equal_under_both_stacks(sw.router_aux_loss(step, 0.5), params, data)


def test_every_rank_issues_exactly_the_collectives_its_plan_lists() -> None:
    _, step, params, data = _model()
    # Two MoE layers, each a dispatch and a combine forward and their transposes in backward.
    assert all_to_alls_of_a_plan_run(step, params, data[0]) == 2 * 2 * 2


@pytest.mark.parametrize("part", ["GptOssMLP", "GptOssExperts"])
def test_a_block_or_experts_whose_code_changed_is_refused(part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = getattr(modeling_gpt_oss, part)
    monkeypatch.setattr(cls, "forward", _changed(cls.forward))
    _, step, _, _ = _model()
    with pytest.raises(ValueError, match=rf"expert_parallel: .*is a {part} whose forward is not the code "
                                         "expert_parallel reproduces"):
        sw.expert_parallel(step, "ep")


def test_experts_of_another_layout_are_checked_for_their_count() -> None:
    """With ``experts=`` the weights are read in their own layout: only their expert count is checked."""
    from shardwise.transforms.expert_parallel import moe_dispatch_combine
    from shardwise.transforms.expert_parallel.router import Routing

    x, logits = torch.randn(4, 3), torch.randn(4, 2)
    routing = Routing(torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1))
    gate_up, down = torch.randn(2, 3, 8), torch.randn(2, 4, 3)  # GPT-OSS's layout: [E, H, 2I], [E, I, H]
    out = moe_dispatch_combine(x, logits, gate_up, down, "ep", top_k=1, routing=routing, aux_loss=False,
                               experts=lambda rows: 2 * rows)
    torch.testing.assert_close(out.output, 2 * x)
    with pytest.raises(ValueError, match=r"must be \(2, 2 \* intermediate, 3\)"):  # read as Mixtral's without it
        moe_dispatch_combine(x, logits, gate_up, down, "ep", top_k=1, routing=routing, aux_loss=False)
    with pytest.raises(ValueError, match=r"this rank's expert weights must hold 2 experts on dim 0"):
        moe_dispatch_combine(x, logits, gate_up[:1], down, "ep", top_k=1, routing=routing, aux_loss=False,
                             experts=lambda rows: rows)


def test_router_aux_loss_refuses_a_router_whose_code_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """router_aux_loss computes the logits HF's loss reads as GptOssTopKRouter does (with its bias)."""
    cls = modeling_gpt_oss.GptOssTopKRouter
    monkeypatch.setattr(cls, "forward", _changed(cls.forward))
    _, step, _, _ = _model()
    with pytest.raises(ValueError, match=r"router_aux_loss: .*router is a GptOssTopKRouter whose forward is not the "
                                         "code router_aux_loss reproduces"):
        sw.router_aux_loss(step, 0.1)
