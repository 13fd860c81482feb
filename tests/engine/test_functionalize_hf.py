"""Unmodified Hugging Face models through functionalize: whole, and split per block.

Four families (GPT-2: tied head, learned positions; Llama: RoPE, RMSNorm, grouped-query
attention; BERT: bidirectional, a mask that is None unless padded; Qwen2: Llama-like
with attention biases), tiny random-init configs in float64, eager attention, no dropout.

* A single-device step is bitwise a plain torch loop on the HF module (SGD with momentum,
  and AdamW against torch.optim.AdamW): the chain runs the module's own code on the same
  tensors, so there is no tolerance to explain.
* ZeRO stages 1-3 at dp=2 and a 1F1B pipeline at pp=2 on the per-block split match the
  single-device step (assert_equivalent's float64 default).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import re
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.engine.model import pytrees
from shardwise.engine.model.functionalize import FunctionalizeError, functionalize

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ, BATCH = 64, 8, 4


def gpt2() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0,
    )
    return T.GPT2LMHeadModel(cfg), T.models.gpt2.modeling_gpt2.GPT2Block


def llama() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    return T.LlamaForCausalLM(cfg), T.models.llama.modeling_llama.LlamaDecoderLayer


def bert() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )
    return T.BertForMaskedLM(cfg), T.models.bert.modeling_bert.BertLayer


def qwen2() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.Qwen2Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    return T.Qwen2ForCausalLM(cfg), T.models.qwen2.modeling_qwen2.Qwen2DecoderLayer


FAMILIES = {"gpt2": gpt2, "llama": llama, "bert": bert, "qwen2": qwen2}


def build(family: str) -> tuple[nn.Module, type[nn.Module]]:
    torch.manual_seed(0)
    model, block = FAMILIES[family]()
    return model.double(), block


def token_batches(n: int = 3, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(n)
    ]


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    """Cross entropy on ``out.logits`` in the model's dtype (HF's own loss upcasts to float32)."""
    assert isinstance(out, T.utils.ModelOutput), type(out)  # the loss gets a real ModelOutput
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def call(model: nn.Module, x: Any) -> Any:
    kwargs = dict(x) if isinstance(x, dict) else {"input_ids": x}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False  # what functionalize's layers do: a pure layer keeps no cache
    return model(**kwargs)


def torch_loop(
    model: nn.Module, batches: list[Any], make_opt: Callable[[Any], torch.optim.Optimizer],
    loss: Callable[[Any, Any], Tensor],
) -> tuple[nn.Module, list[Tensor]]:
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        value = loss(call(model, x), y)
        value.backward()
        assert all(p.grad is not None for p in model.parameters())  # torch would skip a None grad
        opt.step()
        losses.append(value.detach())
    return model, losses


def assert_params_equal(state_params: dict[str, dict[str, Tensor]], model: nn.Module) -> None:
    named = dict(model.named_parameters())
    seen = 0
    for layer, tensors in state_params.items():
        for name, value in tensors.items():
            assert torch.equal(value, named[name]), f"{layer}/{name}"
            seen += 1
    assert seen == len(named)  # every module parameter is in the params pytree once


OPTIMIZERS = {
    "sgd-momentum": (
        lambda: sw.optim.sgd(0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "adamw": (
        lambda: sw.optim.adamw(1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ),
}


# --- single device: bitwise the torch loop -------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("split", ["whole", "blocks"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_step_is_bitwise_a_torch_loop(family: str, split: str, optimizer: str) -> None:
    model, block = build(family)
    ours, theirs = OPTIMIZERS[optimizer]
    batches = token_batches()
    chain, params = functionalize(model, units=None if split == "whole" else block)
    assert len(chain) == (1 if split == "whole" else 4)
    step = sw.train_step(chain, lm_loss, ours())
    state = step.init(params)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    reference, expected = torch_loop(model, batches, theirs, lm_loss)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    assert_params_equal(state.params, reference)


def test_the_split_names_embed_blocks_head_and_keeps_gpt2s_tie() -> None:
    model, block = build("gpt2")
    chain, params = functionalize(model, units=block)
    assert chain.names == ("embed", "transformer.h.0", "transformer.h.1", "head")
    head = chain["head"]
    assert head.ties == {"transformer.wte.weight": ("embed", "transformer.wte.weight")}
    # the head holds what runs after the blocks, and not the position embedding
    assert set(head.owned_param_names) == {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    assert "transformer.wpe.weight" in params["embed"]


def test_units_by_path_give_the_same_split() -> None:
    model, block = build("llama")
    by_class, _ = functionalize(model, units=block)
    by_path, _ = functionalize(model, units="model.layers")
    assert by_class.names == by_path.names == ("embed", "model.layers.0", "model.layers.1", "head")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_an_embedding_named_a_unit_that_the_glue_reads_is_refused_with_a_note_naming_it(attention: str) -> None:
    """The replays pass each unit's input on in its place: after an embedding unit, Llama's rotary embedding
    reads the ids' dtype (cos and sin cast to int64: 1.9e-3 off, refused by the example check as a difference;
    under eager attention torch's raw finfo error on the mask). Either failure now notes the unit."""
    model, _ = build("llama")
    model.config._attn_implementation = attention
    with pytest.raises(Exception) as raised:
        functionalize(model, units=["model.embed_tokens", "model.layers.0", "model.layers.1"])
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert re.search(r"unit 'model.embed_tokens' is given a torch.int64 tensor and returns a torch.float(32|64) "
                     r"one.*Leave it out of units", notes), notes


