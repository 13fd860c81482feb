"""Hugging Face GPT-OSS under tensor parallel: its attention sinks split by the heads, its MoE MLP whole.

GPT-OSS's attention holds ``sinks``, one learned logit per query head, ``(num_attention_heads,)``,
concatenated to each head's scores before the softmax. ``sw.tp.gpt_oss_plan()`` splits the attention as
the Llama plan does and the sinks with ``sw.tp.PerHead()``: rank r holds and trains the sinks of its heads
[r*H/tp, (r+1)*H/tp). Before, no style split them and the plan was refused (each rank met every head's
sinks with its own heads). The MoE MLP (router and stacked experts) stays whole on every rank.

The tiny model: hidden 32, 8 query heads of width 8 and 4 key/value heads (grouped-query attention:
tp 2 and tp 4 both keep whole groups), 2 layers, the first a sliding-window layer (window 4 of a
sequence of 8: GPT-OSS alternates sliding and full attention), 4 experts, 2 per token. The sinks are drawn
from N(0, 1), not the init's N(0, 0.02), so that a rank using another head's sink would move the loss
by far more than the tolerance. float64 on threads, SGD with momentum, 2 steps, relative agreement 1e-12
as in test_equivalence.py: tensor parallel reorders the sums of the split matmuls only (measured here,
at most a few 1e-16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.layout.state import tree_nbytes

F64_RTOL = 1e-12
SEQ, SLIDING = 8, 4


def _gpt_oss(
    heads: int = 8, kv_heads: int = 4, steps: int = 2, frozen_sinks: bool = False
) -> tuple[Any, sw.Step, Any, list[Any]]:
    """A tiny GptOssForCausalLM in float64, its single-device step (vocab-parallel loss), params, batches;
    ``frozen_sinks``: its sinks not trained (requires_grad=False)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=2 * SEQ, sliding_window=SLIDING, attn_implementation="eager",
        experts_implementation="eager", pad_token_id=0, eos_token_id=1, bos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = transformers.GptOssForCausalLM(config).double()
    assert config.layer_types == ["sliding_attention", "full_attention"] and SLIDING < SEQ
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.self_attn.sinks.requires_grad_(not frozen_sinks)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(64, (steps, 4, SEQ + 1), generator=gen)
    batches = [(seq[:, :-1], seq[:, 1:]) for seq in ids]
    chain, params = sw.functionalize(model, units=GptOssDecoderLayer, example_input=batches[0][0])

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)

    return model, sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def _stack(step: sw.Step, layout: str, plan: dict[str, Any] | None = None) -> tuple[sw.Step, sw.Mesh]:
    tp = sw.tensor_parallel(step, "tp", sw.tp.gpt_oss_plan() if plan is None else plan)
    return {
        "tp2": (tp, sw.Mesh(tp=2)),
        "tp4": (tp, sw.Mesh(tp=4)),
        "dp2xtp2-zero3": (sw.shard_params(tp, "dp", 3), sw.Mesh(dp=2, tp=2)),
    }[layout]


@pytest.mark.parametrize("layout", ["tp2", "tp4", "dp2xtp2-zero3"])
def test_gpt_oss_with_its_sinks_split_by_the_heads_is_the_single_device_step(layout: str) -> None:
    _, step, params, batches = _gpt_oss()
    tp, mesh = _stack(step, layout)
    sw.testing.assert_equivalent(tp, step, mesh, batches, params, rtol=F64_RTOL)


@pytest.mark.parametrize("sequence_parallel", [None, "model.layers.*"], ids=["tp2", "tp2-sequence-parallel"])
def test_frozen_sinks_are_cut_to_each_rank_heads(sequence_parallel: str | None) -> None:
    """Sinks not trained travel whole with their layer, which hands each rank its heads' rows (refused before:
    "a frozen tensor ... is never split")."""
    _, step, params, batches = _gpt_oss(frozen_sinks=True)
    tp = sw.tensor_parallel(step, "tp", sw.tp.gpt_oss_plan(), sequence_parallel=sequence_parallel)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)


def test_a_grouped_query_attention_of_four_query_heads_per_key_value_head() -> None:
    """8 query heads, 2 key/value heads: at tp 2 a rank holds one group, its 4 query heads and their sinks."""
    _, step, params, batches = _gpt_oss(kv_heads=2)
    tp, mesh = _stack(step, "tp2")
    sw.testing.assert_equivalent(tp, step, mesh, batches, params, rtol=F64_RTOL)


def test_each_rank_holds_its_own_heads_sinks_and_the_whole_comes_back() -> None:
    _, step, params, batches = _gpt_oss(steps=1)
    tp, mesh = _stack(step, "tp2")
    name = "model.layers.0.self_attn.sinks"
    whole = params["model.layers.0"][name]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        state = tp.init(params, mesh)
        held = state.params["model.layers.0"][name].clone()
        state, _ = tp(state, batches[0])
        return held, tp.full_params(state)["model.layers.0"][name]

    reference, _ = step(step.init(params), batches[0])
    for rank, (held, full) in enumerate(sw.launch(run, mesh.size)):
        assert torch.equal(held, whole[4 * rank: 4 * (rank + 1)])  # rank r: the sinks of heads 4r .. 4r + 3
        torch.testing.assert_close(full, reference.params["model.layers.0"][name], rtol=F64_RTOL, atol=0)


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2-zero3"])
def test_every_rank_issues_the_collectives_and_holds_the_bytes_its_plan_lists(layout: str) -> None:
    """The Plan's prediction runs the MoE's data-dependent loop (``nonzero`` over the experts hit) on real
    stand-ins, as the engine's does: before, the Plan of any tensor-parallel step on GPT-OSS failed there."""
    _, step, params, batches = _gpt_oss(steps=1)
    tp, mesh = _stack(step, layout)
    plan = tp.plan(mesh, params, batches[0])
    assert any(a.kind == "inside" for a in plan.for_rank(0))

    def run() -> tuple[list[Any], int, int]:
        state = tp.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            state, _ = tp(state, batches[0])
        return [r for r in ledger.records if r.rank == mesh.rank], tree_nbytes(state.params), tree_nbytes(
            state.opt_state)

    for rank, (records, held, opt) in enumerate(sw.launch(run, mesh.size)):
        got = [(r.op, r.axis, r.dtype, r.nbytes) for r in records]
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"
        assert held == plan.memory["params"][rank]
        assert opt == plan.memory["opt_state"][rank]
    assert "model.layers.0.self_attn.sinks: PerHead()" in " ".join(plan.layers["model.layers.0"])


