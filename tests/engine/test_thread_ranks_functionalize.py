"""functionalize on thread ranks, which share torch's, Python's and numpy's generators: a rank that starts
late (its turn ran out) does not seed and draw in the middle of another rank's functionalize, which sets the
generators back after tracing the model and refuses glue code that drew from them."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.collectives.backends import thread_ranks
from shardwise.collectives.backends.current import current_backend


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Model(nn.Module):
    """Its code between the units (traced once, at functionalize) waits up to ``wait_s`` on rank 0 for rank 1
    to have started: the time a large model's trace and check take, longer than a turn."""

    started: threading.Event
    wait_s = 1.5

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == "shardwise-rank-0":
            self.started.wait(self.wait_s)
        for block in self.blocks:
            x = block(x)
        return x


def _build_and_split(started: threading.Event, timeline: list[tuple[str, int, float]]) -> dict[str, Any]:
    rank = current_backend().rank
    timeline.append(("start", rank, time.monotonic()))
    if rank == 1:  # what a training script does first: seed everything, draw
        torch.manual_seed(1)
        random.seed(1)
        drawn = (torch.rand(3), random.random())
        started.set()
    torch.manual_seed(0)
    model = _Model()
    model.started = started
    _, params = sw.functionalize(model, units=_Block)
    timeline.append(("split", rank, time.monotonic()))
    out: dict[str, Any] = {"weights": {k: v.clone() for k, v in params["blocks.0"].items()}}
    if rank == 1:
        out["drawn"] = drawn
    return out


def test_a_rank_whose_turn_runs_out_starts_after_another_ranks_functionalize(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thread_ranks, "start_turn", lambda timeout, world: 0.2)
    started, timeline = threading.Event(), []
    results = sw.launch(_build_and_split, 2, args=(started, timeline), timeout=40)

    rank0_split = next(t for what, rank, t in timeline if (what, rank) == ("split", 0))
    rank1_start = next(t for what, rank, t in timeline if (what, rank) == ("start", 1))
    assert rank1_start >= rank0_split  # not 0.2 s after rank 0 began, in the middle of its trace
    torch.manual_seed(1)
    random.seed(1)
    assert torch.equal(results[1]["drawn"][0], torch.rand(3)) and results[1]["drawn"][1] == random.random()
    for name, weight in results[0]["weights"].items():
        assert torch.equal(weight, results[1]["weights"][name])  # the ranks built alike


def test_a_hold_longer_than_its_limit_lets_the_next_rank_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thread_ranks, "start_turn", lambda timeout, world: 0.2)
    peer_started = threading.Event()
    times: dict[str, float] = {}

    def rank_fn() -> None:
        rank = current_backend().rank
        if rank == 1:
            times["peer"] = time.monotonic()
            peer_started.set()
            return
        times["hold"] = time.monotonic()
        with thread_ranks.holding_turn():
            peer_started.wait(20)  # a hold that never ends by itself: the limit (8 / (4 * 2) = 1 s) ends it

    sw.launch(rank_fn, 2, timeout=8)
    assert peer_started.is_set()
    assert 1.0 <= times["peer"] - times["hold"] < 6.0  # the turn (0.2 s) plus the limit (1 s), not the turn alone


def test_holding_the_turn_outside_a_rank_thread_does_nothing() -> None:
    with thread_ranks.holding_turn():
        assert threading.current_thread().name == threading.main_thread().name