# --- HF-style dict batches and the model's own loss ------------------------------------------


def padded_batches(family: str, n: int = 2) -> list[tuple[dict[str, Tensor], None]]:
    """Dict batches with right padding (attention_mask 0, labels -100) in some rows."""
    out = []
    for i, (ids, _) in enumerate(token_batches(n, seed=3)):
        mask = torch.ones_like(ids)
        mask[i % BATCH, SEQ - 3 :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append(({"input_ids": ids, "attention_mask": mask, "labels": labels}, None))
    return out


def own_loss(out: Any, targets: None) -> Tensor:
    return out.loss


def _trains_as_torch_with_its_own_loss(model: Any, chain: Any, params: Any, batches: list[Any]) -> None:
    """The step on the model's own loss, bit for bit a torch loop's losses and parameters (SGD + momentum)."""
    step = sw.train_step(chain, own_loss, sw.optim.sgd(0.1, momentum=0.9))
    state = step.init(params)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    reference, expected = torch_loop(model, batches, OPTIMIZERS["sgd-momentum"][1], own_loss)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    assert_params_equal(state.params, reference)


@pytest.mark.parametrize("split", ["whole", "blocks"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_dict_batches_train_through_the_models_own_loss(family: str, split: str) -> None:
    model, block = build(family)
    batches = padded_batches(family)
    # BERT's mask is None for the unpadded example and a tensor for the padded batches.
    unpadded = {**batches[0][0], "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    chain, params = functionalize(model, units=None if split == "whole" else block, example_input=unpadded)
    _trains_as_torch_with_its_own_loss(model, chain, params, batches)


@pytest.mark.parametrize("split", ["whole", "blocks"])
def test_a_dict_batch_with_a_key_forward_takes_through_its_kwargs_is_spread(split: str) -> None:
    """transformers 5 takes ``shift_labels`` (and ``return_dict``, ...) only through ``**kwargs``:
    the batch is still the keyword arguments, not one argument (it was passed whole as input_ids)."""
    model, block = build("llama")
    assert "shift_labels" not in inspect.signature(model.forward).parameters
    batches = []
    for ids, targets in token_batches(2, seed=5):
        shift = targets.clone()
        shift[0, 2:] = -100  # a loss over fewer tokens than labels would give: shift_labels is read
        batches.append(({"input_ids": ids, "labels": targets, "shift_labels": shift}, None))
    chain, params = functionalize(model, units=None if split == "whole" else block, example_input=batches[0][0])
    _trains_as_torch_with_its_own_loss(model, chain, params, batches)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_tokenizers_batch_encoding_trains_as_the_same_batch_as_a_dict(family: str) -> None:
    """What a tokenizer, ``tokenizer.pad`` and the data collators return is a ``BatchEncoding``, a
    ``UserDict``: a Mapping, but one leaf to optree. As the example and as the batch it is the dict it
    holds: one device bitwise the dict batches' step (and the chain run on it), and ZeRO-3 over dp=2 the
    single-device step."""
    model, block = build(family)
    dicts = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids} for ids, _ in token_batches(2)]
    encodings = [T.BatchEncoding(d) for d in dicts]
    assert optree.tree_leaves(encodings[0]) == [encodings[0]]  # what made it opaque to the step
    chain, params = functionalize(model, units=block, example_input=encodings[0])
    step = sw.train_step(chain, own_loss, sw.optim.sgd(0.1, momentum=0.9))
    runs = []
    for batches in (dicts, encodings):
        state, losses = step.init(params), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        runs.append((losses, state.params))
    (dict_losses, dict_params), (encoding_losses, encoding_params) = runs
    assert all(torch.equal(a, b) for a, b in zip(dict_losses, encoding_losses, strict=True))
    assert all(torch.equal(dict_params[k][n], t) for k, tensors in encoding_params.items() for n, t in tensors.items())
    assert torch.equal(chain(params, encodings[1]).logits, chain(params, dicts[1]).logits)  # evaluating on one
    # transformers computes its own loss in float32 (ForCausalLMLoss upcasts the logits): each shard's
    # mean is rounded to float32 (2^-24 relative) before the mean over shards, so 1e-6, not 1e-12.
    zero3 = sw.shard_params(step, "dp", 3)
    sw.testing.assert_equivalent(zero3, step, sw.Mesh(dp=2), encodings, params, rtol=1e-6)


def test_a_flag_in_a_dict_batch_is_refused_by_a_cut_naming_its_key_and_the_fix() -> None:
    """One device takes ``{"input_ids": ..., "return_dict": True}`` (the flag is fixed at the example's
    value); a cut of the batch cannot split a bool, and said only "got True". Passing it whole to every
    part is not done (a list of per-row strings flattens to such leaves): the refusal names the key."""
    model, block = build("llama")
    batches = [({"input_ids": ids, "return_dict": True}, targets) for ids, targets in token_batches(1)]
    chain, params = functionalize(model, units=block, example_input=batches[0][0])
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    step(step.init(params), batches[0])
    zero3 = sw.shard_params(step, "dp", 3)

    def run() -> None:
        zero3(zero3.init(params, sw.Mesh(dp=2)), batches[0])

    with pytest.raises(sw.collectives.RankFailed, match=r"\(inputs, targets\)\[0\]\['return_dict'\] is True \(bool\)"
                                                        r".*set it where the model reads it"):
        sw.launch(run, 2)


def test_a_split_recorded_on_one_input_structure_refuses_another() -> None:
    model, block = build("gpt2")
    chain, params = functionalize(model, units=block)  # recorded on a bare ids tensor
    batch = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long)}
    with pytest.raises(FunctionalizeError, match=r"the layer input has structure(.|\n)*example_input="):
        chain(params, batch)


