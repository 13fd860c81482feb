"""An encoder-decoder split per layer in both stacks: its encoder's layers, a bridge, its decoder's.

Code with parameters runs between the encoder's last layer and the decoder's first (the encoder's final
norm, the decoder's embedding and masks), and the decoder's layers receive a second stream, the encoder's
output (``encoder_hidden_states``). ``units=(EncoderLayer, DecoderLayer)`` cuts a ``bridge`` layer there,
computed as ``head`` and ``embed`` are: its output is the decoder's carry, the encoder's output in it, so
the encoder's layers get their gradient through every decoder layer's cross-attention and the bridge.

The one-device step of the split chain trains as the model split as one layer (``units=None``) does, to the
bit, and ZeRO-3 and a pipeline of it as that one-device step (``assert_equivalent``), in float64.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.engine.model.functionalize import FunctionalizeError, functionalize

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ, BATCH = 48, 8, 4


def bart(dropout: float = 0.0) -> nn.Module:
    cfg = T.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=dropout,
        attention_dropout=dropout, max_position_embeddings=32, use_cache=False,
    )
    return T.BartForConditionalGeneration(cfg).double()


def whisper(dropout: float = 0.0) -> nn.Module:
    return T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, d_model=16, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        dropout=dropout, attention_dropout=dropout, activation_dropout=dropout, mask_time_prob=0.0, use_cache=False,
        suppress_tokens=None, begin_suppress_tokens=None)).double()


class LogitsOnly(nn.Module):
    """The model, returning only its logits: what it returns beside them (the encoder's output as the
    encoder computed it) the code after the decoder's layers could not give."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids).logits


class SpeechLogitsOnly(LogitsOnly):
    def forward(self, input_features: Tensor, labels: Tensor) -> Tensor:  # type: ignore[override]
        return self.model(input_features=input_features, labels=labels).logits


class LabelledLogitsOnly(LogitsOnly):
    """T5 makes its decoder's input ids from the labels."""

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:  # type: ignore[override]
        return self.model(input_ids=input_ids, labels=labels).logits


def t5(dropout: float = 0.0) -> nn.Module:
    cfg = T.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_decoder_layers=2, num_heads=2,
        dropout_rate=dropout, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    )
    return T.T5ForConditionalGeneration(cfg).double()


def bart_batches(n: int = 2) -> list[tuple[dict[str, Tensor], Tensor]]:
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(n):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        batches.append(({"input_ids": ids}, torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)))
    return batches


def t5_batches(n: int = 2) -> list[tuple[dict[str, Tensor], Tensor]]:
    return [({"input_ids": x["input_ids"], "labels": y}, y) for x, y in bart_batches(n)]


def whisper_batches(n: int = 2) -> list[tuple[dict[str, Tensor], Tensor]]:
    g = torch.Generator().manual_seed(6)
    batches = []
    for _ in range(n):
        labels = torch.randint(3, 64, (BATCH, 6), generator=g)  # the model makes its decoder inputs from them
        features = torch.randn(BATCH, 8, 16, generator=g, dtype=torch.float64)
        batches.append(({"input_features": features, "labels": labels}, labels))
    return batches


def bart_layers() -> tuple[type[nn.Module], type[nn.Module]]:
    bart_module = T.models.bart.modeling_bart
    return bart_module.BartEncoderLayer, bart_module.BartDecoderLayer


def whisper_layers() -> tuple[type[nn.Module], type[nn.Module]]:
    whisper_module = T.models.whisper.modeling_whisper
    return whisper_module.WhisperEncoderLayer, whisper_module.WhisperDecoderLayer


def t5_layers() -> tuple[type[nn.Module]]:
    return (T.models.t5.modeling_t5.T5Block,)  # one class for both stacks' blocks


