"""transformers' output capturing, read in one place (engine/model/hf_collecting.py): a model collecting its
layers' outputs while they run cannot be split into units, and is refused by name. This fails loudly when
transformers changes the private collector shardwise reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw
from shardwise.engine.model.hf_collecting import collecting_now

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB = 32


def _mixtral() -> Any:
    torch.manual_seed(0)
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
        experts_implementation="eager", bos_token_id=0, eos_token_id=0,
    ))


def test_the_collector_read_is_transformers_own() -> None:
    """What a layer sees while the model's forward runs: the outputs asked for, and nothing otherwise."""
    from transformers.utils import output_capturing

    assert hasattr(output_capturing, "_active_collector"), "transformers moved its output collector"
    model = _mixtral()
    seen: list[tuple[str, ...]] = []
    model.model.layers[1].register_forward_pre_hook(lambda *_: seen.append(collecting_now()))
    ids = torch.randint(0, VOCAB, (2, 5))
    model(ids, output_router_logits=True, output_attentions=True)
    model(ids)
    assert set(seen[0]) == {"router_logits", "attentions"} and seen[1] == ()
    assert collecting_now() == ()


class _RouterLogitsInTheCall(nn.Module):
    """The model asked for its routers' logits in the call, not in its config."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, output_router_logits=True).logits


def test_a_model_collecting_its_layers_outputs_is_refused_when_split_naming_them() -> None:
    """SwitchTransformers computes its z-loss from the router logits its layers collect; split per block, the
    head found none and transformers failed with ``torch.cat(): expected a non-empty list``."""
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    model = _RouterLogitsInTheCall(_mixtral())
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(sw.FunctionalizeError, match=r"collects its layers' router_logits while they run \(unit "
                                                    r"'model\.model\.layers\.0' among them\).*"
                                                    r"output_router_logits=False.*units=None.*sw\.router_aux_loss"):
        sw.functionalize(model, units=MixtralDecoderLayer, example_input=ids)
    sw.functionalize(model, units=None, example_input=ids)  # one layer: its forward collects as it runs


def test_a_model_forcing_its_hidden_states_is_refused_without_advice_that_cannot_work() -> None:
    """Wav2Vec2ForSequenceClassification's forward (transformers' filter_output_hidden_states) sets
    output_hidden_states=True on its model whatever the config says: the refusal told the user to turn it off, which
    changed nothing; it names the class that forces it and units=None."""
    torch.manual_seed(0)
    model = T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(4, 4), conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        num_labels=3, output_hidden_states=False, use_weighted_layer_sum=False, layerdrop=0.0))
    layer = T.models.wav2vec2.modeling_wav2vec2.Wav2Vec2EncoderLayer
    with pytest.raises(sw.FunctionalizeError, match=r"Wav2Vec2ForSequenceClassification forces "
                                                    r"output_hidden_states=True .* cannot be turned off: split with "
                                                    r"units=None"):
        sw.functionalize(model, units=layer, example_input={"input_values": torch.randn(2, 400)})
