"""A Region's unsplit parameters: summed over the axis only where they act on per-rank values.

A Region used to sum the gradient of every unsplit parameter inside it over ``tp``. One used only
after the split layers (a LayerNorm or a gain after the Rowwise's sum, a projection on a gathered
Colwise output) acts on whole values, whose gradient every rank already holds whole: summed, it
came out tp times too large on every rank alike, so no replica check could see it. Its first
forward now reads on which side of the split layers each one is used. Also: a Colwise gathering
its output inside a sequence-parallel block is refused by name (it was torch's bare size error),
a head that owns the bias its decoder splits (Hugging Face's BERT / RoBERTa MLM heads) takes a
vocabulary split, and a vocabulary the axis does not divide is refused with how to pad it.

Every case is a small float64 model on thread ranks, compared with the single-device step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

F64_RTOL = 1e-12


class PostNormFFN(nn.Module):
    """up, down, then a LayerNorm after the Rowwise's sum (a post-norm inside the FFN module)."""

    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.up, self.down, self.post_norm = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.down(F.gelu(self.up(x))))


class GainedFFN(nn.Module):
    """A gain before the Rowwise (per-rank values) and an output gain after its sum (whole values)."""

    def __init__(self, d: int = 8, h: int = 16, shared: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)
        self.inner = nn.Parameter(torch.tensor(1.3))
        self.out_scale = nn.Parameter(torch.tensor(0.7))
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.out_scale if self.shared else self.inner  # shared: one gain used on both sides
        return self.down(torch.tanh(self.up(x)) * inner) * self.out_scale


class Blk(nn.Module):
    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.n1, self.ffn, self.n2, self.g = nn.LayerNorm(8), PostNormFFN(), nn.LayerNorm(8), GainedFFN(shared=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ffn(self.n1(x))
        return x + self.g(self.n2(x))


class Net(nn.Module):
    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Blk(shared), Blk(shared)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


PLAN: dict[str, Any] = {
    "blocks.*.ffn": sw.tp.Region(), "blocks.*.ffn.up": sw.tp.Colwise(), "blocks.*.ffn.down": sw.tp.Rowwise(),
    "blocks.*.g": sw.tp.Region(), "blocks.*.g.up": sw.tp.Colwise(), "blocks.*.g.down": sw.tp.Rowwise(),
}


def _net(shared: bool = False) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(Net(shared).double(), units=["blocks"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, 8, dtype=torch.float64, generator=gen),
                torch.randn(4, 6, 8, dtype=torch.float64, generator=gen)) for _ in range(3)]
    return step, params, batches


@pytest.mark.parametrize("sequence_parallel", [None, "blocks.*"])
def test_parameters_after_the_rowwise_sum_are_not_summed_again(sequence_parallel: str | None) -> None:
    """post_norm and out_scale act on the Rowwise's summed output: whole values, whole gradients (their
    gradient was summed over tp: grad_norm 11% off at tp 2, no error). The inner gain acts on each rank's
    hidden slice and is still summed; under sequence parallel everything is a slice and summed."""
    step, params, batches = _net()
    tp = sw.tensor_parallel(step, "tp", PLAN, sequence_parallel=sequence_parallel)
    report = sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)
    assert report.steps == 3, report


def test_a_parameter_used_before_and_after_the_rowwise_sum_is_refused() -> None:
    """One gain multiplying the hidden slice and the summed output: its gradient is part per-rank, part
    whole; no sum over the axis makes it right (it trained silently wrong)."""
    step, params, batches = _net(shared=True)
    tp = sw.tensor_parallel(step, "tp", PLAN)
    with pytest.raises(sw.collectives.RankFailed, match=r"\['blocks\.0\.g\.out_scale'\] act inside Region "
                       r"'blocks\.0\.g' both on per-rank values .* and on whole values"):
        sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches[:1], params)


@pytest.fixture(scope="module")
def llama() -> tuple[sw.Step, Any, list[Any]]:
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16)).double()
    ids = torch.randint(64, (2, 4, 9), generator=torch.Generator().manual_seed(1))
    batches = [(s[:, :-1], s[:, 1:]) for s in ids]
    chain, params = sw.functionalize(model, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                     example_input=batches[0][0])
    loss = lambda out, t: sw.tp.vocab_parallel_cross_entropy(out.logits, t)  # noqa: E731
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


