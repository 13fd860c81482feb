"""A Colwise outside any Region inside a sequence-parallel block gathers the sequence at its own input.

The code around it still holds the rank's slice. Hugging Face BERT's, RoBERTa's and DistilBERT's
attention reads that slice's length and views the gathered projections by it
(``view(*hidden_states.shape[:-1], -1, head_dim)``): with the docs' no-Region BERT plan and
``sequence_parallel=`` the step failed on the attention mask, blaming a missing Rowwise that was in
the plan ("no Rowwise() took it ... size of tensor a (4) must match ... b (8)"). It is now refused
at that reshape, naming the Colwise, the block, the two lengths and the ways out. The same plans
without sequence parallel, DistilBERT's Regions under it, and an MLP's Colwise outside any Region
inside a sequence-parallel block (position by position: its gather is right) train as the
single-device step.

Tiny float64 models (random weights from configs, nothing downloaded) on thread ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

F64_RTOL = 1e-12
LABELS = 3
ROBERTA_BLOCKS = "roberta.encoder.layer.*"
DISTILBERT_BLOCKS = "distilbert.transformer.layer.*"


def _roberta() -> nn.Module:
    return T.RobertaForSequenceClassification(T.RobertaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=LABELS, pad_token_id=1))


def _distilbert() -> nn.Module:
    return T.DistilBertForSequenceClassification(T.DistilBertConfig(
        vocab_size=64, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=40, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=LABELS))


def _bert_plan(prefix: str) -> dict[str, Any]:
    """docs/tensor_parallel.md's BERT advice: no Region (each Colwise enters the region itself)."""
    return {f"{prefix}.*.attention.self.[qkv]*": sw.tp.Colwise(), f"{prefix}.*.attention.output.dense": sw.tp.Rowwise(),
            f"{prefix}.*.intermediate.dense": sw.tp.Colwise(), f"{prefix}.*.output.dense": sw.tp.Rowwise()}


DISTILBERT_PLAN = {
    f"{DISTILBERT_BLOCKS}.attention.[qkv]_lin": sw.tp.Colwise(),
    f"{DISTILBERT_BLOCKS}.attention.out_lin": sw.tp.Rowwise(),
    f"{DISTILBERT_BLOCKS}.ffn.lin1": sw.tp.Colwise(),
    f"{DISTILBERT_BLOCKS}.ffn.lin2": sw.tp.Rowwise(),
}
ENCODERS = {
    "roberta": (_roberta, "RobertaLayer", _bert_plan("roberta.encoder.layer"), ROBERTA_BLOCKS),
    "distilbert": (_distilbert, "TransformerBlock", DISTILBERT_PLAN, DISTILBERT_BLOCKS),
}


def _batches(n: int = 2, batch: int = 4, seq: int = 8) -> list[Any]:
    """Padded batches: the attention mask holds the whole sequence."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(2, 64, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, -3:] = 0
        ids[1, -3:] = 1
        out.append(({"input_ids": ids, "attention_mask": mask}, torch.randint(LABELS, (batch,), generator=gen)))
    return out


def _cls_loss(out: Any, labels: Tensor) -> Tensor:
    return F.cross_entropy(out.logits, labels)


def _encoder(name: str) -> tuple[sw.Step, Any, list[Any], dict[str, Any], str]:
    make, unit, plan, blocks = ENCODERS[name]
    torch.manual_seed(0)
    model = make().double()
    batches = _batches()
    layer = next(type(m) for m in model.modules() if type(m).__name__ == unit)
    chain, params = sw.functionalize(model, units=layer, example_input=batches[0][0])
    return sw.train_step(chain, _cls_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches, plan, blocks


@pytest.mark.parametrize(("name", "colwise", "block"), [
    ("roberta", "roberta.encoder.layer.0.attention.self.query", "roberta.encoder.layer.0"),
    ("distilbert", "distilbert.transformer.layer.0.attention.q_lin", "distilbert.transformer.layer.0"),
])
def test_the_no_region_plan_under_sequence_parallel_is_refused_naming_the_gather(
    name: str, colwise: str, block: str
) -> None:
    """It blamed a missing Rowwise (in the plan) with torch's bare size error at the attention mask."""
    step, params, batches, plan, blocks = _encoder(name)
    tp = sw.tensor_parallel(step, "tp", plan, sequence_parallel=blocks)
    message = (
        rf"Colwise\(\) on '{colwise}' sits outside any Region inside the sequence-parallel block '{block}', so "
        r"it gathers the sequence at its own input \(8 positions from this rank's 4\).* reshapes its output "
        r"\(4, 8, 16\) to \(4, 4, 4, 8\).*Put a Region on the module that holds the Colwise and its Rowwise.*"
        r"leave the block out of sequence_parallel"
    )
    with pytest.raises(ValueError, match=message):
        tp.plan(sw.Mesh(tp=2), params, batches[0])
    with pytest.raises(sw.collectives.RankFailed, match=message):
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), batches[0]), 2)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_the_no_region_plan_without_sequence_parallel_trains_equal(name: str) -> None:
    """The way out for BERT and RoBERTa (whose attention.output adds the residual: no Region fits)."""
    step, params, batches, plan, _ = _encoder(name)
    report = sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                          rtol=F64_RTOL)
    assert report.steps == 2, report


@pytest.mark.parametrize("ffn_region", [True, False])
def test_distilbert_regions_under_sequence_parallel_train_equal(ffn_region: bool) -> None:
    """The way out the refusal names; an MLP's Colwise outside any Region in the block (no Region on ffn)
    gathers the sequence itself and computes position by position: right, and not refused."""
    step, params, batches, plan, blocks = _encoder("distilbert")
    regions = {f"{blocks}.attention": sw.tp.Region(heads=("n_heads",))}
    if ffn_region:
        regions[f"{blocks}.ffn"] = sw.tp.Region()
    tp = sw.tensor_parallel(step, "tp", {**plan, **regions}, sequence_parallel=blocks)
    report = sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)
    assert report.steps == 2, report


class _LengthGatedMLP(nn.Module):
    """up, a gate built from its input's shape (the slice's length), down."""

    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.ones(x.shape[:-1], dtype=x.dtype).unsqueeze(-1)
        return self.down(F.gelu(self.up(x)) * gate)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(8), _LengthGatedMLP()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.norm(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


def test_torch_failing_on_the_two_lengths_is_said_by_the_gather() -> None:
    """No reshape to see: torch's size error names the slice's length and the gathered one."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(_Net().double(), units=_Block)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(2, 8, 8, dtype=torch.float64), torch.randn(2, 8, 8, dtype=torch.float64))
    plan = {"blocks.*.mlp.up": sw.tp.Colwise(), "blocks.*.mlp.down": sw.tp.Rowwise()}
    tp = sw.tensor_parallel(step, "tp", plan, sequence_parallel="blocks.*")
    with pytest.raises(sw.collectives.RankFailed, match=(
        r"Colwise\(\) on 'blocks\.0\.mlp\.up' sits outside any Region inside the sequence-parallel block "
        r"'blocks\.0'.*\('blocks\.0\.mlp'\).* failed \(RuntimeError: The size of tensor a \(8\) must match"
    )):
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), batch), 2)
    fixed = sw.tensor_parallel(step, "tp", {**plan, "blocks.*.mlp": sw.tp.Region()}, sequence_parallel="blocks.*")
    sw.testing.assert_equivalent(fixed, step, sw.Mesh(tp=2), [batch, batch], params, rtol=F64_RTOL)
