"""Sequence parallel on tokens folded into rows: OPT's layer and a MoE block's shared expert.

OPT's decoder layer flattens its tokens to (batch x sequence, hidden) before fc1, and Qwen2-MoE's block
before its shared expert. Under sequence parallel a rank's rows are its slice's tokens; a Colwise module
taking them gathered the sequence dim, dim 1, which is their features there: refused before. Now rows are
gathered along dim 0, every rank's rows one rank's after another's, computed each alone through the split
MLP, and the Rowwise module's reduce-scatter hands each rank its own rows back. The gathered rows are not
in the one device's (batch-major) order, so the guard follows them as rows until the scatter: code that
reads them as (batch, sequence) or mixes them is refused. float64 on thread ranks; 1e-12 as the other
sequence-parallel tests (a reordering of sums only); the Plan's collectives are what runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

F64_RTOL = 1e-12
VOCAB, SEQ = 32, 16


def _lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(2, VOCAB, (2, 2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def _opt() -> tuple[sw.Step, Any, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=2 * SEQ, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
        attn_implementation="sdpa", pad_token_id=1)
    model = transformers.OPTForCausalLM(config).double()
    chain, params = sw.functionalize(model, units=transformers.models.opt.modeling_opt.OPTDecoderLayer,
                                     example_input=_token_batches()[0][0])
    layer = "model.decoder.layers.*"
    plan = {f"{layer}.self_attn": sw.tp.Region(heads=("num_heads",)),
            **{f"{layer}.self_attn.{p}_proj": sw.tp.Colwise() for p in "qkv"},
            f"{layer}.self_attn.out_proj": sw.tp.Rowwise(), f"{layer}.fc1": sw.tp.Colwise(),
            f"{layer}.fc2": sw.tp.Rowwise()}
    return sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params, plan


def test_opt_under_sequence_parallel_equals_the_single_device_step_and_runs_its_plan() -> None:
    step, params, plan = _opt()
    split = sw.tensor_parallel(step, "tp", plan, sequence_parallel="model.decoder.layers.*")
    mesh, batches = sw.Mesh(tp=2), _token_batches()
    sw.testing.assert_equivalent(split, step, mesh, batches, params, rtol=F64_RTOL)
    ran = sw.testing.assert_plan_is_run(split, mesh, params, batches[0])
    # each layer reduce-scatters twice forward (the attention's output; fc2's rows, [32, 16]) and twice backward
    # (the transposes of the attention's and fc1's gathers), each of 2 x 16 tokens of 16 float64 features
    scatters = [c for c in ran.collectives(0) if c.op == "psum_scatter" and c.axis == "tp"]
    assert [c.nbytes for c in scatters] == [2 * SEQ * 16 * 8] * 8, scatters


def test_opt_over_dp_by_tp_with_zero3_and_sequence_parallel_equals_the_single_device_step() -> None:
    step, params, plan = _opt()
    composed = sw.shard_params(sw.tensor_parallel(step, "tp", plan, sequence_parallel="model.decoder.layers.*"),
                               "dp", 3)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, tp=2), _token_batches(), params, rtol=F64_RTOL)


def test_a_moe_shared_expert_split_on_the_rows_equals_the_single_device_step() -> None:
    """Qwen2-MoE's shared expert split Colwise / Rowwise inside a sequence-parallel block (its routed experts
    left whole, run on each rank's tokens): refused before, naming the flattened tokens."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ, bos_token_id=0, eos_token_id=0,
        experts_implementation="eager")
    model = transformers.Qwen2MoeForCausalLM(config).double()
    batches = _token_batches()
    chain, params = sw.functionalize(model, units=Qwen2MoeDecoderLayer, example_input=batches[0][0])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    plan = {k: v for k, v in sw.tp.llama_plan(vocab_parallel=False).items() if ".mlp" not in k}
    shared = "model.layers.*.mlp.shared_expert"
    plan.update({shared: sw.tp.Region(), f"{shared}.gate_proj": sw.tp.Colwise(), f"{shared}.up_proj": sw.tp.Colwise(),
                 f"{shared}.down_proj": sw.tp.Rowwise()})
    split = sw.tensor_parallel(step, "tp", plan, sequence_parallel=sw.tp.LLAMA_BLOCKS)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)


class _RowsMLP(nn.Module):
    """An MLP on the tokens folded into rows, as OPT's; ``between`` runs on fc1's output."""

    def __init__(self, d: int, between: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.between = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.fc1(x.reshape(-1, d)).relu()
        if self.between == "running_sum":  # each sequence's running sum: rows read as (batch, sequence)
            h = h.view(b, t, -1).cumsum(1).reshape(b * t, -1)
        elif self.between == "flip":  # rows mixed
            h = h.flip(0)
        return self.fc2(h).view(b, t, d)


class _Block(nn.Module):
    def __init__(self, d: int, between: str) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), _RowsMLP(d, between)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize(("between", "why"), [
    ("running_sum", r"view to \[2, 8, 32\] moves the batch or sequence dim"),
    ("flip", r"flip acts along dim 0"),
])
def test_gathered_rows_read_as_sequences_or_mixed_are_refused(between: str, why: str) -> None:
    """On one device the block's rows are batch-major; the gathered rows are rank-major, so reading them as
    (batch, sequence) would take other tokens for a sequence's: refused at the Plan, naming the module."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(16, "none"), _Block(16, between)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    plan = {"*.mlp.fc1": sw.tp.Colwise(), "*.mlp.fc2": sw.tp.Rowwise()}
    split = sw.tensor_parallel(step, "tp", plan, sequence_parallel="*")
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, SEQ, 16, generator=gen, dtype=torch.float64),
             torch.randn(2, SEQ, 16, generator=gen, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"'1\.mlp' \(_RowsMLP\).*" + why):
        split.plan(sw.Mesh(tp=2), params, batch)
    if between == "flip":  # the first block alone (nothing between) trains as one device does
        chain, params = sw.functionalize(nn.Sequential(_Block(16, "none"), _Block(16, "none")).double())
        step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan, sequence_parallel="*"), step,
                                     sw.Mesh(tp=2), [batch] * 2, params, rtol=F64_RTOL)
