"""The call-recording split decides from what forward READS, not from which modules it calls.

* A parameter read by attribute before the units (DeBERTa's ``encoder.rel_embeddings.weight``,
  whose module never runs) belongs to ``embed``; before, ``head`` held it and ``embed`` computed
  with a zero stand-in (refused by the example check where the weight is non-zero, silent and never
  trained where it is zero).
* What a unit returns beyond its hidden state (Bloom's and GPT-Neo's attention weights, a tensor
  even with ``output_attentions=False``) is dropped when nothing reads it, passed on in the carry where
  the next units of its loop receive it (T5's position bias), and refused naming the reader where the
  code around the units reads it.

Distributed runs compare with the single-device step (``assert_equivalent``), the single-device step
with a plain torch loop, in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.engine.model.functionalize import FunctionalizeError, functionalize

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ, BATCH, LABELS = 48, 8, 4, 3


def token_batches(targets: str, n: int = 2) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    shape = (BATCH, SEQ) if targets == "tokens" else (BATCH,)
    high = VOCAB if targets == "tokens" else LABELS
    return [
        (torch.randint(2, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, high, shape, generator=g))
        for _ in range(n)
    ]


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def class_loss(out: Any, targets: Tensor) -> Tensor:
    return F.cross_entropy(out.logits, targets)


def bloom() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.BloomConfig(
        vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0,
        use_cache=False,
    )
    return T.BloomForCausalLM(cfg), T.models.bloom.modeling_bloom.BloomBlock


def gpt_neo() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=16, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
        bos_token_id=0, eos_token_id=0,
    )
    return T.GPTNeoForCausalLM(cfg), T.models.gpt_neo.modeling_gpt_neo.GPTNeoBlock


def deberta_v2(norm_rel_ebd: str = "layer_norm") -> tuple[nn.Module, type[nn.Module]]:
    # DeBERTa-v3's defaults: relative attention (c2p, p2c) over a layer-normed rel_embeddings table
    # that the encoder reads by attribute before its layers; with norm_rel_ebd="none" (the config's
    # default, and DeBERTa v1's way) it hands the table itself to every layer, no op reading it on the way.
    cfg = T.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"],
        norm_rel_ebd=norm_rel_ebd, share_att_key=True, num_labels=LABELS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    return T.DebertaV2ForSequenceClassification(cfg), T.models.deberta_v2.modeling_deberta_v2.DebertaV2Layer


MODELS = {"bloom": (bloom, "tokens"), "gpt_neo": (gpt_neo, "tokens"), "deberta_v2": (deberta_v2, "classes"),
          "deberta_v2_table_handed_on": (lambda: deberta_v2("none"), "classes")}


@pytest.mark.parametrize("family", list(MODELS))
def test_zero3_and_a_pipeline_of_the_per_block_split_match_the_single_device_step(family: str) -> None:
    make, targets = MODELS[family]
    torch.manual_seed(0)
    model, block = make()
    batches = token_batches(targets)
    chain, params = functionalize(model.double(), units=block, example_input=batches[0][0])
    assert len(chain) == 4  # embed, two blocks, head
    step = sw.train_step(chain, lm_loss if targets == "tokens" else class_loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
    pipelined = sw.pipeline(step, "pp", "1f1b", microbatches=2)
    sw.testing.assert_equivalent(pipelined, step, sw.Mesh(pp=2), batches, params)


def test_blooms_head_replays_its_embedding_norm_in_the_compute_dtype_under_mixed_precision() -> None:
    # Bloom ties its head to the embedding, so ``head`` holds the real (bfloat16) table and replays
    # the layer norm after it on stand-ins, which must be bfloat16 too (float64 ones, the model's
    # dtype, are refused by CPU layer_norm). bfloat16 compute on both
    # sides: only ZeRO-3's reductions differ (rtol as tests/transforms/test_mixed_precision_hf.py).
    torch.manual_seed(0)
    model, block = bloom()
    batches = token_batches("tokens")
    chain, params = functionalize(model.double(), units=block, example_input=batches[0][0])  # cast to f32 below
    step = sw.mixed_precision(sw.train_step(chain, lm_loss, sw.optim.sgd(0.1)), "params=f32,compute=bf16,output=f32")
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params, rtol=2**-6)


@pytest.mark.parametrize("norm_rel_ebd", ["layer_norm", "none"])
def test_debertas_relative_embeddings_belong_to_embed(norm_rel_ebd: str) -> None:
    torch.manual_seed(0)
    model, block = deberta_v2(norm_rel_ebd)
    ids = token_batches("classes")[0][0]
    chain, params = functionalize(model.double(), units=block, example_input=ids)
    assert "deberta.encoder.rel_embeddings.weight" in params["embed"]
    assert "deberta.encoder.rel_embeddings.weight" not in chain["head"].param_names


class ReadsATableByAttribute(nn.Module):
    """Adds a learned table it reads by attribute (``self.table.weight``: the module is never called)
    before its blocks, and starts it at zero, as a freshly initialised bias often is."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.table = nn.Embedding(SEQ, 4)
        nn.init.zeros_(self.table.weight)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(4, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids[: len(ids)]  # len() of an fx proxy fails: functionalize records the calls instead
        h = self.embed(ids) + self.table.weight[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class HandsATableToItsUnits(nn.Module):
    """Hands a learned table itself (no op reading it on the way) to every block, which adds it; the
    table starts at zero. It went to the head alone, so the blocks read the embed's zero stand-in and
    the table never trained, without an error."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.table = nn.Parameter(torch.zeros(SEQ, 4))
        self.blocks = nn.ModuleList(_AddsTable() for _ in range(2))
        self.out = nn.Linear(4, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, self.table)
        return self.out(h)


class _AddsTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: Tensor, table: Tensor) -> Tensor:
        return torch.tanh(self.linear(h) + table[: h.shape[1]])


def torch_loop(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> tuple[nn.Module, list[Tensor]]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, losses


def trained_by_blocks(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> tuple[Any, Any, list[Tensor]]:
    """The chain of ``model`` split at its blocks, its state after SGD on ``batches``, and the losses."""
    chain, params = functionalize(model, units="blocks", example_input=batches[0][0])
    step = sw.train_step(chain, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
    state = step.init(params)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return chain, state, losses


def test_a_zero_table_read_by_attribute_before_the_units_trains_as_in_torch() -> None:
    torch.manual_seed(0)
    model = ReadsATableByAttribute().double()
    batches = token_batches("tokens", n=3)
    _, state, losses = trained_by_blocks(model, batches)
    reference, expected = torch_loop(model, batches)
    assert reference.table.weight.abs().sum() > 0  # the table did train in torch
    trained = {name: t for layer in state.params.values() for name, t in layer.items()}
    assert torch.equal(trained["table.weight"], reference.table.weight)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    assert "table.weight" in state.params["embed"]  # the layer that reads it holds it


class CarriesATablePastTheUnits(nn.Module):
    """Reads a table before its blocks into a value the code after them uses: ``head`` needs it too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.table = nn.Embedding(SEQ, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(4, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids[: len(ids)]  # not traceable by fx (see above)
        offset = self.table.weight[: ids.shape[1]] * 2
        h = self.embed(ids) + offset
        for block in self.blocks:
            h = block(h)
        return self.out(h - offset)


def test_a_table_read_before_the_units_for_the_code_after_them_is_in_both() -> None:
    torch.manual_seed(0)
    model = CarriesATablePastTheUnits().double()
    ids = token_batches("tokens")[0][0]
    chain, params = functionalize(model, units="blocks", example_input=ids)  # checks the chain bitwise
    assert "table.weight" in params["embed"]
    assert chain["head"].ties == {"table.weight": ("embed", "table.weight")}  # read there, not a stand-in
    assert "embed.weight" not in chain["head"].param_names


class _WithSide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.inner(x)
        return y, torch.softmax(y, -1)  # like attention weights the parent drops


class DropsWhatItsBlocksReturnBesides(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_WithSide() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        x = x[: len(x)]  # not traceable by fx (see above)
        for block in self.blocks:
            x = block(x)[0]
        return x


def test_a_second_output_nothing_reads_is_dropped() -> None:
    torch.manual_seed(0)
    model = DropsWhatItsBlocksReturnBesides().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    chain, _ = functionalize(model, units="blocks", example_input=x)  # checks the chain bitwise
    assert chain.names == ("embed", "blocks.0", "blocks.1", "head")


def test_t5s_position_bias_passes_from_its_first_block_to_the_next_in_the_carry() -> None:
    """T5's first block computes the position bias from its ``relative_attention_bias`` and returns it
    beside its hidden state; the next blocks receive it. Its layer writes it into the carry (it was
    refused); tests/engine/test_functionalize_encdec.py trains T5 so split."""
    cfg = T.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0)
    model = T.T5EncoderModel(cfg).double()
    ids = token_batches("tokens")[0][0]
    chain, _ = functionalize(model, units=T.models.t5.modeling_t5.T5Block, example_input=ids)  # checked bitwise
    assert chain.names == ("embed", "encoder.block.0", "encoder.block.1", "head")


class ReadsATableFromItsSecondCallOn(nn.Module):
    """Reads a zero table only from its second forward on: the recording (the first) saw no read,
    so neither ``embed`` nor ``head`` holds it, and the check on the example (a later call) would
    see equal values; the stand-in read is refused by name instead."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.table = nn.Embedding(SEQ, 4)
        nn.init.zeros_(self.table.weight)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.calls = 0

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids[: len(ids)]  # not traceable by fx (see above)
        self.calls += 1
        h = self.embed(ids)
        if self.calls > 1:
            h = h + self.table.weight[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        return h


def test_a_stand_in_read_the_recording_did_not_see_is_refused_naming_the_parameter() -> None:
    model = ReadsATableFromItsSecondCallOn().double()
    ids = token_batches("tokens")[0][0]
    with pytest.raises(
        FunctionalizeError, match=r"the code before the first unit reads parameter 'table.weight'.*units=None"
    ):
        functionalize(model, units="blocks", example_input=ids)


def test_a_zero_table_handed_to_the_units_trains_as_in_torch() -> None:
    torch.manual_seed(0)
    model = HandsATableToItsUnits().double()
    batches = token_batches("tokens", n=3)
    chain, state, _ = trained_by_blocks(model, batches)
    reference, _ = torch_loop(model, batches)
    assert reference.table.abs().sum() > 0  # the table did train in torch
    holder = next(layer for layer, tensors in state.params.items() if "table" in tensors)
    assert holder == chain.names[0]  # the layer that hands it on holds it, as it holds the embedding
    assert torch.equal(state.params[holder]["table"], reference.table)


class ReadsAUnitsNormAroundTheUnits(nn.Module):
    """The code before the units (``before``) or after them normalises with a unit's own LayerNorm's
    weight, read by attribute: the recording's stand-in for the unit holds no submodules."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.embed = nn.Embedding(VOCAB, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(2))

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids[: len(ids)]  # not traceable by fx (see above)
        h = self.embed(ids)
        norm = self.blocks[0][0]
        if self.where == "before":
            h = F.layer_norm(h, (4,), norm.weight, norm.bias)
        for block in self.blocks:
            h = block(h)
        return F.layer_norm(h, (4,), norm.weight) if self.where == "after" else h


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_units_own_parameter_read_outside_it_is_refused_naming_it(where: str) -> None:
    model = ReadsAUnitsNormAroundTheUnits(where).double()
    ids = token_batches("tokens")[0][0]
    with pytest.raises(
        FunctionalizeError, match=r"forward reads blocks\.0\.0 outside the call of unit 'blocks\.0'.*units=None"
    ):
        functionalize(model, units="blocks", example_input=ids)
    functionalize(model, units=None, example_input=ids)  # one layer: the way out the message gives


def bart() -> nn.Module:
    cfg = T.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0,
        max_position_embeddings=32,
    )
    return T.BartForConditionalGeneration(cfg).double()


def test_an_encoders_output_returned_beside_decoder_units_is_refused_naming_where_it_comes_from() -> None:
    """BART's decoder layers as units: the encoder runs before them, and the model returns its output
    (``encoder_last_hidden_state``) as it is, which the code after the units saw only as a zero stand-in."""
    ids = token_batches("tokens")[0][0]
    with pytest.raises(
        FunctionalizeError,
        match=r"returns a value the code before the first unit computed from parameter 'model\.encoder\.[\w.]+'.*"
        r"Wrap the model in a module whose forward returns only what the loss reads.*"
        r"encoder-decoder's encoder layers.*units=None",
    ):
        functionalize(bart(), units=T.models.bart.modeling_bart.BartDecoderLayer, example_input=ids)
    # Its encoder layers as units (the decoder after them) are split as the module computes.
    chain, _ = functionalize(bart(), units=T.models.bart.modeling_bart.BartEncoderLayer, example_input=ids)
    assert chain.names == ("embed", "model.encoder.layers.0", "model.encoder.layers.1", "head")


class LogitsOnly(nn.Module):
    """The way out the refusal gives: a module returning only what the loss reads."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, pixel_values=pixel_values).logits


def test_llava_split_per_decoder_layer_trains_once_wrapped_to_return_its_logits() -> None:
    """LLaVA returns image_hidden_states as the vision tower computed them, before the decoder layers: refused
    split per layer as it comes, and equal to one device under ZeRO-3 wrapped to return its logits."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, image_size=16, patch_size=8),
        text_config=T.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, use_cache=False),
        image_token_index=VOCAB - 1,
    )
    model = T.LlavaForConditionalGeneration(cfg).double()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(2, VOCAB - 1, (2, 8), generator=g)
        ids[:, 1:5] = VOCAB - 1  # four image tokens: the 16 x 16 image in patches of 8
        batches.append(({"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)},
                        ids))
    with pytest.raises(FunctionalizeError, match=r"returns a value the code before the first unit computed.*Wrap"):
        functionalize(model, units=LlamaDecoderLayer, example_input=batches[0][0])
    chain, params = functionalize(LogitsOnly(model), units=LlamaDecoderLayer, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), sw.optim.sgd(0.1))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)