# family -> (the wrapped model, its batches, its unit classes, its encoder's layers, its decoder's)
FAMILIES = {
    "bart": (lambda dropout=0.0: LogitsOnly(bart(dropout)), bart_batches, bart_layers,
             [f"model.model.encoder.layers.{i}" for i in range(2)],
             [f"model.model.decoder.layers.{i}" for i in range(2)]),
    "whisper": (lambda dropout=0.0: SpeechLogitsOnly(whisper(dropout)), whisper_batches, whisper_layers,
                [f"model.model.encoder.layers.{i}" for i in range(2)], ["model.model.decoder.layers.0"]),
    "t5": (lambda dropout=0.0: LabelledLogitsOnly(t5(dropout)), t5_batches, t5_layers,
           [f"model.encoder.block.{i}" for i in range(3)], [f"model.decoder.block.{i}" for i in range(2)]),
}


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def split(family: str, units: Any = "both") -> tuple[Any, Any, list[Any]]:
    make, batches, layers, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    given = layers() if units == "both" else units
    data = batches()
    chain, params = functionalize(make(), units=given, example_input=data[0][0])
    return chain, params, data


@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_stacks_split_per_layer_with_a_bridge_between(family: str) -> None:
    _, _, _, encoder, decoder = FAMILIES[family]
    chain, params, _ = split(family)  # checked bitwise against the module on the example
    assert chain.names == ("embed", *encoder, "bridge", *decoder, "head")
    # The encoder's final norm and the decoder's embedding run in the bridge; a table the encoder's
    # embedding reads too (BART's and T5's shared one) is the embed's, tied there.
    bridge = chain["bridge"]
    assert not any(name.startswith((*encoder, *decoder)) for name in bridge.param_names)
    if family == "bart":
        assert bridge.ties["model.model.shared.weight"] == ("embed", "model.model.shared.weight")
        assert "model.model.decoder.layernorm_embedding.weight" in params["bridge"]
    elif family == "whisper":  # its encoder ends in a layer norm: the bridge runs it
        assert "model.model.encoder.layer_norm.weight" in params["bridge"]
        assert "model.model.decoder.embed_tokens.weight" in params["bridge"]
    else:
        assert bridge.ties["model.shared.weight"] == ("embed", "model.shared.weight")
        assert "model.encoder.final_layer_norm.weight" in params["bridge"]


