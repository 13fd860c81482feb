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
from shardwise import FunctionalizeError
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


class _Signalling(nn.Module):
    """Its traced code (run once, at functionalize) tells ``tracing`` and waits for ``called``."""

    tracing: threading.Event
    called: threading.Event

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tracing.set()
        self.called.wait(10)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("whose", ["its own model", "a block of the model being traced"])
def test_a_module_called_on_another_thread_while_one_traces_runs_as_written(whose: str) -> None:
    # torch.fx patches nn.Module.__call__ and __getattr__ for the whole process while it traces: another
    # thread's call (a thread rank recording its model, or stepping) failed with fx's "module is not
    # installed as a submodule", or computed with this trace's proxies.
    torch.manual_seed(0)
    model = _Signalling()
    model.tracing, model.called = threading.Event(), threading.Event()
    other = _Block() if whose == "its own model" else model.blocks[0]
    x = torch.randn(3, 4)
    expected = other(x)
    seen: dict[str, Any] = {}

    def call_during_the_trace() -> None:
        try:
            model.tracing.wait(10)
            seen["out"] = other(x)
        except Exception as e:  # (carried to the test's thread)
            seen["error"] = e
        finally:
            model.called.set()

    caller = threading.Thread(target=call_during_the_trace)
    caller.start()
    try:
        sw.functionalize(model, units=_Block)
    finally:
        model.called.set()
        caller.join(10)
    assert "error" not in seen, seen.get("error")
    assert isinstance(seen["out"], torch.Tensor) and torch.equal(seen["out"], expected)


class _TracedWhen(nn.Module):
    """Its forward notes which rank ran it when (traced at functionalize, then run in its check against the
    chain); rank 0's also takes ``slow_s`` each time (a large model's trace and check)."""

    traced: list[tuple[int, float, float]]
    slow_s = 1.5

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = current_backend().rank
        began = time.monotonic()
        if rank == 0:
            time.sleep(self.slow_s)
        self.traced.append((rank, began, time.monotonic()))
        for block in self.blocks:
            x = block(x)
        return x


def test_thread_ranks_run_functionalize_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # A turn of 0.2 s and a hold of at most 4 / (4 * 2) = 0.5 s: rank 1 starts while rank 0 is still in its
    # functionalize, and waits at its own for rank 0's to end (two checks would set each other's generators).
    monkeypatch.setattr(thread_ranks, "start_turn", lambda timeout, world: 0.2)
    traced: list[tuple[int, float, float]] = []
    ended: dict[int, float] = {}

    def split() -> None:
        torch.manual_seed(0)
        model = _TracedWhen()
        model.traced = traced
        sw.functionalize(model, units=_Block, example_input=torch.randn(3, 4))
        ended[current_backend().rank] = time.monotonic()

    started = time.monotonic()
    sw.launch(split, 2, timeout=4)
    assert sorted(rank for rank, _, _ in traced) == [0, 0, 1, 1]  # a trace and a check each
    rank0_done = max(end for rank, _, end in traced if rank == 0)  # (its check's forward, inside functionalize)
    assert all(began >= rank0_done for rank, began, _ in traced if rank == 1)
    assert ended[0] - started >= 2 * _TracedWhen.slow_s


class _DrawnBeside(nn.Module):
    """A dropout; at its second call (the chain's, in functionalize's check) another thread draws from torch's
    generator first, as a thread rank building its model meanwhile does."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if type(self).calls == 2:
            other = threading.Thread(target=lambda: torch.rand(8))
            other.start()
            other.join()
        return nn.functional.dropout(self.lin(x), 0.5, self.training)


@pytest.mark.parametrize("where", ["thread rank", "main thread"])
def test_a_check_whose_masks_another_thread_changed_says_so_on_a_thread_rank(where: str) -> None:
    def split() -> None:
        _DrawnBeside.calls = 0
        torch.manual_seed(0)
        sw.functionalize(nn.Sequential(nn.Linear(4, 4), _DrawnBeside()), example_input=torch.randn(8, 4))

    note = "or, on thread ranks, which share torch's generator: another rank drew from it meanwhile"
    if where == "main thread":
        with pytest.raises(FunctionalizeError, match="the chain differs from the module") as caught:
            split()
        assert note not in str(caught.value)
    else:
        with pytest.raises(sw.collectives.RankFailed, match=note):
            sw.launch(split, 2)
        with pytest.raises(sw.collectives.RankFailed) as alone:  # one rank: no other to draw
            sw.launch(split, 1)
        assert note not in str(alone.value)


class _Averaged(nn.Module):
    """A layer that averages its output over the ranks (a user's own parallel layer): functionalize's check runs
    it, so one rank's functionalize waits in a collective for the other's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sw.collectives.pmean(self.lin(x), "dp")


def test_a_functionalize_waiting_in_a_collective_lets_the_other_ranks_in() -> None:
    def split() -> list[str]:
        torch.manual_seed(0)
        with sw.Mesh(dp=2):
            chain, _ = sw.functionalize(nn.Sequential(_Averaged(), nn.Tanh()), example_input=torch.randn(3, 4))
        return list(chain.names)

    assert sw.launch(split, 2, timeout=10) == [["0", "1"], ["0", "1"]]


class _AveragedDropped(nn.Module):
    """A user's own parallel layer, then dropout: each rank's check waits in the collective while it lends its
    hold, and the rank let in draws its own check's masks from the same generator meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(sw.collectives.pmean(self.lin(x), "dp")))


def test_a_hold_lent_in_a_collective_is_taken_back_with_the_generators_as_it_left_them() -> None:
    # Four ranks, dropout after the collective: the ranks let in drew between a check's module and chain runs,
    # whose masks then differed ("the chain differs from the module", found by this session's review).
    torch.manual_seed(0)
    models = [nn.Sequential(_AveragedDropped(), _AveragedDropped(), nn.Linear(4, 2)) for _ in range(4)]
    x = torch.randn(4, 4)

    def split() -> int:
        with sw.Mesh(dp=4):
            chain, _ = sw.functionalize(models[current_backend().rank], example_input=x)
        return len(chain)

    assert sw.launch(split, 4, timeout=60) == [3, 3, 3, 3]