# --- a ModelOutput trains ------------------------------------------------------------------


def test_a_model_output_is_a_pytree_and_the_whole_model_trains() -> None:
    model, _ = build("llama")
    chain, params = functionalize(model, example_input=token_batches(1)[0][0])
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    state, metrics = step(step.init(params), token_batches(1)[0])
    assert float(metrics["grad_norm"]) > 0
    moved = [
        n for n, t in state.params["model"].items() if not torch.equal(t, params["model"][n])
    ]
    assert len(moved) == len(params["model"])
    out = chain(params, token_batches(1)[0][0])
    assert [type(v) for v in optree.tree_leaves(out)] == [Tensor]  # the logits; cache is off
    rebuilt = optree.tree_map(lambda t: t, out)
    assert type(rebuilt) is type(out) and rebuilt["logits"] is out.logits


def test_functionalize_with_an_example_checks_whole_and_split_bitwise() -> None:
    model, block = build("qwen2")
    ids = token_batches(1)[0][0]
    for units in (None, block):
        functionalize(model, units=units, example_input=ids)  # raises on any bitwise difference


# --- distributed, on the per-block split -----------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zero_and_a_pipeline_match_the_single_device_step(family: str) -> None:
    model, block = build(family)
    chain, params = functionalize(model, units=block)
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    batches = token_batches()
    for stage in (1, 2, 3):
        sw.testing.assert_equivalent(sw.shard_params(step, "dp", stage), step, sw.Mesh(dp=2), batches, params)
    pipelined = sw.pipeline(step, "pp", "1f1b", microbatches=2)
    sw.testing.assert_equivalent(pipelined, step, sw.Mesh(pp=2), batches, params)


def test_an_encoder_returning_a_model_output_is_a_unit_and_albert_splits_at_it() -> None:
    """ALBERT runs one shared layer as every layer, so its layers cannot be units (called more than
    once); its encoder, the one module that runs them all, returns a BaseModelOutput, which was refused
    ("a unit passes one hidden state on: a tensor, or a tuple"), leaving only the whole model. A
    ModelOutput unit passes its first field on, as a tuple's: embed, encoder and head train bitwise as a
    torch loop, and under ZeRO-3 and a pipeline as the single-device step."""
    torch.manual_seed(0)
    cfg = T.AlbertConfig(
        vocab_size=VOCAB, embedding_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )
    model = T.AlbertForMaskedLM(cfg).double()
    albert = T.models.albert.modeling_albert
    batches = token_batches()
    with pytest.raises(FunctionalizeError, match="is called more than once in forward"):
        functionalize(model, units=albert.AlbertLayer, example_input=batches[0][0])
    chain, params = functionalize(model, units=albert.AlbertTransformer, example_input=batches[0][0])
    assert chain.names == ("embed", "albert.encoder", "head")
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    state, losses = step.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    reference, expected = torch_loop(model, batches, OPTIMIZERS["sgd-momentum"][1], lm_loss)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected, strict=True))
    assert_params_equal(state.params, reference)
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", 2), step, sw.Mesh(pp=2), batches, params)