# Not judged (sw.tp.RegionNotJudged): the advice followed gathers the MLP's Colwise outputs: not judged
@pytest.mark.filterwarnings("ignore::shardwise.tp.RegionNotJudged")
def test_the_refusal_of_a_region_without_its_rowwise_advises_what_works(llama: Any) -> None:
    """llama_plan without down_proj is refused, advising Colwise(output='replicated'). Following that
    advice (the Region kept, down_proj unsplit on the gathered output) used to sum down_proj's whole
    gradient over tp (grad_norm 1.5712 vs 1.5675, silently); it is the single-device step now."""
    step, params, batches = llama
    plan = sw.tp.llama_plan()
    del plan["model.layers.*.mlp.down_proj"]
    with pytest.raises(ValueError, match=r"no Rowwise\(\) to sum them.*give the Colwise output='replicated'"):
        sw.tensor_parallel(step, "tp", plan)
    plan["model.layers.*.mlp.gate_proj"] = plan["model.layers.*.mlp.up_proj"] = sw.tp.Colwise(output="replicated")
    report = sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                          rtol=F64_RTOL)
    assert report.steps == 2, report


# Not judged (sw.tp.RegionNotJudged): gathered q, k, v in the Region: no rank computes them alone, not judged
@pytest.mark.filterwarnings("ignore::shardwise.tp.RegionNotJudged")
def test_an_unsplit_output_projection_after_gathered_heads_is_not_summed(llama: Any) -> None:
    """q, k, v Colwise(output='replicated') in the attention Region, o_proj unsplit: grad_norm was 12.7% off."""
    step, params, batches = llama
    plan = {**sw.tp.llama_plan(), "model.layers.*.self_attn.[qkv]_proj": sw.tp.Colwise(output="replicated")}
    del plan["model.layers.*.self_attn.o_proj"]
    report = sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                          rtol=F64_RTOL)
    assert report.steps == 2, report


def test_a_gathered_colwise_in_a_sequence_parallel_block_is_refused(llama: Any) -> None:
    """Its output holds the whole sequence where the block holds a slice: it failed at Llama's residual add
    with torch's bare 'size of tensor a (4) must match ... b (8)'."""
    step, _, _ = llama
    gathered = sw.tp.Colwise(output="replicated")
    plan = {**sw.tp.llama_plan(), "model.layers.*.mlp.gate_proj": gathered, "model.layers.*.mlp.up_proj": gathered}
    del plan["model.layers.*.mlp.down_proj"]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj', inside a sequence-parallel block.*"
                       r"leave the block out of sequence_parallel"):
        sw.tensor_parallel(step, "tp", plan, sequence_parallel=sw.tp.LLAMA_BLOCKS)


def test_per_head_norms_inside_the_attention_region_are_still_summed() -> None:
    """Qwen3's q_norm / k_norm act on each rank's heads (between the Colwise and the Rowwise): summed."""
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    torch.manual_seed(0)
    model = T.Qwen3ForCausalLM(T.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=16)).double()
    ids = torch.randint(64, (2, 4, 9), generator=torch.Generator().manual_seed(1))
    batches = [(s[:, :-1], s[:, 1:]) for s in ids]
    chain, params = sw.functionalize(model, units=T.models.qwen3.modeling_qwen3.Qwen3DecoderLayer,
                                     example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, t: sw.tp.vocab_parallel_cross_entropy(out.logits, t),
                         sw.optim.sgd(0.1, momentum=0.9))
    for sp in (None, sw.tp.LLAMA_BLOCKS):
        tp = sw.tensor_parallel(step, "tp", sw.tp.llama_plan(), sequence_parallel=sp)
        report = sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)
        assert report.steps == 2, report