def trained(chain: Any, params: Any, batches: list[Any]) -> dict[str, Tensor]:
    """Every parameter after SGD on ``batches``, by its name in the model."""
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    state = step.init(params)
    for batch in batches:
        state, _ = step(state, batch)
    return {name: t for layer in state.params.values() for name, t in layer.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_encoder_layers_train_through_the_decoders_cross_attention_as_in_one_layer(family: str) -> None:
    """The encoder's layers reach the loss only through the decoder's layers (its output is their
    ``encoder_hidden_states``) and the bridge: their update equals that of the model as one layer."""
    chain, params, batches = split(family)
    whole, whole_params, _ = split(family, units=None)
    before = {name: t for layer in params.values() for name, t in layer.items()}
    got, expected = trained(chain, params, batches[:1]), trained(whole, whole_params, batches[:1])
    assert got.keys() == expected.keys()
    encoder = [name for name in got if name.startswith(tuple(FAMILIES[family][3]))]
    assert encoder and all(not torch.equal(got[name], before[name]) for name in encoder if name.endswith("weight"))
    assert all(torch.equal(got[name], want) for name, want in expected.items())  # the same ops, in the same order


@pytest.mark.parametrize("one_stack", [False, True], ids=["both stacks", "encoder layers"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_with_dropout_the_bridge_and_the_head_draw_what_the_module_draws(family: str, one_stack: bool) -> None:
    """The bridge and ``head`` run forward again from the start and discard what comes before their
    carried state, a dropout in a module that holds units among it (BART's encoder drops its embedding):
    the draws of that replay are undone where it reaches the carried state, so the code after draws what
    it draws in the module. functionalize's check on the example compares the chain with the module
    bitwise, in training mode (it failed, the encoder's layers alone as units too)."""
    make, batches, layers, encoder, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = make(0.1)
    assert model.training
    units = encoder if one_stack else layers()
    data = batches()
    chain, params = functionalize(model, units=units, example_input=data[0][0])
    assert ("bridge" in chain) != one_stack
    # Recomputed in the backward, each layer draws again what it drew in its forward.
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    sw.testing.assert_equivalent(sw.remat(step), step, sw.Mesh(dp=1), data, params)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zero3_and_a_pipeline_of_both_stacks_match_the_single_device_step(family: str) -> None:
    chain, params, batches = split(family)
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", stage=3), step, sw.Mesh(dp=2), batches, params)
    pipelined = sw.pipeline(step, "pp", "1f1b", microbatches=2)
    sw.testing.assert_equivalent(pipelined, step, sw.Mesh(pp=2), batches, params)


def test_paths_across_both_stacks_split_as_the_classes_do() -> None:
    chain, _, _ = split("bart")
    paths = [name for name in chain.names if ".layers." in name]
    by_paths, _, _ = split("bart", units=["model.model.encoder.layers", "model.model.decoder.layers"])
    assert by_paths.names == chain.names
    listed, _, _ = split("bart", units=paths)
    assert listed.names == chain.names


def test_the_encoders_output_returned_beside_the_decoder_stays_refused_naming_it() -> None:
    """Unwrapped, BART returns ``encoder_last_hidden_state``, the last encoder layer's output as it is:
    ``head`` has only the last decoder layer's, and is refused by name."""
    data = bart_batches()
    with pytest.raises(
        FunctionalizeError,
        match=r"the code after the last unit \(layer 'head'\) uses the output of unit 'model\.encoder\.layers\.1' "
        r"and returns it as it is.*Wrap the model in a module whose forward returns only what the loss reads",
    ):
        functionalize(bart(), units=bart_layers(), example_input=data[0][0])


def test_a_class_list_naming_a_class_the_model_lacks_is_refused_naming_it() -> None:
    encoder_layer, _ = bart_layers()
    with pytest.raises(
        FunctionalizeError, match=r"units=\(BartEncoderLayer, WhisperDecoderLayer\).*no WhisperDecoderLayer"
    ):
        functionalize(LogitsOnly(bart()), units=(encoder_layer, whisper_layers()[1]),
                      example_input=bart_batches()[0][0])


def test_classes_and_paths_mixed_are_refused_naming_the_class() -> None:
    encoder_layer, _ = bart_layers()
    with pytest.raises(FunctionalizeError, match=r"mixes submodule paths and the class BartEncoderLayer"):
        functionalize(LogitsOnly(bart()), units=[encoder_layer, "model.model.decoder.layers"],
                      example_input=bart_batches()[0][0])


class _Cross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, d: Tensor, memory: Tensor, bias: Tensor) -> Tensor:
        return torch.tanh(self.q(d) + memory.mean(1, keepdim=True) + bias)


class HandsATableToBothStacks(nn.Module):
    """An encoder and a decoder in two containers, the decoder's layers given the encoder's output
    (normed) and a bias the code before the encoder made from ``table.weight``: the bridge, which records
    what the decoder's layers receive, computes it, so it holds the table too (tied to ``embed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.table = nn.Embedding(SEQ, 4)  # read by attribute: its module never runs
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.encoder_norm = nn.LayerNorm(4)
        self.decoder_embed = nn.Embedding(VOCAB, 4)
        self.decoder = nn.ModuleList(_Cross() for _ in range(2))
        self.out = nn.Linear(4, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids[: len(ids)]  # not traceable by fx: split by recording its calls
        bias = self.table.weight[: ids.shape[1]] * 2
        h = self.embed(ids) + bias
        for layer in self.encoder:
            h = layer(h)
        memory = self.encoder_norm(h)
        d = self.decoder_embed(ids.flip(-1))
        for layer in self.decoder:
            d = layer(d, memory, bias)
        return self.out(d)


def test_a_value_made_before_the_encoder_and_handed_to_the_decoder_is_computed_by_the_bridge() -> None:
    torch.manual_seed(0)
    model = HandsATableToBothStacks().double()
    batches = [(x["input_ids"], y) for x, y in bart_batches()]
    chain, params = functionalize(model, units=["encoder", "decoder"], example_input=batches[0][0])
    assert chain.names == ("embed", "encoder.0", "encoder.1", "bridge", "decoder.0", "decoder.1", "head")
    assert chain["bridge"].ties == {"table.weight": ("embed", "table.weight")}
    assert sorted(params["bridge"]) == ["decoder_embed.weight", "encoder_norm.bias", "encoder_norm.weight"]
    whole, whole_params = functionalize(model, example_input=batches[0][0])
    got, expected = trained(chain, params, batches), trained(whole, whole_params, batches)
    assert got.keys() == expected.keys()
    assert not torch.equal(got["table.weight"], model.table.weight)  # it trained, through both stacks
    assert all(torch.equal(got[name], want) for name, want in expected.items())


class _Emits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        y = torch.tanh(self.linear(h))
        return y, y * 2


class _Takes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, d: Tensor, side: Tensor) -> Tensor:
        return torch.tanh(self.linear(d) + side)


class HandsAnOutputAcrossTheBridge(nn.Module):
    """The decoder's layers receive what the encoder's last layer returns beside its hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(_Emits() for _ in range(2))
        self.project = nn.Linear(4, 4)
        self.decoder = nn.ModuleList(_Takes() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = x[: len(x)]  # not traceable by fx: split by recording its calls
        for layer in self.encoder:
            h, side = layer(h)
        d = self.project(h)
        for layer in self.decoder:
            d = layer(d, side)
        return d


def test_an_output_handed_to_the_units_after_the_bridge_is_refused_naming_both() -> None:
    """Only the hidden state of the units before a bridge passes into it: a unit's other output can pass
    on only to the later units of its own loop (as T5's position bias does)."""
    with pytest.raises(
        FunctionalizeError,
        match=r"unit 'encoder\.1' returns a tensor at output\[1\] besides its hidden state, and unit 'decoder\.0', "
        r"after the code between them, receives it.*units=None",
    ):
        functionalize(HandsAnOutputAcrossTheBridge().double(), units=["encoder", "decoder"],
                      example_input=torch.randn(2, 4, dtype=torch.float64))


class DecoderInputsLogitsOnly(LogitsOnly):
    """Pegasus and Marian make no decoder input from the encoder's: the batch gives it."""

    def forward(self, input_ids: Tensor, decoder_input_ids: Tensor) -> Tensor:  # type: ignore[override]
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


@pytest.mark.parametrize("family", ["MBart", "Pegasus", "Marian"])
def test_bart_like_encoder_decoders_split_in_both_stacks_and_train_as_one_layer(family: str) -> None:
    """mBART and Pegasus end their encoder in a layer norm (the bridge runs it), Marian does not; with
    dropout in training mode the split is checked bitwise against the module, and without, one step
    trains every parameter as the model split as one layer."""
    modeling = getattr(getattr(T.models, family.lower()), f"modeling_{family.lower()}")
    units = (getattr(modeling, f"{family}EncoderLayer"), getattr(modeling, f"{family}DecoderLayer"))
    config_class = getattr(T, f"{family}Config")
    model_class = T.MarianMTModel if family == "Marian" else getattr(T, f"{family}ForConditionalGeneration")
    batches = [({"input_ids": x["input_ids"], "decoder_input_ids": y}, y) for x, y in bart_batches()]
    for dropout in (0.1, 0.0):
        torch.manual_seed(0)
        config = config_class(
            vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=dropout,
            attention_dropout=dropout, max_position_embeddings=32, use_cache=False, pad_token_id=0,
            decoder_start_token_id=1, eos_token_id=2, bos_token_id=1,
        )
        model = DecoderInputsLogitsOnly(model_class(config).double())
        chain, params = functionalize(model, units=units, example_input=batches[0][0])  # checked bitwise
        assert "bridge" in chain
    whole, whole_params = functionalize(model, example_input=batches[0][0])
    got, expected = trained(chain, params, batches[:1]), trained(whole, whole_params, batches[:1])
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], want) for name, want in expected.items())