def test_a_pipeline_after_an_unpadded_example_trains_on_padded_batches() -> None:
    """BERT's eager mask is None for a batch without padding. The Plan predicted it on fake tensors, which
    cannot read data, as functionalize's example had it: after an unpadded example, padded batches (a
    padded row in every micro-batch) are refused by default, naming the example and follow_batches; with
    ``follow_batches=True`` the first layer also runs on each real micro-batch (plan/predict.py:
    first_output): after either example the same batches train as the single-device step, and the ledger
    is the Plan."""
    model, block = build("bert")
    batches = padded_batches("bert", n=2)
    for inputs, _ in batches:
        inputs["attention_mask"][BATCH // 2, SEQ - 2 :] = 0  # the second micro-batch padded too
    unpadded = {**batches[0][0], "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}

    def counted(inputs: dict[str, Tensor], targets: None) -> Tensor:
        return (inputs["labels"] != -100).sum()

    for example in (unpadded, batches[0][0]):
        chain, params = functionalize(model, units=block, example_input=example)
        step = sw.train_step(chain, own_loss, sw.optim.sgd(0.1, momentum=0.9), tokens=counted)
        if example is unpadded:
            with pytest.raises(sw.collectives.RankFailed, match=r"micro-batch 0,.*has one where the example had none"
                                                                r".*example_input like your batches.*follow_batches"):
                sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", microbatches=2), step, sw.Mesh(pp=2),
                                             batches, params, rtol=1e-6)
        pipelined = sw.pipeline(step, "pp", "1f1b", microbatches=2, follow_batches=True)
        # BERT's own loss is computed in float32
        sw.testing.assert_equivalent(pipelined, step, sw.Mesh(pp=2), batches, params, rtol=1e-6)
        sw.testing.assert_plan_is_run(pipelined, sw.Mesh(pp=2), params, batches[0])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_pipeline_of_a_model_with_sdpa_attention_matches_the_single_device_step(family: str) -> None:
    # sdpa attention skips the causal mask on real inputs without padding, but cannot on the fake
    # tensors a pipeline predicts its transfers on: the prediction must follow the real run.
    model, block = build(family)
    model.config._attn_implementation = "sdpa"
    ids = token_batches(1)[0][0]
    chain, params = functionalize(model, units=block, example_input=ids)
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    pipelined = sw.pipeline(step, "pp", "1f1b", microbatches=2)
    sw.testing.assert_equivalent(pipelined, step, sw.Mesh(pp=2), token_batches(), params)


def test_a_pipeline_trains_a_micro_batch_with_a_mask_beside_one_without() -> None:
    """sdpa Llama leaves out the mask of a micro-batch with no padded row: the first micro-batch (row 0
    padded) passes a mask on, the second none. Its receiver, expecting a mask, failed on a message layout
    (``(0, 0, 0) torch.int8``, the marker of a None); then the sender refused it. Each micro-batch's
    transfers are predicted on it under ``follow_batches=True``: the step is the single-device one, with a
    padded row in one micro-batch, in each, or in none, and the ledger is the Plan. By default the second
    micro-batch is refused, naming the option."""
    model, block = build("llama")
    model.config._attn_implementation = "sdpa"
    ids, targets = token_batches(1)[0]

    def batch_padding(rows: list[int]) -> tuple[dict[str, Tensor], Tensor]:
        mask = torch.ones_like(ids)
        mask[rows, :3] = 0  # left padding
        return {"input_ids": ids, "attention_mask": mask}, targets.masked_fill(mask == 0, -100)

    def loss_fn(out: Any, y: Tensor) -> tuple[Tensor, Tensor]:
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="sum"), (y != -100).sum()

    chain, params = functionalize(model, units=block, example_input=batch_padding([0])[0])
    step = sw.train_step(chain, loss_fn, sw.optim.sgd(0.1, momentum=0.9), tokens="sum")
    with pytest.raises(sw.collectives.RankFailed, match=r"rank 0 failed: ValueError: stage 0 passes on, for "
                       r"micro-batch 1, 8 tensors .*follow_batches=True"):
        sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", microbatches=2), step, sw.Mesh(pp=2),
                                     [batch_padding([0])], params)
    pipelined = sw.pipeline(step, "pp", "1f1b", microbatches=2, follow_batches=True)
    batches = [batch_padding([0]), batch_padding([0, 2]), batch_padding([])]
    sw.testing.assert_equivalent(pipelined, step, sw.Mesh(pp=2), batches, params)
    sw.testing.assert_plan_is_run(pipelined, sw.Mesh(pp=2), params, batches[0])


# --- refusals -------------------------------------------------------------------------------------


