"""sw.context_parallel on HF GPT-2 (a learned position table read through ``positions=``), with dropout,
over drawn sequence lengths, and its ring bytes against the formula computed here from the model.

float64 on thread ranks, equal to the single-device step to rounding (assert_equivalent's default).
Dropout cannot equal the single device (each rank draws its own masks for its part of the sequence,
as data-parallel ranks do for their part of the batch): with it, a run is bitwise repeatable, the
ranks' masks differ, remat replays them exactly, and the replicated gradients still agree.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardwise as sw
from shardwise.testing.models import TinyGPT
from shardwise.transforms.context_parallel import context_parallel

from .test_cp_step import VOCAB, gpt, next_token_loss

SEQ = 16


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def token_batches(n: int = 2, size: int = 2, seq: int = SEQ, vocab: int = VOCAB) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (size, seq + 1), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


# -- Hugging Face GPT-2 -------------------------------------------------------------------------------
def gpt2(example: Any, dropout: float = 0.0) -> tuple[sw.Step, Any]:
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=2 * SEQ, bos_token_id=0,
                       eos_token_id=0, attn_implementation="sdpa", resid_pdrop=dropout, embd_pdrop=dropout,
                       attn_pdrop=0.0)
    chain, params = sw.functionalize(T.GPT2LMHeadModel(cfg).double(), units=T.models.gpt2.modeling_gpt2.GPT2Block,
                                     example_input=example)
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params


@pytest.mark.parametrize(("attention", "cp"), [("ring", 2), ("ring", 4), ("ulysses", 2)])
def test_gpt2_with_its_position_table_listed_equals_the_single_device_step(attention: str, cp: int) -> None:
    data = token_batches()
    step, params = gpt2(data[0][0])
    with pytest.raises(ValueError, match=r"'transformer.wpe.weight', named like a learned position table"):
        context_parallel(step, "cp").plan(sw.Mesh(cp=cp), params, data[0])
    composed = context_parallel(step, "cp", attention=attention, positions=("wpe.weight",))
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=cp), data, params)


def test_gpt2_on_packed_sequences_reads_its_table_at_the_batch_positions() -> None:
    """Position ids the batch gives (restarting per document) are each token's own: the table is read at
    them as on one device, not re-ordered to the rank's global positions."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]] * 2)
    data = [({"input_ids": x, "attention_mask": None, "position_ids": positions}, y) for x, y in token_batches()]
    step, params = gpt2(data[0][0])
    composed = context_parallel(step, "cp", positions=("wpe.weight",))
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=2), data, params)


def test_gpt2_attention_dropout_and_eager_attention_are_refused() -> None:
    T = pytest.importorskip("transformers")
    data = token_batches()
    for config, match in (({"attn_pdrop": 0.1}, r"config.attn_pdrop=0.1.*set config.attn_pdrop = 0"),
                          ({"attn_implementation": "eager"}, r"runs attn_implementation='eager'")):
        torch.manual_seed(0)
        cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=4, n_positions=2 * SEQ, bos_token_id=0,
                           eos_token_id=0, **{"attn_implementation": "sdpa", **config})
        chain, params = sw.functionalize(T.GPT2LMHeadModel(cfg).double(), units=T.models.gpt2.modeling_gpt2.GPT2Block,
                                         example_input=data[0][0])
        step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
        with pytest.raises(Exception, match=match):
            cp = context_parallel(step, "cp", positions=("wpe.weight",))
            sw.launch(lambda cp=cp, params=params: cp(cp.init(params, sw.Mesh(cp=2)), data[0]), 2, timeout=60)


