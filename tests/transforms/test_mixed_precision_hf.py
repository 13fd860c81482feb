"""mixed_precision on Hugging Face Llama: the rotary embedding keeps its f32 ``inv_freq`` (as under
torch.autocast), and an embedding layer kept in f32 passes a mask the bf16/fp16 layers can read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402


def _llama(positions: int, attention: str = "eager", layers: int = 1) -> Any:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=positions, attn_implementation=attention))


def _own_loss(out: Any, _targets: Any) -> torch.Tensor:
    return out.loss


def test_rotary_angles_at_long_positions_match_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """With inv_freq rounded to bf16, cos at positions 512..1023 was 0.18 off; kept in f32, the cos the
    bf16 step's rotary embedding returns is torch.autocast's (which keeps it f32): within one bf16
    rounding (2^-8) of the f32 step's, where the autocast one is."""
    seq = 1024
    model = _llama(seq)
    ids = torch.randint(64, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = ({"input_ids": ids, "labels": ids}, None)
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=batch[0])
    seen: dict[str, Any] = {}
    forward = LlamaRotaryEmbedding.forward

    def spy(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        cos, sin = forward(self, x, position_ids)
        seen["inv_freq"], seen["cos"] = self.inv_freq.dtype, cos.detach().float()
        return cos, sin

    monkeypatch.setattr(LlamaRotaryEmbedding, "forward", spy)
    step = sw.train_step(chain, _own_loss, sw.optim.sgd(0.0))
    step(step.init(params), batch)
    exact = seen["cos"]
    bf16 = sw.mixed_precision(step, "params=f32,compute=bf16,output=f32")
    bf16(bf16.init(params), batch)
    assert seen["inv_freq"] == torch.float32
    ours = seen["cos"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch[0])
    autocast = seen["cos"]
    assert (autocast - exact).abs().max() <= 2**-8
    assert (ours - exact)[..., 512:, :].abs().max() <= 2**-8
    old = sw.mixed_precision(step, "params=f32,compute=bf16,output=f32,buffers=compute")
    old(old.init(params), batch)
    assert seen["inv_freq"] == torch.bfloat16 and (seen["cos"] - exact)[..., 512:, :].abs().max() > 0.1


@pytest.mark.parametrize("compute", ["bf16", "f16"])
def test_an_f32_embedding_with_left_padding_trains(compute: str) -> None:
    """The f32 embed layer builds eager attention's additive mask at finfo(float32).min; cast to bf16 or
    fp16 it was -inf, a fully masked (padding) row gave NaN and every step was skipped. Cast saturating,
    the step trains and stays within bf16's tolerance of the f32 step (test_mixed_precision.py)."""
    model = _llama(64, layers=2)
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:2, :6] = 0  # left padding
    batch = ({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, None)
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=batch[0])
    f32 = sw.train_step(chain, _own_loss, sw.optim.sgd(0.1))
    step = sw.mixed_precision(f32, f"compute={compute},output=f32", overrides={chain.names[0]: "compute=f32"},
                              loss_scale="dynamic" if compute == "f16" else None)
    _, metrics = step(step.init(params), batch)
    assert not bool(metrics["skipped"]) and bool(torch.isfinite(metrics["loss"]))
    sw.testing.assert_equivalent(step, f32, sw.Mesh(dp=1), [batch] * 3, params, rtol=1e-2)


@pytest.mark.parametrize("units", ["one layer", "encoder layers"])
def test_whispers_frozen_position_table_computes_in_bf16_and_trains(units: str) -> None:
    """Whisper's encoder position table is a frozen parameter (``requires_grad=False``), added to the
    bf16 convolution's output: kept in float32 as a buffer, it promoted the activations and the next
    bf16 Linear refused the step. Computed in bf16 as a weight (as FSDP2 casts frozen parameters), the
    step trains within bf16's tolerance of the float32 step, under ZeRO-3 too. (With the encoder layers as
    units, the table and the convolutions are a layer of their own, whose float32 output the next layer
    casts: that split trained before.)"""
    torch.manual_seed(0)
    model = T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, d_model=16, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, mask_time_prob=0.0, use_cache=False,
        suppress_tokens=None, begin_suppress_tokens=None))
    assert not model.model.encoder.embed_positions.weight.requires_grad
    g = torch.Generator().manual_seed(6)
    batches = []
    for _ in range(3):
        labels = torch.randint(3, 64, (4, 6), generator=g)  # the model makes its decoder inputs from them
        batches.append(({"input_features": torch.randn(4, 8, 16, generator=g), "labels": labels}, labels))
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    chain, params = sw.functionalize(model, units=None if units == "one layer" else WhisperEncoderLayer,
                                     example_input=batches[0][0])
    # The loss from the float32 logits (output=f32): the model's own is computed, and rounded, in bf16.
    f32 = sw.train_step(chain, lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                        sw.optim.sgd(0.1))
    bf16 = sw.mixed_precision(f32, "params=f32,compute=bf16,output=f32")
    sw.testing.assert_equivalent(bf16, f32, sw.Mesh(dp=1), batches, params, rtol=1e-2)
    # dp=2 rounds each half batch's gradient to bf16 where one device rounds the whole batch's once: up to
    # 2^-8 relative apart (test_mixed_precision.py's test_sharded_bf16_matches_single_device_bf16).
    sw.testing.assert_equivalent(sw.shard_params(bf16, "dp", stage=3), bf16, sw.Mesh(dp=2), batches, params,
                                 rtol=2**-8)