class Untraceable(nn.Module):
    """``len()`` of the input in the glue: fx cannot run it on a proxy (nor is it control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.emb(ids)[: len(ids)]
        for b in self.blocks:
            x = self.between(b(x))
        return self.out(x)

    def between(self, x: Tensor) -> Tensor:
        return x


def test_fx_failure_says_what_fx_reported_and_offers_the_recording_route() -> None:
    with pytest.raises(FunctionalizeError) as info:
        functionalize(Untraceable(), units="blocks")
    message = str(info.value)
    assert "'len' is not supported" in message and "example_input=" in message
    assert "control flow" not in message
    chain, _ = functionalize(Untraceable(), units="blocks", example_input=torch.tensor([[1, 2, 3]]))
    assert chain.names == ("embed", "blocks.0", "blocks.1", "head")


class Rescaled(Untraceable):
    """Glue between the blocks changes the hidden state: no layer could hold it."""

    def between(self, x: Tensor) -> Tensor:
        return x * 2


class _Pair(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.inner(x)
        return y, y.detach()


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Pair(nn.Linear(4, 4)) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        x = x[: len(x)]
        extra = torch.zeros(())
        for b in self.blocks:
            x, side = b(x)
            extra = extra + side.sum()  # reads what each block returns beyond its hidden state
        return x + extra


@pytest.mark.parametrize(
    ("module", "units", "message"),
    [
        (Rescaled(), "blocks", r"unit 'blocks.1' does not receive the output of 'blocks.0'"),
        (
            TwoOutputs(),
            "blocks",
            r"unit 'blocks.0' returns a tensor at output\[1\] besides its hidden state, and sum\(\) in "
            r"TwoOutputs's forward reads it.*output_attentions=False.*units=None",
        ),
    ],
)
def test_recorded_split_refusals_name_the_unit_and_the_fix(module: nn.Module, units: str, message: str) -> None:
    x = torch.tensor([[1, 2, 3]]) if isinstance(module, Untraceable) else torch.randn(2, 4)
    with pytest.raises(FunctionalizeError, match=message):
        functionalize(module, units=units, example_input=x)


class Argmax(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.argmax(-1)


@dataclasses.dataclass
class Normalised:
    """__post_init__ changes its input, so rebuilding it from its fields would change values."""

    logits: Tensor

    def __post_init__(self) -> None:
        self.logits = self.logits - self.logits.mean()


class ReturnsNormalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Normalised:
        return Normalised(self.lin(x))


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["hf-default", "reentrant", "non-reentrant"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_with_gradient_checkpointing_on_is_refused_with_the_fix(family: str, reentrant: bool | None) -> None:
    """Hugging Face's activation checkpointing recomputes a block's forward in the backward on the
    module's own parameters, outside the pure layer's call: refused at functionalize, naming the
    module and the fix, instead of a crash on meta tensors (or torch's refusal) in the first backward.
    In eval mode (no checkpointing then) and once disabled, the model splits as before."""
    model, block = FAMILIES[family]()
    model.activation_checkpointing_enable(None if reentrant is None else {"use_reentrant": reentrant})
    model.train()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    with pytest.raises(FunctionalizeError, match=r"activation checkpointing on .*activation_checkpointing_disable"
                                                 r"\(\).*sw\.remat\(step\)"):
        functionalize(model, units=block, example_input=ids)
    functionalize(model.eval(), units=block, example_input=ids)
    model.train().activation_checkpointing_disable()
    chain, params = functionalize(model, units=block, example_input=ids)
    loss = lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten())  # noqa: E731
    step = sw.train_step(chain, loss, sw.optim.sgd(0.1))
    _, metrics = step(step.init(params), (ids, ids))
    assert torch.isfinite(metrics["loss"])


def test_an_output_without_a_floating_tensor_is_refused_naming_the_layer() -> None:
    with pytest.raises(FunctionalizeError, match=r"layer '1' returns a Tensor that carries no floating-point tensor"):
        functionalize(nn.Sequential(nn.Linear(3, 3), Argmax()), example_input=torch.randn(2, 3))
    with pytest.raises(FunctionalizeError, match=r"layer 'model'.*opaque leaves \['Normalised'\].*__post_init__"):
        functionalize(ReturnsNormalised(), example_input=torch.randn(2, 3))


@dataclasses.dataclass(frozen=True)
class Output:
    logits: Tensor
    aux: Tensor | None = None


class ReturnsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Output:
        return Output(self.lin(x))


def test_a_dataclass_output_flows_and_round_trips() -> None:
    chain, params = functionalize(ReturnsOutput(), example_input=torch.randn(4, 3))
    step = sw.train_step(chain, lambda out, y: F.mse_loss(out.logits, y), sw.optim.sgd(0.1))
    _, metrics = step(step.init(params), (torch.randn(4, 3), torch.randn(4, 2)))
    assert float(metrics["grad_norm"]) > 0
    out = Output(torch.ones(2), None)
    leaves, spec = optree.tree_flatten(out)
    assert optree.tree_unflatten(spec, leaves) == out and len(leaves) == 1


def test_optree_still_has_the_global_namespace_we_register_in() -> None:
    """pytrees.py registers through optree's private global-namespace sentinel: fail loudly if
    optree renames it, and check a registered class flattens with no namespace given."""
    assert type(pytrees.GLOBAL_NAMESPACE).__name__ == "GlobalNamespace"

    @dataclasses.dataclass
    class Fresh:
        value: Tensor

    pytrees.register_output_types(Fresh(torch.ones(1)))
    assert optree.register_pytree_node.get(Fresh) is not None
    assert optree.tree_leaves(Fresh(torch.zeros(2)))[0].shape == (2,)


def test_dropout_in_training_mode_draws_as_the_module_does_and_the_split_pickles() -> None:
    """GPT-2's default config has dropout 0.1 in embeddings, attention and residuals: the split
    draws the same masks in the same order as the module (the head's replay of the embeddings
    runs them in eval mode), and survives pickling (the processes backend sends it)."""
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                       attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    model = T.GPT2LMHeadModel(cfg)
    assert model.training
    ids = token_batches(1)[0][0]
    chain, params = functionalize(model, units=T.models.gpt2.modeling_gpt2.GPT2Block, example_input=ids)
    torch.manual_seed(5)
    expected = call(model, ids).logits
    restored, restored_params = pickle.loads(pickle.dumps((chain, params)))
    torch.manual_seed(5)
    assert torch.equal(restored(restored_params, ids).logits, expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zero_at_world_4_zb_v_and_all_four_transforms_on_dp_pp(family: str) -> None:
    model, block = build(family)
    chain, params = functionalize(model, units=block)  # embed, 2 blocks, head: 4 layers
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    batches = token_batches()
    for stage in (1, 2, 3):
        sw.testing.assert_equivalent(sw.shard_params(step, "dp", stage), step, sw.Mesh(dp=4), batches, params)
    zb_v = sw.pipeline(step, "pp", "zb_v", microbatches=2)  # 2 stages a rank, in a V
    sw.testing.assert_equivalent(zb_v, step, sw.Mesh(pp=2), batches, params)
    f64 = "params=f64,compute=f64,output=f64"
    composed = sw.mixed_precision(
        sw.remat(sw.pipeline(sw.shard_params(step, "dp", 3), "pp", "1f1b", 2), sw.policies.dots_saveable), f64,
        loss_scale="dynamic",
    )
    reference = sw.mixed_precision(step, f64, loss_scale="dynamic")
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=2, pp=2), batches, params)


def test_padded_dict_batches_over_dp_equal_the_global_batch_when_the_loss_counts_tokens() -> None:
    """GPT-2's own loss is a mean over its shard's labels: over dp, a mean of shard means, unless the
    step is told how many tokens each shard's mean counted."""
    model, block = build("gpt2")
    batches = padded_batches("gpt2")
    for ids, _ in ((b[0]["labels"], None) for b in batches):
        ids[0, :] = -100  # one row of padding only: the dp shards count different numbers of tokens
    chain, params = functionalize(model, units=block, example_input=batches[0][0])

    def counted(inputs: dict[str, Tensor], targets: None) -> Tensor:
        return (inputs["labels"][:, 1:] != -100).sum()  # GPT-2 predicts each next token

    step = sw.train_step(chain, own_loss, sw.optim.sgd(0.1, momentum=0.9), tokens=counted)
    # transformers computes its loss in float32 (ForCausalLMLoss upcasts the logits), so each shard's
    # mean is rounded to float32 (2^-24 relative) before it is weighed by its count: 1e-6, not 1e-12.
    rtol = 1e-6
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params, rtol=rtol)
    # The mean of shard means is another step: refused by default (test_padded_labels.py), taken knowingly here.
    mean_step = sw.train_step(chain, own_loss, sw.optim.sgd(0.1, momentum=0.9), tokens="per_shard_mean")
    with pytest.raises(AssertionError, match="first divergence"):
        sw.testing.assert_equivalent(sw.shard_params(mean_step, "dp", 3), step, sw.Mesh(dp=2), batches, params,
                                     rtol=rtol)


