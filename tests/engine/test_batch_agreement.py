"""Every rank passes the same global batch, and a distributed step checks that it did.

Each rank takes its part of the global batch (its rows under shard_params, its micro-batches
under pipeline, all of it under tensor_parallel). Ranks that load their data themselves and
draw different batches would train on a mix nobody asked for, silently: the step sums a
fingerprint of the batch with its metrics (no collective of its own) and refuses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.engine.run.metrics import Summed, batch_fingerprint, batch_weight
from shardwise.testing.models import mlp


def _problem(dtype: torch.dtype = torch.float64) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 8, 3]).to(dtype))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params


def _batch(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=gen, dtype=dtype), torch.randn(8, 3, generator=gen, dtype=dtype)


STACKS = {
    "zero-3": (lambda s: sw.shard_params(s, "dp", 3), {"dp": 2}),
    "pipeline": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), {"pp": 2}),
    "tensor parallel": (lambda s: sw.tensor_parallel(s, "tp", {"0": sw.Colwise(), "2": sw.Rowwise()}), {"tp": 2}),
    "dp x tp": (lambda s: sw.shard_params(sw.tensor_parallel(s, "tp", {"0": sw.Colwise(), "2": sw.Rowwise()}), "dp"),
                {"dp": 2, "tp": 2}),
}


@pytest.mark.parametrize("name", list(STACKS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_ranks_that_pass_different_batches_are_refused(name: str, dtype: torch.dtype) -> None:
    step, params = _problem(dtype)
    transform, axes = STACKS[name]
    composed, mesh = transform(step), sw.Mesh(**axes)

    def each_its_own() -> None:
        state = composed.init(params, mesh)
        composed(state, _batch(mesh.rank, dtype))  # a different batch on every rank

    with pytest.raises(sw.RankFailed, match=r"the ranks( of axis .tp.)? passed different batches to this step"):
        sw.launch(each_its_own, mesh.size, timeout=60)

    def the_same() -> float:
        _, metrics = composed(composed.init(params, mesh), _batch(0, dtype))
        return float(metrics["loss"])

    assert len(set(sw.launch(the_same, mesh.size, timeout=60))) == 1


def test_rows_swapped_between_ranks_are_refused_too() -> None:
    step, params = _problem()
    composed, mesh = sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)
    x, y = _batch(0)

    def swapped() -> None:
        order = torch.arange(8) if mesh.rank == 0 else torch.arange(8).flip(0)
        composed(composed.init(params, mesh), (x[order], y[order]))  # the same rows, in another order

    with pytest.raises(sw.RankFailed, match="different batches"):
        sw.launch(swapped, mesh.size, timeout=60)


def test_a_quiet_step_exchanges_nothing_and_so_checks_nothing() -> None:
    # metrics=() and no rule that needs the sums: no exchange, so no check either (documented).
    step, params = _problem()
    composed, mesh = sw.shard_params(step.with_metrics(()), "dp", 3), sw.Mesh(dp=2)

    def each_its_own() -> int:
        state, _ = composed(composed.init(params, mesh), _batch(mesh.rank))
        return state.step

    assert sw.launch(each_its_own, mesh.size, timeout=60) == [1, 1]


@pytest.mark.parametrize("ranks", [2, 8, 64])
def test_the_check_is_rounding_safe_and_sees_one_rank_with_another_batch(ranks: int) -> None:
    # Every rank's share summed in float32, one rounding per add, as an all-reduce does.
    f, other = batch_fingerprint(_batch(3)), batch_fingerprint(_batch(4))

    def summed(off: int | None, theirs: torch.Tensor) -> Summed:
        total = torch.zeros((), dtype=torch.float32)
        weighted = torch.zeros((), dtype=torch.float32)
        for r in range(ranks):
            mine = theirs if r == off else f
            total = total + mine.float()
            weighted = weighted + (mine * batch_weight(r)).float()
        return Summed(batch=(total, weighted))

    assert not summed(None, f).batches_differ(list(range(ranks)))
    assert summed(ranks // 2, other).batches_differ(list(range(ranks)))  # one rank drew its own batch
    if ranks <= 8:  # float32 at a few ranks sees a batch whose fingerprint is off by a percent
        assert summed(ranks // 2, f * 1.01).batches_differ(list(range(ranks)))
