"""Step.init refuses ranks that built different steps, naming the ranks and what differs."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp


def _base() -> tuple[sw.Step, dict]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]))
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), params


def test_a_rank_with_another_stack_is_named() -> None:
    base, params = _base()

    def build() -> None:
        mesh = sw.Mesh(dp=2)
        stage = 3 if mesh.axis_index("dp") == 0 else 2  # rank 1 read its flag differently
        sw.shard_params(base, "dp", stage).init(params, mesh)

    with pytest.raises(sw.RankFailed, match=r"rank 1 differs from rank 0 in its transform stack"):
        sw.launch(build, 2)


def test_a_rank_with_another_schedule_or_seed_is_named() -> None:
    base, params = _base()

    def schedule() -> None:
        mesh = sw.Mesh(pp=2)
        name = "gpipe" if mesh.axis_index("pp") == 0 else "1f1b"
        sw.pipeline(base, "pp", name, 2).init(params, mesh)

    with pytest.raises(sw.RankFailed, match=r"rank 1 differs from rank 0 in its transform stack, schedule"):
        sw.launch(schedule, 2)

    def seed() -> None:
        mesh = sw.Mesh(dp=2, pp=2)
        step = sw.shard_params(sw.pipeline(base, "pp", "1f1b", 2), "dp", 3)
        step.init(params, mesh, seed=mesh.rank // 3)  # rank 3 alone

    with pytest.raises(sw.RankFailed, match=r"rank 3 differs from rank 0 in its seed"):
        sw.launch(seed, 4)


def test_ranks_that_start_from_other_weights_are_named() -> None:
    """What thread ranks that build the model themselves, racing on torch's global generator, get."""
    base, params = _base()

    def build() -> None:
        mesh = sw.Mesh(dp=2)
        mine = {k: {n: t + mesh.axis_index("dp") for n, t in v.items()} for k, v in params.items()}
        sw.shard_params(base, "dp", 3).init(mine, mesh)

    with pytest.raises(sw.RankFailed, match=r"rank 1 differs from rank 0 in its parameter values"):
        sw.launch(build, 2)
