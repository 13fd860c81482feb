"""A Region on a cross-attention is refused, naming it: its keys and values come from the encoder's output, an
argument the Region does not enter, so that output's gradient through the split projections is not summed over
the ranks. With BART's encoder blocks sequence parallel the ranks' gradients agreed (the replica check saw
nothing) and the step trained 5e-5 off one device; left replicated, the cross-attention trains as one device."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw

transformers = pytest.importorskip("transformers")
VOCAB = 64


class LogitsOnly(nn.Module):
    """BART returning its logits, so that it splits per layer in both stacks."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).logits


def _bart() -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None)
    model = LogitsOnly(transformers.BartForConditionalGeneration(config).double())
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        ids, labels = torch.randint(3, VOCAB, (4, 8), generator=g), torch.randint(3, VOCAB, (4, 8), generator=g)
        batches.append(({"input_ids": ids, "labels": labels}, labels))
    bart = transformers.models.bart.modeling_bart
    chain, params = sw.functionalize(model, units=(bart.BartEncoderLayer, bart.BartDecoderLayer),
                                     example_input=batches[0][0])

    def loss(logits: Tensor, labels: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def _attention(pattern: str) -> dict[str, object]:
    return {pattern: sw.tp.Region(heads=("num_heads",), local=("embed_dim",)),
            pattern + ".[qkv]_proj": sw.tp.Colwise(), pattern + ".out_proj": sw.tp.Rowwise()}


MLPS = {"*.layers.*.fc1": sw.tp.Colwise(), "*.layers.*.fc2": sw.tp.Rowwise()}


def test_a_region_on_a_cross_attention_is_refused_naming_it() -> None:
    step, params, batches = _bart()
    plan = {**_attention("*.self_attn"), **_attention("*.encoder_attn"), **MLPS}
    split = sw.tensor_parallel(step, "tp", plan, sequence_parallel="model.model.encoder.layers.*")
    with pytest.raises(sw.collectives.RankFailed, match=r"the Region on 'model.model.decoder.layers.0.encoder_attn' "
                       r"\(BartAttention\) is a cross-attention: its keys and values come from 'key_value_states'.*"
                       r"Leave the cross-attention out of the plan"):
        sw.launch(lambda: split(split.init(params, sw.Mesh(tp=2)), batches[0]), world=2)


def test_the_cross_attention_left_replicated_trains_as_one_device() -> None:
    step, params, batches = _bart()
    plan = {**_attention("*.self_attn"), **MLPS}
    split = sw.tensor_parallel(step, "tp", plan, sequence_parallel="model.model.encoder.layers.*")
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params)
