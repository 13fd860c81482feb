"""Crash safety on gloo processes: a rank SIGKILLed at a point of a save leaves the previous
checkpoint loadable and equal to what was saved, and the interrupted one refused (or, killed
between the two renames of a replace, the previous one found where the save had moved it).

Each case saves at step 1, trains a step, and dies while saving step 2; a killed run tears
its processes down, so each case starts two processes (a few seconds): three cases, one per
phase of a save (a rank's files half written, every file written but not committed, the
old checkpoint moved aside but the new one not yet in place).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.file_format import CheckpointError
from shardwise.testing.models import mlp

pytestmark = pytest.mark.gloo


def _problem() -> tuple[Any, Any, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([5, 7, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 5, generator=gen, dtype=torch.float64), torch.randn(8, 3, generator=gen, dtype=torch.float64))
               for _ in range(2)]
    return step, params, batches


def _save_then_die(first: str, second: str, point: str, victim: int) -> None:
    step, params, batches = _problem()
    sharded = sw.shard_params(step, "dp", stage=3)
    mesh = sw.Mesh(dp=2)
    state, _ = sharded(sharded.init(params, mesh), batches[0])
    ck.save(first, state, sharded)
    state, _ = sharded(state, batches[1])

    def fault(reached: str) -> None:
        if reached == point and mesh.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)

    ck._fault = fault
    ck.save(second, state, sharded, overwrite=True)
    raise AssertionError(f"rank {mesh.rank} passed the crash point {point!r}")


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPool]:
    with ProcessPool(2, timeout=30.0) as p:
        yield p


CASES = [("rank-file-partial", 1, "next"), ("before-commit", 0, "next"), ("between-renames", 0, "same")]


@pytest.mark.parametrize("point,victim,target", CASES, ids=[c[0] for c in CASES])
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(
    pool: ProcessPool, tmp_path: Path, point: str, victim: int, target: str
) -> None:
    first = tmp_path / "step1"
    second = first if target == "same" else tmp_path / "step2"
    with pytest.raises(sw.collectives.RankFailed, match=f"rank {victim} failed: the process exited on signal SIGKILL"):
        pool.run(_save_then_die, str(first), str(second), point, victim)
    step, params, batches = _problem()
    state = ck.load(first, step)  # on one device now
    reference, _ = step(step.init(params), batches[0])
    assert state.step == 1
    for layer, tensors in reference.params.items():
        for name, expected in tensors.items():
            torch.testing.assert_close(state.params[layer][name], expected, rtol=1e-12, atol=0)
            torch.testing.assert_close(state.opt_state.momentum[layer][name], reference.opt_state.momentum[layer][name],
                                       rtol=1e-12, atol=0)
    if second != first:
        with pytest.raises(CheckpointError, match="interrupted"):
            ck.load(second, step)