class AttendsToEveryEncoderLayer(HandsAnOutputAcrossTheBridge):
    """The decoder's layers receive the first encoder layer's output as well as the last's."""

    def forward(self, x: Tensor) -> Tensor:
        h = x[: len(x)]  # not traceable by fx: split by recording its calls
        outputs = []
        for layer in self.encoder:
            h, _ = layer(h)
            outputs.append(h)
        d = self.project(h)
        for layer in self.decoder:
            d = layer(d, outputs[0])
        return d


def test_the_bridge_handing_on_an_earlier_units_output_is_refused_naming_the_unit() -> None:
    """Only the last encoder layer's output passes into the bridge: one the decoder's layers receive from an
    earlier encoder layer would be its input, passed through."""
    with pytest.raises(
        FunctionalizeError,
        match=r"the code between units 'encoder\.1' and 'decoder\.0' \(layer 'bridge'\) uses the output of unit "
        r"'encoder\.0' and hands it to the units after it",
    ):
        functionalize(AttendsToEveryEncoderLayer().double(), units=["encoder", "decoder"],
                      example_input=torch.randn(2, 4, dtype=torch.float64))


class ThreeStacks(nn.Module):
    """Three loops of blocks, a norm between each: two bridges."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
                                  for _ in range(3))
        self.after_a, self.after_b = nn.LayerNorm(4), nn.LayerNorm(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = x[: len(x)]  # not traceable by fx: split by recording its calls
        for block in self.a:
            h = block(h)
        h = self.after_a(h)
        for block in self.b:
            h = block(h)
        h = self.after_b(h) + h
        for block in self.c:
            h = block(h)
        return self.out(h)


def test_three_stacks_get_two_bridges_numbered() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
               for _ in range(2)]
    chain, params = functionalize(ThreeStacks().double(), units=["a", "b", "c"], example_input=batches[0][0])
    assert chain.names == ("embed", "a.0", "a.1", "bridge.1", "b.0", "b.1", "bridge.2", "c.0", "c.1", "head")
    assert sorted(params["bridge.1"]) == ["after_a.bias", "after_a.weight"]
    step = sw.train_step(chain, F.cross_entropy, sw.optim.sgd(0.1))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", stage=3), step, sw.Mesh(dp=2), batches, params)


class _HandsATableView(nn.Module):
    """Block 0 hands the later blocks a view of its own parameter (a bias table), as T5's first block hands
    its position bias, and they hand it on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(_TableBlock(i == 0) for i in range(3))
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = x[: len(x)]  # not traceable by fx: the recorded split
        h, bias = self.embed(x), None
        for block in self.blocks:
            h, bias = block(h, bias)
        return self.out(h)