def test_a_sharded_gpt_oss_saves_the_state_dict_one_device_trains(tmp_path: Path) -> None:
    """dp2 x tp2 with ZeRO-3: full_state_dict and save_pretrained reassemble the sinks (and every split
    weight) whole; equal to one device's after the same 2 steps (float64 rounding of the split sums only),
    and GptOssForCausalLM.from_pretrained loads the file with every key matched. A shardwise checkpoint of
    the same state loads onto one device, and onto tp 4, as those whole tensors."""
    model, step, params, batches = _gpt_oss()
    tp, mesh = _stack(step, "dp2xtp2-zero3")

    def train_and_save() -> dict[str, torch.Tensor]:
        state = tp.init(params, mesh)
        for batch in batches:
            state, _ = tp(state, batch)
        sw.checkpoint.save_pretrained(tp, state, tmp_path / "tp", config=model.config)
        sw.checkpoint.save(tmp_path / "checkpoint", state, tp)
        return sw.checkpoint.full_state_dict(tp, state)

    sharded = sw.launch(train_and_save, mesh.size)[0]
    reference = step.init(params)
    for batch in batches:
        reference, _ = step(reference, batch)
    want = sw.checkpoint.full_state_dict(step, reference)
    assert sorted(sharded) == sorted(want) and sharded["model.layers.1.self_attn.sinks"].shape == (8,)
    for key, value in want.items():
        torch.testing.assert_close(sharded[key], value, rtol=F64_RTOL, atol=1e-15, msg=key)
    loaded, info = type(model).from_pretrained(tmp_path / "tp", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, sharded[key]), key
    on_one = sw.checkpoint.full_state_dict(step, sw.checkpoint.load(tmp_path / "checkpoint", step))
    tp4, mesh4 = _stack(step, "tp4")
    on_tp4 = sw.launch(lambda: sw.checkpoint.full_state_dict(
        tp4, sw.checkpoint.load(tmp_path / "checkpoint", tp4, mesh4)), mesh4.size)[0]
    for key, value in sharded.items():
        assert torch.equal(on_one[key], value) and torch.equal(on_tp4[key], value), key


# -- what stays refused -------------------------------------------------------------------------------


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_naming_the_sinks() -> None:
    _, step, params, batches = _gpt_oss(heads=6, kv_heads=2, steps=1)
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.0\.self_attn\.sinks' holds one value per head "
                                         r"\(config\.num_attention_heads = 6\).* the 4 ranks of axis 'tp' do not "
                                         r"divide its 6 values"):
        sw.tensor_parallel(step, "tp", sw.tp.gpt_oss_plan()).plan(sw.Mesh(tp=4), params, batches[0])


def test_the_plan_without_the_sinks_is_told_to_split_them_per_head() -> None:
    _, step, params, batches = _gpt_oss(steps=1)
    plan = {k: v for k, v in sw.tp.gpt_oss_plan().items() if not isinstance(v, sw.tp.PerHead)}
    with pytest.raises(ValueError, match=r"its parameter 'sinks' of shape \(8,\) holds one value per head \(8 heads\)"
                                         r".*give 'model\.layers\.0\.self_attn\.sinks' sw\.tp\.PerHead\(\)"):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


@pytest.mark.parametrize("style", [sw.tp.Colwise(), sw.tp.Rowwise()], ids=["colwise", "rowwise"])
def test_tensor_parallel_experts_are_refused_naming_the_stacked_weights(style: Any) -> None:
    _, step, _, _ = _gpt_oss(steps=1)
    plan = {**sw.tp.gpt_oss_plan(), "model.layers.*.mlp": sw.tp.Region(), "model.layers.*.mlp.experts": style}
    with pytest.raises(ValueError, match=r"on 'model\.layers\.0\.mlp\.experts', a GptOssExperts holding its experts' "
                                         r"weights stacked \(\{'gate_up_proj': \(4, 32, 32\), 'down_proj': "
                                         r"\(4, 16, 32\)\}\).*sw\.expert_parallel"):
        sw.tensor_parallel(step, "tp", plan)


def test_the_moe_on_sequence_slices_trains_as_the_single_device_step() -> None:
    """Under sequence parallel the MLP runs on each rank's slice of the sequence: its router is followed op by
    op, and GPT-OSS's experts (their code pinned: engine/model/token_wise.py) compute each token alone and
    run as one op, their gradients summed over tp; the sinks stay split by the heads."""
    _, step, params, batches = _gpt_oss(steps=2)
    tp = sw.tensor_parallel(step, "tp", sw.tp.gpt_oss_plan(), sequence_parallel="model.layers.*")
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=F64_RTOL)
