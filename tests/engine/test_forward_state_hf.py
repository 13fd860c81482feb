"""Hugging Face models keep Python state and caches their forward sets from the input (rotary
``max_seq_len_cached`` and ``attention_scaling``, dynamic RoPE's ``inv_freq``): the checks of
engine/run/forward_state.py and ModuleCall's rebinding check must not refuse them where a step calls
a layer twice (accumulation=2, remat), and the steps equal the one-device step (float64 model and
loss: HF's own loss casts the logits to float32, which accumulation would round differently; no
dropout, whose masks are drawn per micro-batch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _llama(**rope: Any) -> Any:
    return T.LlamaForCausalLM(T.LlamaConfig(
        **_SMALL, num_key_value_heads=2, max_position_embeddings=8, attn_implementation="eager", **rope))


MODELS = {
    "llama": (lambda: _llama(), "LlamaDecoderLayer"),
    # positions past max_position_embeddings=8: the rotary embedding rebinds inv_freq and sets
    # max_seq_len_cached on the first call (from the capture's input: the same on every later call)
    "llama dynamic rope": (lambda: _llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "LlamaDecoderLayer"),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **_SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        attn_implementation="eager", experts_implementation="eager")), "MixtralDecoderLayer"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), "GPT2Block"),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(
        **_SMALL, max_position_embeddings=64, attn_implementation="eager", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)), "BertLayer"),
}

CUTS = {
    "dp1 accumulation=2": lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
    "remat": sw.remat,
}


def _token_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the model's float64."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _step(model: str, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    build, unit = MODELS[model]
    torch.manual_seed(0)
    module = build().double()
    units = next(type(m) for m in module.modules() if type(m).__name__ == unit)
    chain, params = sw.functionalize(module, units=units, example_input=batch)
    return sw.train_step(chain, _token_loss, sw.optim.sgd(0.1)), params


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_hf_caches_set_from_the_input_are_not_refused(model: str, cut: str) -> None:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(64, (4, 12), generator=g)
        batches.append(({"input_ids": ids}, ids))
    step, params = _step(model, batches[0][0])
    reference, _ = _step(model, batches[0][0])
    # raises where the step is refused or differs from the one-device step
    sw.testing.assert_equivalent(CUTS[cut](step), reference, sw.Mesh(dp=1), batches, params)


def test_dynamic_rope_rebinding_its_inv_freq_from_the_input_equals_torch() -> None:
    """Lengths 6, 12, 6 past max_position_embeddings=8: the rotary embedding rebinds inv_freq on the
    second call (growth) and the third (reset), each a function of the input, so dropping the rebound
    tensor after each call changes nothing and the one-device step equals torch's loop (the same
    float64 computation, no reduction between: exactly). The rebinding check exempts it."""
    g = torch.Generator().manual_seed(1)
    batches = [({"input_ids": ids}, ids) for ids in (torch.randint(64, (4, n), generator=g) for n in (6, 12, 6))]
    step, params = _step("llama dynamic rope", batches[0][0])
    torch.manual_seed(0)
    model = MODELS["llama dynamic rope"][0]().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = step.init(params)
    for batch, ids in batches:
        state, metrics = step(state, (batch, ids))
        opt.zero_grad()
        loss = _token_loss(model(**batch), ids)
        loss.backward()
        opt.step()
        assert float(metrics["loss"]) == loss.item()
