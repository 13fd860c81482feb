"""Padded labels under a cut batch: a mean loss per share (``train_step(tokens=None)``) is a mean of the
shares' means, which padding makes another loss than the single-device step's. Refused, naming ``tokens=``.

Hugging Face GPT-2 (tiny, float64) with labels padded by -100 (cross_entropy's ignore_index), under dp=2
and under pipeline micro-batches. The reference is the single-device step with ``tokens=None``: the mean
over the global batch's counted tokens. With ``tokens=count`` the distributed step equals it to float64
rounding (assert_equivalent's default); ``tokens="per_shard_mean"`` is the mean of the shares' means,
which the test computes by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import shardwise as sw
from shardwise.collectives.launch import RankFailed

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ, BATCH = 32, 6, 4


def gpt2() -> tuple[sw.Chain, Any]:
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    model = T.GPT2LMHeadModel(cfg).double()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return sw.functionalize(model, units=T.models.gpt2.modeling_gpt2.GPT2Block, example_input=ids)


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    """Mean cross entropy over the counted (not -100) targets, in float64."""
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def counted(inputs: Any, targets: Tensor) -> Tensor:
    return (targets != -100).sum()


def batches(padded: bool, n: int = 2) -> list[tuple[Tensor, Tensor]]:
    """Row 0 of each batch nearly all padding, row 3 a little: the shares count different numbers of tokens."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
        if padded:
            labels[0, 1:] = -100
            labels[3, SEQ - 2 :] = -100
        out.append((ids, labels))
    return out


STACKS: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "dp=2": (lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2)),
    "pp=2 x 2 micro-batches": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2)),
}


def _run(step: sw.Step, mesh: sw.Mesh, params: Any, batch: Any) -> list[Any]:
    def main() -> Any:
        state = step.init(params, mesh)
        return step(state, batch)[1]["loss"]

    return sw.launch(main, mesh.size, timeout=120)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_mean_loss_on_padded_labels_is_refused_naming_tokens(stack: str) -> None:
    chain, params = gpt2()
    transform, mesh = STACKS[stack]
    step = transform(sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)))
    cut = "shard_params over axis 'dp' of size 2" if "dp" in stack else "2 micro-batches"
    refused = rf"ValueError: train_step\(tokens=None\) on a batch the step cuts \({cut}\): batch\[1\] holds negative"
    with pytest.raises(RankFailed, match=rf"{refused} integers(.|\n)*tokens=lambda"):
        _run(step, mesh, params, batches(padded=True)[0])