class _TableBlock(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(8, 4)) if first else None

    def forward(self, h: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if bias is None:
            assert self.table is not None
            bias = self.table[: h.shape[1]]  # a view of the parameter, handed on as it is
        return torch.tanh(self.lin(h) + bias), bias


def test_a_view_of_a_units_parameter_handed_to_the_later_units_outlives_zero3s_free() -> None:
    """ZeRO-3 frees a unit's gathered parameters after its forward: the view it hands on travels as a copy
    (it read freed memory, and the process crashed)."""
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 6, 3, generator=gen, dtype=torch.float64),
             torch.randn(4, 6, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]
    torch.manual_seed(0)
    chain, params = functionalize(_HandsATableView().double(), units=["blocks"], example_input=data[0][0])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), data, params)


def test_a_model_that_drops_layers_at_random_is_refused_naming_the_setting() -> None:
    """LayerDrop (M2M100's and NLLB's default 0.05): embed, the bridge and head each replay forward and drew
    which units run apart, refused at random with messages that did not name it, or (head skipping the last
    unit) computing without the carried state."""
    cfg = T.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
                       attention_dropout=0.0, max_position_embeddings=32, use_cache=False, decoder_layerdrop=0.05)
    model = LogitsOnly(T.BartForConditionalGeneration(cfg).double())
    ids = torch.randint(2, VOCAB, (BATCH, SEQ))
    with pytest.raises(FunctionalizeError, match=r"decoder_layerdrop=0\.05: it skips layers at random.*"
                                                 r"config\.decoder_layerdrop = 0\.0.*units=None"):
        functionalize(model, units=bart_layers(), example_input=ids)


