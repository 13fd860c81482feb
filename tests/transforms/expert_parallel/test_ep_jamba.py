"""expert_parallel on Jamba: a hybrid of Mamba and attention layers, with a MoE block on some of them.

``JambaSparseMoeBlock``'s router (``router``, a ``JambaTopKRouter``: softmax in float32, the top k, not
renormalized) is called as it is and its choice handed to ``moe_dispatch_combine(routing=...)``; its experts
are Mixtral's code. The layers here: 0 Mamba + MLP, 1 attention + MoE, 2 Mamba + MLP, 3 Mamba + MoE,
4 attention + MLP, 5 Mamba + MoE: every kind of layer, the dense ones left as they are.

float64 on thread ranks. The distributed block sums a token's k expert outputs in another order than
HF's loop over experts: equal to float64 rounding (assert_equivalent's default). HF's router rounds its
weights to float32 in a float64 model: the first step routes the same tokens with the same parameters; after
it the parameters differ by float64 rounding (measured 2e-14 relative), which turns no weight here into
another float32 value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw

transformers = pytest.importorskip("transformers")

from transformers.models.jamba import modeling_jamba  # noqa: E402

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

MOE_LAYERS = (1, 3, 5)


def _model(seed: int = 0) -> tuple[Any, sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    cfg = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=3, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        max_position_embeddings=16, attn_implementation="eager", experts_implementation="eager", bos_token_id=0,
        eos_token_id=0, pad_token_id=1,
    )
    model = transformers.JambaForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():  # HF's init (std 0.02) routes near uniformly: make the choice matter
        if isinstance(module, modeling_jamba.JambaTopKRouter):
            module.weight.data.normal_(0.0, 1.0, generator=gen)
    data = token_batches(gen)
    units = (modeling_jamba.JambaAttentionDecoderLayer, modeling_jamba.JambaMambaDecoderLayer)
    chain, params = sw.functionalize(model, units=units, example_input=data[0][0])
    return model, sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9)), params, data


@pytest.mark.parametrize("stack", ["ep", "dp x ep zero3"])
def test_jamba_under_ep_equals_the_single_device_step(stack: str) -> None:
    """Only the MoE layers' experts are split; equal to float64 rounding over two steps."""
    _, step, params, data = _model()
    ep, mesh = _ep(step, stack)
    split = sorted(name for (_layer, name) in ep.split.tensor_splits(ep.chain, mesh))
    assert split == [f"model.layers.{i}.feed_forward.experts.{w}" for i in MOE_LAYERS
                     for w in ("down_proj", "gate_up_proj")]
    sw.testing.assert_equivalent(ep, step, mesh, data, params)


def test_the_layers_without_a_moe_block_keep_their_own_code() -> None:
    """expert_parallel installs its forward in the MoE blocks only: in a MoE layer every other module (the
    Mamba mixer, the attention) runs its class's forward, and a layer without one (a dense JambaMLP after
    Mamba or attention, the embedding, the head) keeps its function, wrapped only to sum its replicated
    gradients over the axis."""
    model, step, _, _ = _model()
    kinds = [(type(layer).__name__[5:-12], type(layer.feed_forward).__name__) for layer in model.model.layers]
    assert kinds == [("Mamba", "JambaMLP"), ("Attention", "JambaSparseMoeBlock"), ("Mamba", "JambaMLP"),
                     ("Mamba", "JambaSparseMoeBlock"), ("Attention", "JambaMLP"), ("Mamba", "JambaSparseMoeBlock")]
    ep = sw.expert_parallel(step, "ep")
    moe_layers = {f"model.layers.{i}" for i in MOE_LAYERS}
    for before, after in zip(step.chain, ep.chain, strict=True):
        inner = after.fn.fn  # inside the gradient sums
        replaced = [path for path, m in inner.replicas.module.named_modules() if "forward" in vars(m)]
        if before.name in moe_layers:
            assert replaced == ["feed_forward"], before.name
        else:
            assert inner is before.fn and replaced == [], before.name


def test_on_one_device_router_aux_loss_is_hf_jambas_and_under_ep_it_equals_the_single_device_step() -> None:
    """HF Jamba's aux loss (``output_router_logits=True``) pools its MoE layers' router logits (Mixtral's
    ``load_balancing_loss_func``, summed in float32: agreement to float32's rounding)."""
    model, step, params, data = _model()
    assert_router_aux_loss_is_hfs(model, step, params, data[0], 0.5)
    assert_equal_under_both_stacks(sw.router_aux_loss(step, 0.5), params, data)


def test_every_rank_issues_exactly_the_collectives_its_plan_lists() -> None:
    _, step, params, data = _model()
    # Three MoE layers, each a dispatch and a combine forward and their transposes in backward.
    assert all_to_alls_of_a_plan_run(step, params, data[0]) == len(MOE_LAYERS) * 2 * 2


@pytest.mark.parametrize("part", ["JambaSparseMoeBlock", "JambaExperts"])
def test_a_block_or_experts_whose_code_changed_is_refused(part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = getattr(modeling_jamba, part)
    monkeypatch.setattr(cls, "forward", _changed(cls.forward))
    _, step, _, _ = _model()
    with pytest.raises(ValueError, match=rf"expert_parallel: .*is a {part} whose forward is not the code "
                                         "expert_parallel reproduces"):
        sw.expert_parallel(step, "ep")


class _ScaledRouter(modeling_jamba.JambaTopKRouter):
    """A user's router: Jamba's, its logits doubled."""

    def forward(self, hidden_states: torch.Tensor) -> Any:
        logits, weights, index = super().forward(2 * hidden_states)
        return logits, weights, index


def test_router_aux_loss_reads_only_jambas_own_router(monkeypatch: pytest.MonkeyPatch) -> None:
    """router_aux_loss computes the logits HF's loss reads as JambaTopKRouter does: another router class, or
    that class's code changed, would be another loss without an error. expert_parallel calls the router as it
    is, so it splits a block with another router (here equal to one device)."""
    model, _, _, data = _model()
    for layer in MOE_LAYERS:
        block = model.model.layers[layer].feed_forward
        swapped = _ScaledRouter(model.config).double()
        swapped.load_state_dict(block.router.state_dict())
        block.router = swapped
    units = (modeling_jamba.JambaAttentionDecoderLayer, modeling_jamba.JambaMambaDecoderLayer)
    chain, params = sw.functionalize(model, units=units, example_input=data[0][0])
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"router_aux_loss: model.layers.1.feed_forward.router is a _ScaledRouter .*"
                                         r"not the JambaSparseMoeBlock's own JambaTopKRouter"):
        sw.router_aux_loss(step, 0.1)
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), data, params)
    _, step, _, _ = _model()
    monkeypatch.setattr(modeling_jamba.JambaTopKRouter, "forward",
                        _changed(modeling_jamba.JambaTopKRouter.forward))
    with pytest.raises(ValueError, match=r"router_aux_loss: .*router is a JambaTopKRouter whose forward is not the "
                                         "code router_aux_loss reproduces"):
        sw.router_aux_loss(step, 0.1)