# -- a head that owns the bias its decoder splits --------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_masked_lm_head_whose_bias_is_its_decoders_takes_a_vocabulary_split(family: str) -> None:
    """Hugging Face ties BertLMPredictionHead.bias (RobertaLMHead.bias) to decoder.bias, and only the
    decoder adds it. The head was refused as a second, unsplit user of the bias; its forward never reads it."""
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=20, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "bert":
        model, layer, head = T.BertForMaskedLM(T.BertConfig(**kw)).double(), "bert", "cls.predictions.decoder"
        unit = T.models.bert.modeling_bert.BertLayer
    else:
        model, layer, head = T.RobertaForMaskedLM(T.RobertaConfig(**kw)).double(), "roberta", "lm_head.decoder"
        unit = T.models.roberta.modeling_roberta.RobertaLayer
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(2, 64, (4, 8), generator=gen) for _ in range(2)]
    batches = [({"input_ids": i}, i) for i in ids]
    chain, params = sw.functionalize(model, units=unit, example_input=batches[0][0])
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o.logits, y),
                         sw.optim.sgd(0.1, momentum=0.9))
    block = f"{layer}.encoder.layer.*"
    plan: dict[str, Any] = {
        f"{block}.attention.self.[qkv]*": sw.tp.Colwise(), f"{block}.attention.output.dense": sw.tp.Rowwise(),
        f"{block}.intermediate.dense": sw.tp.Colwise(), f"{block}.output.dense": sw.tp.Rowwise(),
        f"{layer}.embeddings.word_embeddings": sw.tp.Rowwise(), head: sw.tp.Colwise(),
    }
    report = sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches,
                                          params, rtol=1e-10)
    assert report.steps == 2, report


class OwnHead(nn.Module):
    """A head whose own forward reads the bias it shares with its decoder: the whole bias, meant."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(8, 6)
        self.bias = self.decoder.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x) + self.bias.sum()


def test_a_head_that_reads_the_bias_its_decoder_splits_is_refused() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), OwnHead()).double()
    chain, params = sw.functionalize(net, units=["0", "1"])
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64))
    tp = sw.tensor_parallel(step, "tp", {"1.decoder": sw.tp.Colwise(output="replicated")})
    # Refused by the watch of split-weight reads (weight_reads.py) at the read itself, before the head's own
    # check (OwnedOnly, after its forward) would.
    with pytest.raises(sw.collectives.RankFailed, match=r"layer '1' reads parameter '1\.decoder\.bias' outside the "
                       r"forward of the module that splits it, '1\.decoder' .*\(sum, at test_region_parameter_sides"):
        sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), [batch], params)


# -- a vocabulary the axis does not divide -------------------------------------------------------


def test_a_vocabulary_the_axis_does_not_divide_is_refused_with_how_to_pad_it() -> None:
    """GPT-2's 50257 tokens divide by no tp size: gpt2_plan was refused with 'use a tensor-parallel size that
    divides it', which none does. The refusal says how to pad it; padded as it says, the plan runs."""
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=63, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0)).double()
    ids = torch.randint(63, (2, 4, 9), generator=torch.Generator().manual_seed(1))
    batches = [(s[:, :-1], s[:, 1:]) for s in ids]
    unit = T.models.gpt2.modeling_gpt2.GPT2Block
    loss = lambda out, t: sw.tp.vocab_parallel_cross_entropy(out.logits, t)  # noqa: E731
    chain, params = sw.functionalize(model, units=unit, example_input=batches[0][0])
    step = sw.train_step(chain, loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"dim 0 \(63\) does not split into 2 equal parts.*pad the vocabulary.*"
                       r"model\.resize_token_embeddings\(pad_to_multiple_of=64\)"):
        sw.tensor_parallel(step, "tp", sw.tp.gpt2_plan()).plan(sw.Mesh(tp=2), params, batches[0])
    model.resize_token_embeddings(pad_to_multiple_of=64, mean_resizing=False)
    chain, params = sw.functionalize(model, units=unit, example_input=batches[0][0])
    step = sw.train_step(chain, loss, sw.optim.sgd(0.1))
    report = sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", sw.tp.gpt2_plan()), step, sw.Mesh(tp=2),
                                          batches, params, rtol=F64_RTOL)
    assert report.steps == 2, report