class _SkipsItsLastBlock(nn.Module):
    """Skips its last block when told to: a draw that decides which units run, after the recording."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(4, 2)
        self.skip_last = False

    def forward(self, x: Tensor) -> Tensor:
        x = x[: len(x)]  # not traceable by fx: the recorded split
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            if not (self.skip_last and i == len(self.blocks) - 1):
                h = block(h)
        return self.out(h)


def test_a_head_whose_replay_skips_the_last_unit_is_refused_not_computed_without_the_carry() -> None:
    model = _SkipsItsLastBlock().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    chain, params = functionalize(model, units=["blocks"], example_input=x)
    carry = chain.layers[0](chain.layer_params(params, chain.layers[0]), x)
    for layer in chain.layers[1:-1]:
        carry = layer(chain.layer_params(params, layer), carry)
    for copy in [chain.layers[-1].fn.replicas.module, model]:  # the replica head replays, whichever it is
        copy.skip_last = True
    with pytest.raises(FunctionalizeError, match=r"layer 'head' replayed forward, which did not reach unit "
                                                 r"'blocks\.1' this time.*LayerDrop"):
        chain.layers[-1](chain.layer_params(params, chain.layers[-1]), carry)


class _DrawsFromNumpyAround(nn.Module):
    """Draws from numpy before its blocks (as Wav2Vec2's SpecAugment, in the module holding its layers)
    or not, and after them."""

    def __init__(self, draws_before: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(4, 2)
        self.draws_before = draws_before

    def forward(self, x: Tensor) -> Tensor:
        import numpy as np

        x = x[: len(x)]  # not traceable by fx: the recorded split
        h = self.embed(x)
        if self.draws_before:
            h = h * float(1 + np.random.rand())
        for block in self.blocks:
            h = block(h)
        return self.out(h) * float(1 + np.random.rand())


@pytest.mark.parametrize("draws_before", [True, False])
def test_head_puts_numpy_back_where_its_replay_drew_and_stops_saving_it_where_it_did_not(draws_before: bool) -> None:
    """head replays the code before the units; where that draws from numpy, head puts the generator back at
    the carried state, so the code after draws what the module draws there, call after call. Where its first
    replay drew nothing, it stops saving and restoring numpy's state (tens of microseconds a step)."""
    np = pytest.importorskip("numpy")
    model = _DrawsFromNumpyAround(draws_before).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    chain, params = functionalize(model, units=["blocks"], example_input=x)
    head = chain.layers[-1]
    for call in range(3):
        np.random.seed(call)
        expected = model(x)
        np.random.seed(call)
        got = x
        for layer in chain.layers:
            got = layer(chain.layer_params(params, layer), got)
        assert torch.equal(got, expected), call
    assert head.fn._host[0] is draws_before


def whisper_spec_augment() -> nn.Module:
    """Whisper masking its input_features in place in training (SpecAugment, drawn with numpy), in time
    and in features."""
    model = whisper()
    model.config.update({"apply_spec_augment": True, "mask_time_prob": 0.3, "mask_time_length": 2,
                         "mask_feature_prob": 0.3, "mask_feature_length": 2})
    return SpeechLogitsOnly(model)


def test_whisper_with_spec_augment_split_in_both_stacks_trains_as_one_layer() -> None:
    """Whisper masks ``input_features`` in place before its encoder. ``embed`` masks a copy, which its carry
    holds; the bridge and ``head`` replay that code on copies of the carried input and put the carried
    values back at their carried state. It failed with autograd's raw in-place error (each replay masked
    again the tensor ``embed`` had saved for its backward)."""
    def run(units: Any) -> tuple[dict[str, Tensor], list[Any]]:
        torch.manual_seed(0)
        data = whisper_batches()
        chain, params = functionalize(whisper_spec_augment(), units=units, example_input=whisper_batches()[0][0])
        return trained(chain, params, data), data

    (got, batches), (expected, _) = run(whisper_layers()), run(None)
    assert all(torch.equal(got[name], want) for name, want in expected.items())
    # The split masks copies: the batch is as it was given (the module itself masks the caller's tensor).
    assert all(torch.equal(x["input_features"], y["input_features"]) for (x, _), (y, _) in zip(
        batches, whisper_batches(), strict=True))
    features = batches[0][0]["input_features"].clone()
    whisper_spec_augment().model.model._mask_input_features(features)  # it masks, in training: zeros appear
    assert (features == 0).any() and not (batches[0][0]["input_features"] == 0).any()


def test_t5_split_at_its_later_blocks_trains_as_one_layer_its_first_blocks_outside_the_units() -> None:
    """T5's first block of each stack computes the position bias and hands it on; split at the later blocks
    only, it runs in ``embed`` (the encoder's) and the bridge (the decoder's), and each later block hands
    back the bias it was given, which its stub in a replay hands on too. It was refused, misleadingly:
    "units ... shared an argument in the example input but get different values now" (the stubs handed on
    None)."""
    units = ["model.encoder.block.1", "model.encoder.block.2", "model.decoder.block.1"]
    chain, params, batches = split("t5", units=units)
    assert chain.names == ("embed", *units[:2], "bridge", units[2], "head")
    assert "model.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in params["embed"]
    assert "model.decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in params["bridge"]
    whole, whole_params, _ = split("t5", units=None)
    got, expected = trained(chain, params, batches), trained(whole, whole_params, batches)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], want) for name, want in expected.items())
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", stage=3), step, sw.Mesh(dp=2), batches, params)


