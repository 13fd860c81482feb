"""Review of the late changes (staggered thread-rank start, the batch check, the bounded layout
cache): each test states what should happen (each failed before its fix)."""

from __future__ import annotations

import time

import torch

import shardwise as sw
from shardwise.testing.models import mlp


def _poll_an_async_psum() -> object:
    """Rank 0 polls its handle instead of waiting on it: it never enters a blocking wait."""
    mesh = sw.Mesh(dp=2)
    handle = sw.collectives.psum_async(torch.ones(1), "dp", mesh=mesh)
    deadline = time.monotonic() + 20.0  # a bound so the test ends; the peer needs a moment, not this
    while not handle.is_completed():
        if time.monotonic() > deadline:
            return "the peer never arrived"
        time.sleep(0.01)
    return handle.wait()


def test_a_rank_polling_its_handle_lets_its_peer_run() -> None:
    results = sw.launch(_poll_an_async_psum, 2, timeout=60)
    assert all(isinstance(r, torch.Tensor) and float(r) == 2.0 for r in results)


def _slow_setup_then_psum() -> torch.Tensor:
    time.sleep(3.0)  # reading data, say: well within the timeout of 5 s
    mesh = sw.Mesh(dp=3)
    return sw.collectives.psum(torch.ones(1), "dp", mesh=mesh)


def test_setup_shorter_than_the_timeout_on_every_rank_does_not_time_out() -> None:
    results = sw.launch(_slow_setup_then_psum, 3, timeout=5.0)
    assert [float(r) for r in results] == [3.0, 3.0, 3.0]


def _work_without_collectives() -> int:
    time.sleep(2.5)
    return 1


def test_ranks_that_never_communicate_are_not_hung() -> None:
    assert sw.launch(_work_without_collectives, 3, timeout=2.0) == [1, 1, 1]


def _pipeline_with_many_batch_sizes() -> str:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 6, 3]))
    step = sw.pipeline(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "pp", "1f1b", 2)
    mesh = sw.Mesh(pp=2)
    state = step.init(params, mesh)
    g = torch.Generator().manual_seed(1)
    for n in range(1, 70):  # 69 distinct batch sizes: more than the cache's 64 entries
        x, y = torch.randn(2 * n, 4, generator=g), torch.randn(2 * n, 3, generator=g)
        state, _ = step(state, (x, y))
    return "ok"


def test_a_pipeline_step_survives_more_batch_shapes_than_the_cache_holds() -> None:
    assert sw.launch(_pipeline_with_many_batch_sizes, 2, timeout=120) == ["ok", "ok"]


def _batch_shifted_on_rank_1(shift: float) -> str:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]))
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp")
    mesh = sw.Mesh(dp=2)
    state = step.init(params, mesh)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    if mesh.rank == 1:
        x = x + shift  # rank 1 skipped a normalisation: a different batch
    try:
        step(state, (x, y))
    except ValueError as err:
        return f"refused: {err}"
    return "accepted"


def test_a_batch_shifted_by_a_constant_on_one_rank_is_refused() -> None:
    results = sw.launch(_batch_shifted_on_rank_1, 2, timeout=60, args=(1.0,))
    assert all(r.startswith("refused") for r in results), results
