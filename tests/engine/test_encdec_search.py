"""The plan search on an encoder-decoder split per layer in both stacks: its layouts (ZeRO-3, and
pipelines whose stages cut around the bridge) are planned, priced and certified equal to the
single-device step like a decoder's."""

from __future__ import annotations

import torch.nn.functional as F

import shardwise as sw
from shardwise.plan_search import Space

from .test_functionalize_encdec import LogitsOnly, bart, bart_batches, bart_layers


def test_the_search_certifies_zero3_and_pipelines_of_bart_split_in_both_stacks() -> None:
    model = LogitsOnly(bart())
    batches = bart_batches(2)
    chain, params = sw.functionalize(model, units=bart_layers(), example_input=batches[0][0])
    assert "bridge" in chain.names
    step = sw.train_step(chain, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()), sw.optim.adamw(1e-3))
    space = Space(zero_stages=(3,), schedules=("1f1b",), microbatches=(2,), remat=(None,))
    result = sw.search(step, params, batches[0], world=2, memory_per_rank="64MB", space=space, top=2,
                       prune=False, certify_with=(step, params, batches))
    shapes = {(p.candidate.dp, p.candidate.pp) for p in result.ranked}
    assert shapes == {(2, 1), (1, 2)}, result.refused
    for priced in result.ranked:
        assert priced.certified is not None and priced.certified.startswith("equivalent"), priced


def test_tensor_parallel_splits_both_stacks_and_the_cross_attention_reading_the_bridges_output() -> None:
    """The decoder's cross-attention projects the encoder's output, which the bridge hands on in the
    carry: column-split keys and values of it, under tp=2 and dp2 x tp2 ZeRO-3, equal one device."""
    model = LogitsOnly(bart())
    batches = bart_batches(2)
    chain, params = sw.functionalize(model, units=bart_layers(), example_input=batches[0][0])
    step = sw.train_step(chain, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()), sw.optim.adamw(1e-3))
    col, row = sw.tp.Colwise(), sw.tp.Rowwise()
    plan = {f"*.{attn}.{p}": col for attn in ("self_attn", "encoder_attn") for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {"*.self_attn.out_proj": row, "*.encoder_attn.out_proj": row, "*.fc1": col, "*.fc2": row}
    split = sw.tensor_parallel(step, "tp", plan)
    with sw.collectives.comm_ledger() as ledger:
        sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params)
    # Every Rowwise output summed in forward (10: 2 encoder layers x 2, 2 decoder layers x 3), on each of the 2
    # ranks in each step, besides the input gradients' sums: the plan matched both stacks' modules
    summed = [r for r in ledger.records if r.axis == "tp" and r.op == "psum"]
    assert len(summed) > 10 * 2 * len(batches), len(summed)
    sw.testing.assert_equivalent(sw.shard_params(split, "dp", 3), step, sw.Mesh(dp=2, tp=2), batches, params)