# -- random numbers drawn outside torch ----------------------------------------------------------------


def _wav2vec2(mask_time_prob: float, torch_dropout: bool = True) -> Any:
    """Tiny Wav2Vec2ForCTC in training mode; ``torch_dropout=False``: its dropouts and LayerDrop (torch's
    generator) off, which per-rank streams would make differ from one device's."""
    torch.manual_seed(0)
    off = {} if torch_dropout else dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                         feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0)
    return T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, mask_time_prob=mask_time_prob, mask_time_length=2, pad_token_id=0, **off,
    )).double()


def _audio_batches(n: int = 2) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(4)
    # 400 samples: 48 frames after the convolutions (strides 4 and 2); 12 logits a frame
    return [(torch.randn(4, 400, dtype=torch.float64, generator=gen),
             torch.randn(4, 48, 12, dtype=torch.float64, generator=gen)) for _ in range(n)]


def _logits_loss(out: Any, targets: Tensor) -> Tensor:
    return F.mse_loss(out.logits, targets)


class _SpecAugmentMasks:
    """Records each rank's SpecAugment masks (Wav2Vec2's ``_compute_mask_indices``, drawn with np.random) in
    call order, or replays given ones; the calls on fake tensors (the Plan's predictions) pass."""

    def __init__(self, original: Callable[..., Any]) -> None:
        import threading

        self.original, self.drawn, self.replay, self.lock = original, {}, None, threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        from shardwise.collectives.backends.current import current_backend

        if self.replay is not None:
            return self.replay.pop(0)
        mask = self.original(*args, **kwargs)
        if not _get_current_dispatch_mode_stack():
            with self.lock:
                self.drawn.setdefault(current_backend().rank, []).append(mask.copy())
        return mask