@pytest.mark.parametrize(("units", "named"), [
    (["model.encoder.block.0", "model.decoder.block.1"], "model.encoder.block.1"),
    (["model.encoder.block.0", "model.encoder.block.1", "model.decoder.block.0"], "model.encoder.block.2"),
])
def test_t5_with_later_blocks_left_out_of_the_units_is_told_to_name_them(units: list[str], named: str) -> None:
    """T5's block 0 hands its position bias to block 1. With block 0 a unit and a later block not, that block
    runs in the code around the units and reads the bias: the refusal blamed the wrapper's forward and
    offered units=None; it now names the loop's first block left out, and the fix."""
    with pytest.raises(FunctionalizeError, match=rf"the loop's block '{re.escape(named)}' is not a unit.*needs its "
                                                 r"loop's later blocks among the units too"):
        split("t5", units=units)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_an_encoder_decoder_as_it_comes_is_told_both_fixes_at_once(family: str) -> None:
    """transformers' T5 and BART return the encoder's output and the decoder's key/value cache beside the
    logits. The refusal named the wrapper only; the wrapper then met a second refusal for the cache. It
    names both now, and so wrapped the model splits in both stacks."""
    torch.manual_seed(0)
    if family == "t5":
        model = T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0)).double()
        from transformers.models.t5.modeling_t5 import T5Block
        units: Any = T5Block
    else:
        model = T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
            max_position_embeddings=32)).double()
        from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer
        units = (BartEncoderLayer, BartDecoderLayer)
    batch = {"input_ids": torch.randint(2, 64, (4, 8)), "decoder_input_ids": torch.randint(2, 64, (4, 6))}
    with pytest.raises(FunctionalizeError, match=r"Wrap the model in a module whose forward returns only what the "
                       r"loss reads .*use_cache=False"):
        functionalize(model, units=units, example_input=batch)

    class Logits(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Tensor, decoder_input_ids: Tensor) -> Tensor:
            return self.inner(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits

    chain, _ = functionalize(Logits(model), units=units, example_input=batch)
    assert len(chain.names) > 3  # split per layer in both stacks, not one layer
