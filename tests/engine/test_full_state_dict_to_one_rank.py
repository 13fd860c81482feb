"""``sw.checkpoint.full_state_dict(step, state, rank=r)``: the module's state_dict on rank ``r`` alone,
gathered a layer at a time, so the other ranks never hold the whole model (torch's full state dict
with ``cpu_offload``, rank 0's). Compared with the every-rank ``full_state_dict`` of the same state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.layout import state_layout
from shardwise.testing.models import Block, TinyGPT

SEQ = 8


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gpt(layers: int = 4) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, d_model=16, n_heads=2, n_layers=layers, seq_len=SEQ)  # head tied to tok_emb


def _stack(layout: str) -> tuple[sw.Step, Any, sw.Mesh]:
    model = _gpt()
    if layout == "tp2":
        chain, params = sw.functionalize(model, units=Block)
        step = sw.tensor_parallel(sw.train_step(chain, sw.tp.vocab_parallel_cross_entropy, sw.optim.sgd(0.1)),
                                  "tp", sw.tp.tiny_gpt_plan())
        return step, params, sw.Mesh(tp=2)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _loss, sw.optim.adamw(1e-2))
    if layout == "zero3 dp2":
        return sw.shard_params(step, "dp", stage=3), params, sw.Mesh(dp=2)
    if layout == "zero1 dp2":
        return sw.shard_params(step, "dp", stage=1), params, sw.Mesh(dp=2)
    return sw.pipeline(sw.shard_params(step, "dp", stage=3), "pp", "1f1b", 2), params, sw.Mesh(dp=2, pp=2)


def _trained(step: sw.Step, params: Any, mesh: sw.Mesh) -> Any:
    gen = torch.Generator().manual_seed(1)
    state = step.init(params, mesh)
    for _ in range(2):
        state, _ = step(state, (torch.randint(64, (4, SEQ), generator=gen), torch.randint(64, (4, SEQ), generator=gen)))
    return state


@pytest.mark.parametrize("layout", ["zero3 dp2", "zero1 dp2", "pp2 x zero3 dp2", "tp2"])
@pytest.mark.parametrize("receiver", [0, 1])
def test_one_rank_receives_what_every_rank_would(layout: str, receiver: int) -> None:
    step, params, mesh = _stack(layout)

    def run() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        state = _trained(step, params, mesh)
        one = sw.checkpoint.full_state_dict(step, state, rank=receiver)
        return one, sw.checkpoint.full_state_dict(step, state)

    results = sw.launch(run, mesh.size)
    for r, (one, every) in enumerate(results):
        if r != receiver:
            assert one == {}
            continue
        assert list(one) == list(every) and set(every) == set(_gpt().state_dict())  # the module's keys
        assert all(torch.equal(one[k], every[k]) for k in every)
        assert one["head.weight"] is one["tok_emb.weight"]  # a tied weight's names hold one tensor


def test_the_ranks_that_do_not_receive_hold_one_layer_gathered_at_a_time(gathers_alive: Any) -> None:
    """ZeRO-3 over 2 ranks, 6 blocks: when a rank gathers a layer, what it gathered before is alive only
    on the receiving rank (in the state_dict it returns)."""
    seen = gathers_alive(state_layout)
    model = _gpt(layers=6)
    chain, params = sw.functionalize(model, units=Block)
    step = sw.shard_params(sw.train_step(chain, _loss, sw.optim.sgd(0.1)), "dp", stage=3)

    def run() -> tuple[int, int]:
        state = _trained(step, params, sw.Mesh(dp=2))
        got = sw.checkpoint.full_state_dict(step, state, rank=1)
        return sw.Mesh(dp=2).rank, len(got)

    ranks = sw.launch(run, 2)
    assert [n > 0 for _, n in ranks] == [False, True]
    held = sorted(seen.most.values())
    assert held[0] == 0 and held[1] == len(chain) - 1, seen.most  # the receiver keeps each; the other, none


@pytest.mark.parametrize("rank", [-1, 2, True, "0", 0.0])
def test_a_rank_outside_the_mesh_is_refused_naming_it(rank: Any) -> None:
    step, params, mesh = _stack("zero3 dp2")

    def run() -> None:
        sw.checkpoint.full_state_dict(step, step.init(params, mesh), rank=rank)

    with pytest.raises(sw.collectives.RankFailed, match=r"rank=.*the global rank that receives.*\[0, 2\)"):
        sw.launch(run, 2)


def test_on_one_device_rank_0_is_the_whole_state_dict() -> None:
    chain, params = sw.functionalize(_gpt(), units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1))
    state = step.init(params)
    one = sw.checkpoint.full_state_dict(step, state, rank=0)
    assert list(one) == list(sw.checkpoint.full_state_dict(step, state))
    with pytest.raises(ValueError, match=r"rank=1.*\[0, 1\)"):
        sw.checkpoint.full_state_dict(step, state, rank=1)