def test_wav2vec2_with_specaugment_on_trains_as_one_device_under_zero3_and_remat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Wav2Vec2's SpecAugment (on by default: mask_time_prob=0.05) draws its masks with np.random, which
    the step now seeds for every compute and remat replays (it was refused at functionalize). ZeRO-3 at
    world 2: each rank draws its own masks for its half of the batch, so the single-device step replays
    the ranks' masks joined in batch order (as test_ep_dropout.py does for dropout) and must equal it.
    remat: bitwise the step without it, torch's dropouts and LayerDrop on as well."""
    import numpy as np

    from shardwise.testing.equivalence import compare_histories, record_history

    masks = _SpecAugmentMasks(T.models.wav2vec2.modeling_wav2vec2._compute_mask_indices)
    monkeypatch.setattr(T.models.wav2vec2.modeling_wav2vec2, "_compute_mask_indices", masks)
    batches = _audio_batches()
    model = _wav2vec2(0.05, torch_dropout=False)
    assert model.training
    chain, params = functionalize(model, example_input=batches[0][0])
    step = sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1, momentum=0.9))
    zero3, mesh = sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)
    masks.drawn.clear()
    per_rank = sw.launch(lambda: record_history(zero3, zero3.init(params, mesh), batches), 2)
    assert not np.array_equal(masks.drawn[0][0], masks.drawn[1][0])  # each rank its own stream
    masks.replay = [np.concatenate([masks.drawn[0][k], masks.drawn[1][k]]) for k in range(len(batches))]
    try:
        expected = record_history(step, step.init(params), batches)
    finally:
        masks.replay = None
    compare_histories(per_rank, expected, rtol=sw.testing.DEFAULT_RTOL[torch.float64])

    model = _wav2vec2(0.05)
    chain, params = functionalize(model, example_input=batches[0][0])
    step = sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1, momentum=0.9))

    def final(s: sw.Step) -> list[Tensor]:
        state = s.init(params)
        for b in batches:
            state, _ = s(state, b)
        return optree.tree_leaves(s.full_params(state))

    plain, rematted = final(step), final(sw.remat(step))
    assert all(torch.equal(a, b) for a, b in zip(plain, rematted, strict=True))