# -- dropout -----------------------------------------------------------------------------------------
class Probe(nn.Module):
    """Dropout that keeps each thread rank's masks (the tensor-parallel tests' probe)."""

    masks: ClassVar[dict[int, list[torch.Tensor]]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = F.dropout(torch.ones_like(x), p=0.5, training=self.training)
        Probe.masks.setdefault(threading.get_ident(), []).append(mask.detach().clone())
        return x * mask


class DropGPT(TinyGPT):
    """TinyGPT with dropout on the embeddings and probed dropout at every block's input (inside the
    block units: a unit runs as a module, so the probe sees every call)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = nn.ModuleList(nn.Sequential(Probe(), block) for block in self.blocks)
        self.drop = nn.Dropout(0.2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        x = self.drop(x + self.pos_emb[:, : x.size(1)])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def drop_step() -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = DropGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    return sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def train(step: sw.Step, mesh: sw.Mesh, params: Any, data: list[Any], seed: int = 0) -> list[list[torch.Tensor]]:
    def run() -> list[torch.Tensor]:
        state = step.init(params, mesh, seed=seed)
        for batch in data:
            state, _ = step(state, batch)
        return optree.tree_leaves(step.full_params(state))

    return sw.launch(run, mesh.size, timeout=120)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mesh", [sw.Mesh(cp=2), sw.Mesh(dp=2, cp=2)], ids=str)
def test_dropout_draws_per_rank_repeatably_and_remat_replays_it(mesh: sw.Mesh) -> None:
    step, params = drop_step()
    data = token_batches(size=4)
    cp = context_parallel(step, "cp")
    if "dp" in mesh.axis_names:
        cp = sw.shard_params(cp, "dp", 3)
    Probe.masks.clear()
    first = train(cp, mesh, params, data)  # the replicated gradients agree over cp, or the step would refuse
    masks = [m[0] for m in Probe.masks.values()]
    assert len(masks) == mesh.size
    assert all(not torch.equal(masks[0], m) for m in masks[1:]), "every rank draws its own stream"
    assert same(first[0], train(cp, mesh, params, data)[0])
    assert not same(first[0], train(cp, mesh, params, data, seed=1)[0])
    rematted = sw.remat(cp)
    assert same(first[0], train(rematted, mesh, params, data)[0]), "remat replays the forward's masks"


# -- drawn sequence lengths ------------------------------------------------------------------------------
@settings(max_examples=4, deadline=None)
@given(cp=st.sampled_from([2, 4]), chunk=st.integers(1, 3), attention=st.sampled_from(["ring", "ulysses"]),
       balanced=st.booleans())
def test_property_cp_equals_the_single_device_step_over_sequence_lengths(cp, chunk, attention, balanced) -> None:
    seq = chunk * (2 * cp if balanced else cp)
    step, params = gpt()  # position table of 16: sequences up to it
    composed = context_parallel(step, "cp", attention=attention, balanced=balanced)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=cp), token_batches(seq=seq), params)


# -- bytes against a formula from the model -------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 4])
def test_a_step_sends_each_key_value_slice_cp_minus_1_times_each_way(cp: int) -> None:
    """Per attention layer each rank sends its key/value slice [2, batch, heads, SEQ / cp, head_dim] to the
    next rank cp - 1 times forward and its gradient cp - 1 times backward: counted from the ledger, the
    formula written here from the model's shape, not read from the Plan."""
    layers, batch, heads, head_dim = 2, 4, 4, 4  # test_cp_step.gpt(): d_model 16 over 4 heads, 2 blocks
    step, params = gpt()
    composed, mesh = context_parallel(step, "cp"), sw.Mesh(cp=cp)
    data = token_batches(1, size=batch)[0]

    def run() -> list[Any]:
        state = composed.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            composed(state, data)
        return [r for r in ledger.records if r.rank == mesh.rank and r.op == "ppermute"]

    per_pass = layers * (cp - 1) * 2 * batch * heads * (SEQ // cp) * head_dim * 8
    for rank, records in enumerate(sw.launch(run, cp, timeout=120)):
        for phase in ("forward", "backward"):
            sent = [r.sent_bytes for r in records if r.phase == phase]
            assert len(sent) == layers * (cp - 1) and sum(sent) == per_pass, (rank, phase, sent)