class _Residual(nn.Module):
    """``h + linear(h)`` with the linear zero-initialised: the identity on every input, at first."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.linear(h)


class SkipsToTheHead(nn.Module):
    """The code after the blocks reads the first block's output too (a skip connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Residual() for _ in range(2))
        self.out = nn.Linear(4, LABELS)

    def forward(self, x: Tensor) -> Tensor:
        x = x[: len(x)]  # not traceable by fx (see above)
        first = self.blocks[0](x)
        return self.out(self.blocks[1](first) + first)


def test_the_head_reading_an_earlier_units_output_is_refused_naming_the_unit() -> None:
    """``head`` has only the last unit's output; where forward reads an earlier one's, its replay passes
    the unit's input through instead. Each block here is the identity at first, so the two are equal and the
    check on the example passed, but the first block's gradient through the skip was lost: refused, naming
    the block."""
    with pytest.raises(
        FunctionalizeError,
        match=r"the code after the last unit \(layer 'head'\) uses the output of unit 'blocks\.0' and reads it "
        r"\(in add\(\)\).*units=None",
    ):
        functionalize(SkipsToTheHead().double(), units="blocks", example_input=torch.randn(2, 4, dtype=torch.float64))


class _ScaledResidual(_Residual):
    def forward(self, h: Tensor, scale: Tensor) -> Tensor:  # type: ignore[override]
        return h + self.linear(h) * scale


class GluesAnArgumentFromTheHiddenState(nn.Module):
    """The loop computes each block's second argument from the hidden state the block before returned."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledResidual() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = x[: len(x)]  # not traceable by fx (see above)
        for block in self.blocks:
            h = block(h, torch.tanh(h.mean()))
        return h


def test_a_units_argument_glued_from_an_earlier_units_output_is_refused_naming_it() -> None:
    """``embed`` records what the units receive with the units passed through: an argument computed from
    the hidden state between two units would come from the first one's input. The blocks are the identity
    at first, so the check on the example passed, and the first block lost its gradient through the
    second's argument: refused, naming the block."""
    with pytest.raises(
        FunctionalizeError,
        match=r"a unit after 'blocks\.0' receives a value forward computes from the output of unit 'blocks\.0'.*"
        r"layer 'embed' records.*units=None",
    ):
        functionalize(GluesAnArgumentFromTheHiddenState().double(), units="blocks",
                      example_input=torch.randn(2, 4, dtype=torch.float64))