class _DrawsFromPython(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        import random

        return self.linear(x) * random.random()  # its output depends on the draw


def test_a_forward_drawing_from_pythons_random_is_accepted_and_the_chain_draws_as_the_module() -> None:
    """It was refused; functionalize now runs module and chain from the same state of Python's random
    (and numpy's), so the chain computes what the module does from the same state."""
    import random

    x = torch.randn(2, 4)
    module = _DrawsFromPython()
    chain, params = functionalize(module, example_input=x)
    random.seed(3)
    expected = module(x)
    random.seed(3)
    got = x
    for layer in chain:
        got = layer(chain.layer_params(params, layer), got)
    assert torch.equal(got, expected)


class _DrawsWithoutEffect(nn.Module):
    """A LayerDrop of probability 0, as MusicGen's decoder and Wav2Vec2's adapter run it: a draw every
    forward, which never drops a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.layerdrop = 0.0

    def forward(self, x: Tensor) -> Tensor:
        import random

        for layer in self.layers:
            if random.uniform(0, 1) >= self.layerdrop:
                x = layer(x)
        return x


def test_a_draw_that_changes_nothing_is_accepted() -> None:
    _chain, params = functionalize(_DrawsWithoutEffect(), example_input=torch.randn(2, 4))
    assert sum(len(v) for v in params.values()) == 4


def test_a_causal_lm_that_passes_its_kwargs_on_gets_its_cache_turned_off() -> None:
    """GraniteMoE's causal LM takes ``**kwargs`` where others name ``use_cache``, and its inner model turns
    the cache on from the config: every unit received a DynamicCache and the split was refused, asking for
    ``use_cache=False``. It gets ``use_cache=False`` through its kwargs and trains as one device."""
    torch.manual_seed(0)
    cfg = T.GraniteMoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, num_local_experts=4,
        num_experts_per_tok=2, experts_implementation="eager",  # grouped_mm takes no float64
    )
    assert cfg.use_cache
    model = T.GraniteMoeForCausalLM(cfg).double()
    assert "use_cache" not in inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),) * 2 for _ in range(2)]
    layer = T.models.granitemoe.modeling_granitemoe.GraniteMoeDecoderLayer
    chain, params = functionalize(model, units=layer, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                         sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)


def test_a_composite_config_caching_in_its_text_config_gets_the_cache_turned_off_too() -> None:
    """LLaVA's forward takes ``**kwargs`` and its config holds ``use_cache`` in ``text_config`` only."""
    from shardwise.engine.model.module_call import call_arguments

    cfg = T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, image_size=16, patch_size=8),
        text_config=T.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2),
        image_token_index=VOCAB - 1,
    )
    model = T.LlavaForConditionalGeneration(cfg)
    assert "use_cache" not in inspect.signature(model.forward).parameters and cfg.get_text_config().use_cache
    _, kwargs = call_arguments(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert kwargs["use_cache"] is False


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_every_layers_outputs_asked_of_a_split_by_units_are_refused_saying_which_flag(flag: str) -> None:
    """The structures alone were the message (a PyTreeSpec of an empty tuple against one of three)."""
    model, layer = llama()
    setattr(model.config, flag, True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    field = flag.removeprefix("output_")
    # Seen while the units run (engine/model/hf_collecting.py), before the structures are compared.
    with pytest.raises(FunctionalizeError, match=rf"collects its layers' {field} while they run.*{flag}=False.*"
                                                 r"units=None"):
        functionalize(model.double(), units=layer, example_input=ids)
    functionalize(model.double(), units=None, example_input=ids)  # one layer returns them as the module does


def test_a_reformers_reversible_layers_are_refused_at_functionalize() -> None:
    """transformers' Reformer runs its layers' forward again in its reversible layers' backward, on the modules'
    own parameters: functionalized as one layer (what the refusal of per-layer units suggests), its first backward
    crashed inside transformers on the chain's meta skeleton ("Tensor on device meta is not on the expected
    device cpu"). Refused by name, as activation checkpointing is."""
    config = T.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16, attn_layers=["local", "local"],
        feed_forward_size=64, axial_pos_embds=True, axial_pos_shape=(2, 4), axial_pos_embds_dim=(16, 16),
        local_attn_chunk_length=4, is_decoder=True, max_position_embeddings=8, hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = T.ReformerModelWithLMHead(config).double()
    with pytest.raises(FunctionalizeError, match=r"'reformer\.encoder' \(ReformerEncoder\) computes its layers as "
                                                 r"reversible residual layers"):
        sw.functionalize(model, example_input=torch.randint(3, 64, (4, 8)))


def _beit_batch(resolution: int) -> tuple[dict[str, Tensor], None]:
    g = torch.Generator().manual_seed(resolution)
    return ({"pixel_values": torch.randn(4, 3, resolution, resolution, generator=g, dtype=torch.float64),
             "labels": torch.randint(3, (4,), generator=g)}, None)


def test_a_size_handed_to_the_units_crosses_layers_as_a_constant() -> None:
    """BeitLayer is called with ``resolution=pixel_values.shape[2:]``, a torch.Size (a tuple of ints): it was refused
    as an object crossing a layer boundary. It is a constant, fixed at the example's value like an int: ZeRO-3 and a
    pipeline equal one device, and a batch of another resolution is refused, naming both values."""
    torch.manual_seed(0)
    model = T.BeitForImageClassification(T.BeitConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=8,
        num_labels=3, use_relative_position_bias=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0)).double()
    batches = [_beit_batch(16), _beit_batch(16)]
    chain, params = sw.functionalize(model, units=T.models.beit.modeling_beit.BeitLayer, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", 2), step, sw.Mesh(pp=2), batches, params)
    with pytest.raises(FunctionalizeError, match=r"has torch.Size\(\[8, 8\]\) where the example had "
                                                 r"torch.Size\(\[16, 16\]\)"):
        step(step.init(params), _beit_batch(8))


def test_a_vision_model_split_without_an_example_is_refused_naming_its_main_input() -> None:
    """Found by session 41's probing: transformers offers dummy input_ids to a ViT too, and the recording failed
    inside the model ("not enough values to unpack"), naming neither example_input nor pixel_values."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, num_labels=5)
    model = transformers.ViTForImageClassification(config)
    layer = transformers.models.vit.modeling_vit.ViTLayer
    with pytest.raises(FunctionalizeError, match=r"ViTForImageClassification .* offers no dummy pixel_values, its "
                       r"main input; pass example_input= .*\{'pixel_values': \.\.\.\}"):
        functionalize(model, units=layer)
    chain, params = functionalize(model, units=layer, example_input={"pixel_values": torch.randn(2, 3, 16, 16)})
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(chain(params, {"pixel_values": x}).logits, model(pixel_values=x).logits)