def test_the_refusal_names_the_padding_it_found_and_counts_it() -> None:
    """The review (s39 loss F9): targets padded with -1 (nanoGPT's ignore_index) were refused naming -100, with the
    example count (targets != -100).sum(), which counts the -1 padding (2.5e-3 off, no error, where the model's own
    loss is not probed)."""
    chain, params = gpt2()
    step = sw.shard_params(sw.train_step(chain, lambda out, t: F.cross_entropy(
        out.logits.flatten(0, 1), t.flatten(), ignore_index=-1), sw.optim.sgd(0.1)), "dp", 3)
    ids, labels = batches(padded=True)[0]
    with pytest.raises(RankFailed, match=r"batch\[1\] holds negative integers \(-1: padded labels.*"
                                         r"tokens=lambda inputs, targets: \(targets != -1\)\.sum\(\)"):
        _run(step, sw.Mesh(dp=2), params, (ids, labels.masked_fill(labels == -100, -1)))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_padded_labels_with_tokens_equal_the_single_device_step(stack: str) -> None:
    chain, params = gpt2()
    reference = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))  # tokens=None: no cut, no refusal
    weighted = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9), tokens=counted)
    transform, mesh = STACKS[stack]
    sw.testing.assert_equivalent(transform(weighted), reference, mesh, batches(padded=True), params)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_per_shard_mean_opts_out_and_is_the_mean_of_the_shares_means(stack: str) -> None:
    chain, params = gpt2()
    reference = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    opted = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9), tokens="per_shard_mean")
    transform, mesh = STACKS[stack]
    ids, labels = batch = batches(padded=True)[0]
    halves = [chain(params, part).logits for part in ids.chunk(2)]
    by_hand = sum(F.cross_entropy(h.flatten(0, 1), t.flatten(), ignore_index=-100) for h, t in
                  zip(halves, labels.chunk(2), strict=True)) / 2
    whole = lm_loss(chain(params, ids), labels)
    assert not torch.allclose(by_hand, whole, rtol=1e-6)  # the padding makes them differ
    for loss in _run(transform(opted), mesh, params, batch):
        torch.testing.assert_close(loss, by_hand.detach(), rtol=1e-12, atol=0)
    # On one device the opt-out is the plain step: nothing is cut.
    assert torch.equal(opted(opted.init(params), batch)[1]["loss"], reference(reference.init(params), batch)[1]["loss"])
    with pytest.raises(AssertionError, match="first divergence"):  # and the distributed one is another step
        sw.testing.assert_equivalent(transform(opted), reference, mesh, batches(padded=True), params)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_unpadded_labels_and_float_targets_run_with_a_mean_loss(stack: str) -> None:
    chain, params = gpt2()
    reference = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    transform, mesh = STACKS[stack]
    sw.testing.assert_equivalent(transform(reference), reference, mesh, batches(padded=False), params)

    def soft(out: Any, targets: Tensor) -> Tensor:  # negative floats are values, not padding
        return F.mse_loss(out.logits, targets)

    floats = [(ids, torch.randn(BATCH, SEQ, VOCAB, dtype=torch.float64) - 5) for ids, _ in batches(padded=False)]
    step = sw.train_step(chain, soft, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(transform(step), step, mesh, floats, params)


def test_a_mesh_axis_of_size_one_cuts_nothing_and_a_mean_on_padded_labels_runs() -> None:
    """ZeRO over dp=1 (a run sized down to one rank) holds the whole batch: its mean over the counted
    tokens is the single-device step's. The axis was counted as a cut, and the step refused."""
    chain, params = gpt2()
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=1), batches(padded=True), params)


def test_labels_inside_a_dict_batch_are_found_for_the_models_own_loss() -> None:
    chain, params = gpt2()
    ids, labels = batches(padded=True)[0]
    own = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1))
    with pytest.raises(RankFailed, match=r"batch\['labels'\] holds negative integers(.|\n)*GPT2LMHeadModel's own "
                                         r"loss, which shifts its labels: \(inputs\['labels'\]\[:, 1:\] != -100\)"):
        _run(sw.shard_params(own, "dp", 3), sw.Mesh(dp=2), params, {"input_ids": ids, "labels": labels})


def test_an_encoder_decoders_own_loss_is_counted_over_every_label_as_the_refusal_says() -> None:
    """An encoder-decoder's own loss does not shift its labels: the refusal's count for GPT-2's (labels[:, 1:]) made
    Whisper train another model under ZeRO-3 (2.3e-4 in the loss, no error: the probe cannot see a model's own
    scalar loss). The refusal names the count of the model at hand, and that count trains as one device."""
    torch.manual_seed(0)
    model = T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=16, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2)).double()
    ids, labels = batches(padded=True)[0]
    batch = {"input_ids": ids, "labels": labels}
    chain, params = sw.functionalize(model, example_input=batch)
    own = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1))
    with pytest.raises(RankFailed, match=r"BartForConditionalGeneration's own loss, which counts every label it is "
                                         r"given: \(inputs\['labels'\] != -100\)\.sum\(\)"):
        _run(sw.shard_params(own, "dp", 3), sw.Mesh(dp=2), params, batch)
    counting = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1),
                             tokens=lambda inputs, _: (inputs["labels"] != -100).sum())
    sw.testing.assert_equivalent(sw.shard_params(counting, "dp", 3), counting, sw.Mesh(dp=2), [(batch, None)], params)


def test_train_step_names_the_opt_out_among_the_token_options() -> None:
    chain, _ = gpt2()
    with pytest.raises(ValueError, match="'per_shard_mean'"):
        sw.train_step(chain, lm_loss, sw.optim.sgd(0.1), tokens="mean")


