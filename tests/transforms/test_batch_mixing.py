"""A Hugging Face layer known to read other rows of its batch for a token's output (Doge's mixture of experts)
under the transforms that cut the batch.

``DogeCDMoE`` views its router's logits ``(batch, seq, 2 * keys)`` as ``(2, batch * seq, keys)``: each token
is routed with a token of the batch's other half. Under data parallel or a pipeline's micro-batches each part
of the batch routed its tokens with other partners: the first loss differed from the single-device step's by
9e-5 (relative), without an error. It is refused where the batch is cut, naming the module and why; where every
rank computes on the whole batch (a pipeline of one micro-batch) it is the single-device step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
from transformers.models.doge.modeling_doge import DogeDecoderLayer  # noqa: E402

VOCAB = 32


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _doge(is_moe: bool) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    config = T.DogeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, is_moe=is_moe,
                          num_experts=16, num_experts_per_tok=2, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (4, 8), generator=gen), torch.randint(0, VOCAB, (4, 8), generator=gen))
               for _ in range(2)]
    chain, params = sw.functionalize(T.DogeForCausalLM(config).double(), units=DogeDecoderLayer,
                                     example_input=batches[0][0])
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


@pytest.mark.parametrize(("cut", "words"), [
    (lambda s: sw.shard_params(s, "dp", 3), r"shard_params \(data parallel over axis 'dp'\)"),
    (lambda s: sw.pipeline(s, "pp", "1f1b", microbatches=2), r"pipeline with 2 micro-batches"),
    (lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
     r"shard_params \(data parallel over axis 'dp', accumulation=2\)"),
])
def test_a_router_reading_other_rows_is_refused_where_the_batch_is_cut(cut: Any, words: str) -> None:
    step, _, _ = _doge(is_moe=True)
    with pytest.raises(ValueError, match=(
            r"'model.layers.0.mlp' \(DogeCDMoE: its router's logits are viewed as \(2, batch \* seq, keys\).*"
            rf"Under {words} each rank \(or micro-batch\) calls the model on a part of the batch.*"
            r"Run it without cutting the batch")):
        cut(step)


def test_doge_moe_on_the_whole_batch_and_dense_doge_cut_are_the_single_device_step() -> None:
    step, params, batches = _doge(is_moe=True)
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", microbatches=1), step, sw.Mesh(pp=2), batches,
                                 params)
    dense, params, batches = _doge(is_moe=False)
    sw.testing.assert_equivalent(sw.shard_params(dense, "dp", 3), dense, sw.Mesh(dp=2), batches, params)


def _time_series_batches(missing_row: bool) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        past = torch.randn(8, 10, generator=g, dtype=torch.float64) + 3.0
        observed = torch.ones(8, 10, dtype=torch.float64)
        if missing_row:
            observed[5] = 0.0  # a series with no observation in its context window
        future = torch.randn(8, 4, generator=g, dtype=torch.float64) + 3.0
        out.append(({"past_values": past, "past_observed_mask": observed,
                     "past_time_features": torch.zeros(8, 10, 1, dtype=torch.float64), "future_values": future,
                     "future_time_features": torch.zeros(8, 4, 1, dtype=torch.float64)}, future))
    return out


class _Forecast(torch.nn.Module):
    """TimeSeriesTransformerForPrediction returning its own loss (an NLL over every row and future step)."""

    def __init__(self, default_scale: float | None) -> None:
        super().__init__()
        torch.manual_seed(1)
        config = T.TimeSeriesTransformerConfig(
            prediction_length=4, context_length=8, lags_sequence=[1, 2], num_time_features=1, d_model=8,
            encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=16, decoder_ffn_dim=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            encoder_layerdrop=0.0, decoder_layerdrop=0.0, default_scale=default_scale)
        self.model = T.TimeSeriesTransformerForPrediction(config).double()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch, use_cache=False).loss


def test_a_time_series_mean_scaler_is_refused_unless_its_default_scale_is_set() -> None:
    """The review (layers F11): a series with no observed value gets the batch's mean scale, and a step that cuts the
    batch computed it per share (4.3e-4 under ZeRO-3), without an error. With config.default_scale it is that."""
    for default_scale, missing_row in ((None, True), (1.0, True), (1.0, False)):
        chain, params = sw.functionalize(_Forecast(default_scale))
        step = sw.train_step(chain, lambda out, y: out, sw.optim.sgd(0.1))
        if default_scale is None:
            with pytest.raises(ValueError, match=r"TimeSeriesMeanScaler: a series with no observed value .* set "
                                                 r"config.default_scale.*not from the whole batch"):
                sw.shard_params(step, "dp", stage=3)
            continue
        zero3 = sw.shard_params(step, "dp", stage=3)
        sw.testing.assert_equivalent(zero3, step, sw.Mesh(dp=2), _time_series_batches(missing_row), params)