def test_context_parallel_cuts_sequences_and_refuses_a_mean_loss_on_padded_labels() -> None:
    """Right padding leaves the sequence's later parts fewer tokens: the parts' means differ in count too."""
    from shardwise.testing.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=8, n_heads=2, n_layers=1, seq_len=8).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    gen = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(VOCAB, (2, 8), generator=gen), torch.randint(VOCAB, (2, 8), generator=gen)
    labels[0, 5:] = -100
    mean = sw.context_parallel(sw.train_step(chain, loss, sw.optim.sgd(0.1)), "cp")
    with pytest.raises(RankFailed, match=r"cuts \(context_parallel over axis 'cp'\): batch\[1\] holds negative"):
        _run(mean, sw.Mesh(cp=2), params, (ids, labels))
    reference = sw.train_step(chain, loss, sw.optim.sgd(0.1))
    weighted = sw.train_step(chain, loss, sw.optim.sgd(0.1), tokens=counted)
    sw.testing.assert_equivalent(sw.context_parallel(weighted, "cp"), reference, sw.Mesh(cp=2), [(ids, labels)], params)


class _OffsetNet(torch.nn.Module):
    """A regression on a float feature and a signed integer one (a relative offset in [-5, 5])."""

    def __init__(self) -> None:
        super().__init__()
        self.off = torch.nn.Embedding(11, 4)
        self.fc = torch.nn.Linear(6 + 4, 1)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        x, offset = inputs
        return self.fc(torch.cat([x, self.off(offset + 5)], -1))


def test_negative_integer_inputs_are_features_and_only_the_targets_are_read_for_padding() -> None:
    """In an (inputs, targets) batch the labels are the targets: a negative integer input is a feature,
    and a mean loss on float targets over dp=2 is the single-device step (it was refused as padding).
    Where the inputs hold the labels (targets None), they are still read."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(_OffsetNet().double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-2))
    gen = torch.Generator().manual_seed(0)
    offset_batches = [
        ((torch.randn(8, 6, dtype=torch.float64, generator=gen), torch.randint(-5, 6, (8,), generator=gen)),
         torch.randn(8, 1, dtype=torch.float64, generator=gen))
        for _ in range(2)
    ]
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), offset_batches, params)

    chain, params = gpt2()
    ids, labels = batches(padded=True)[0]
    own = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1))
    with pytest.raises(RankFailed, match=r"batch\[0\]\['labels'\] holds negative integers"):
        _run(sw.shard_params(own, "dp", 3), sw.Mesh(dp=2), params, ({"input_ids": ids, "labels": labels}, None))
    # Labels named so in the inputs are read whatever the targets are (a model's own loss ignores them).
    with pytest.raises(RankFailed, match=r"batch\[0\]\['labels'\] holds negative integers"):
        _run(sw.shard_params(own, "dp", 3), sw.Mesh(dp=2), params,
             ({"input_ids": ids, "labels": labels}, torch.zeros(ids.shape[0])))


def test_the_refusal_counts_a_decoder_only_conditional_generators_labels_shifted() -> None:
    """LLaVA's own loss (loss_type ForConditionalGeneration) is transformers' causal-LM loss, which shifts its labels:
    the refusal named every label for it (4.5e-4 off followed), as for an encoder-decoder."""
    torch.manual_seed(0)
    model = T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, image_size=8, patch_size=4),
        text_config=T.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2), image_token_index=VOCAB - 1))
    ids, labels = batches(padded=True)[0]
    batch = {"input_ids": ids % (VOCAB - 1), "labels": labels}
    chain, params = sw.functionalize(model.double(), example_input=batch)
    own = sw.train_step(chain, lambda out, _: out.loss, sw.optim.sgd(0.1))
    with pytest.raises(RankFailed, match=r"LlavaForConditionalGeneration's own loss, which shifts its labels: "
                                         r"\(inputs\['labels'\]\[:, 1:\] != -100\)"):
        _run(sw.shard_params(own, "dp", 3), sw.Mesh(dp=2), params, batch)

