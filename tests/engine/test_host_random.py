"""Draws from numpy's global generator and Python's ``random`` are as reproducible as torch's.

Two layers draw outside torch: a feature mask drawn with ``np.random`` (as Wav2Vec2's SpecAugment) and a
LayerDrop of p=0.5 drawn with ``random.random()``. Each rank draws its own stream (as for dropout), so a
distributed step draws others than one device: as ``test_ep_dropout.py`` does for dropout, every rank's
draws are recorded and the single-device step replays them, joined in batch order, and must equal it
(float64). Two runs from the same state are bitwise equal whatever the user's own generators hold, a
saved and resumed run continues as the one that never stopped, and a step leaves the user's state of
both generators as it was (on one device; thread ranks, which share them, restore the state their
step began with, as for torch's). (remat's replay: tests/transforms/remat/test_remat_host_random.py.)
"""

from __future__ import annotations

import io
import random
import threading
from typing import Any

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.testing.equivalence import NotEquivalentError, compare_histories, record_history


class Draws:
    """Records each rank's host draws per layer tag in call order (forward only), or replays given ones."""

    def __init__(self) -> None:
        self.drawn: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.recomputed = 0  # draws in backward (remat's recomputation): replayed, not recorded
        self.replay: dict[str, list[torch.Tensor]] | None = None
        self.lock = threading.Lock()

    def take(self, tag: str, drawn: torch.Tensor) -> torch.Tensor:
        """``drawn`` (one row per batch row), recorded; or the next replayed value of ``tag``."""
        if isinstance(drawn, torch._subclasses.FakeTensor):
            return drawn  # the Plan's prediction of shapes
        if self.replay is not None:
            return self.replay[tag].pop(0)
        with self.lock:
            if torch._C._current_graph_task_id() != -1:
                self.recomputed += 1
            else:
                self.drawn.setdefault((tag, current_backend().rank), []).append(drawn.clone())
        return drawn

    def joined(self, ranks: list[int], steps: int) -> dict[str, list[torch.Tensor]]:
        """Per tag and step, the draws of ``ranks`` (in batch order; each its micro-batches in order) joined."""
        out: dict[str, list[torch.Tensor]] = {}
        for tag in sorted({t for t, _ in self.drawn}):
            lists = [self.drawn[(tag, r)] for r in ranks if (tag, r) in self.drawn]
            per = len(lists[0]) // steps
            out[tag] = [torch.cat([d for drawn in lists for d in drawn[k * per:(k + 1) * per]]) for k in range(steps)]
        return out


DRAWS = Draws()


class NumpyMask(nn.Module):
    """A feature mask drawn with numpy's global generator."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5).to(x.dtype)
        return self.fc(x) * DRAWS.take("numpy", keep)


class LayerDrop(nn.Module):
    """A residual block skipped with probability 0.5, decided with ``random.random()``."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.fc, self.tag = nn.Linear(6, 6), tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.full((x.shape[0], 1), float(random.random() >= 0.5), dtype=x.dtype)
        return x + DRAWS.take(self.tag, keep) * torch.tanh(self.fc(x))  # a row kept or skipped whole


def problem() -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), NumpyMask(), LayerDrop("drop1"), LayerDrop("drop2"), nn.Linear(6, 2))
    chain, params = sw.functionalize(model.double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]
    return step, params, batches


def _run(step: sw.Step, params: dict, batches: list, mesh: sw.Mesh | None, seed: int = 0) -> list[torch.Tensor]:
    state = step.init(params, mesh, seed=seed)
    for b in batches:
        state, _ = step(state, b)
    return optree.tree_leaves(step.full_params(state))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("stack", "world"), [("zero3", 2), ("pp2", 2), ("remat", 1), ("zero3 remat", 2)],
)
def test_the_distributed_step_equals_the_single_device_step_with_the_ranks_draws(stack: str, world: int) -> None:
    step, params, batches = problem()
    composed, mesh = step, sw.Mesh(dp=world) if world > 1 else None
    if "zero3" in stack:
        composed = sw.shard_params(composed, "dp", 3)
    if stack == "pp2":
        composed, mesh = sw.pipeline(step, "pp", "1f1b", 2), sw.Mesh(pp=2)
    if "remat" in stack:
        composed = sw.remat(composed)
    DRAWS.drawn.clear()
    DRAWS.recomputed = 0
    per_rank = sw.launch(lambda: record_history(composed, composed.init(params, mesh), batches), world)
    if "remat" in stack:  # each layer's draws ran again in backward: the forward's, or the check fails
        assert DRAWS.recomputed == sum(len(d) for d in DRAWS.drawn.values())
    if stack == "zero3":
        for tag in ("numpy", "drop1", "drop2"):  # each rank draws its own stream
            assert not _equal(DRAWS.drawn[(tag, 0)], DRAWS.drawn[(tag, 1)]), tag
    DRAWS.replay = DRAWS.joined(list(range(world)), len(batches))
    try:
        expected = record_history(step, step.init(params), batches)
        assert all(not left for left in DRAWS.replay.values()), "the reference drew fewer than the ranks"
    finally:
        DRAWS.replay = None
    compare_histories(per_rank, expected, rtol=sw.testing.DEFAULT_RTOL[torch.float64])


def test_the_replayed_draws_are_the_ones_that_counted() -> None:
    """The check can fail: the ranks' draws joined in the other order are another computation."""
    step, params, batches = problem()
    composed, mesh = sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)
    DRAWS.drawn.clear()
    per_rank = sw.launch(lambda: record_history(composed, composed.init(params, mesh), batches), 2)
    DRAWS.replay = DRAWS.joined([1, 0], len(batches))
    try:
        expected = record_history(step, step.init(params), batches)
    finally:
        DRAWS.replay = None
    with pytest.raises(NotEquivalentError):
        compare_histories(per_rank, expected, rtol=sw.testing.DEFAULT_RTOL[torch.float64])


def test_two_runs_are_bitwise_equal_whatever_the_users_generators_hold_and_another_seed_differs() -> None:
    step, params, batches = problem()
    zero3, mesh = sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)
    runs = []
    for user in (1, 2):
        random.seed(user)
        np.random.seed(user)
        runs.append((_run(step, params, batches, None), sw.launch(lambda: _run(zero3, params, batches, mesh), 2)))
    (one, ranks), (one_again, ranks_again) = runs
    assert _equal(one, one_again)
    assert all(_equal(a, b) for a, b in zip(ranks, ranks_again, strict=True))
    assert not _equal(one, _run(step, params, batches, None, seed=1))  # the draws follow the step's seed


def test_a_resumed_run_continues_as_the_run_that_never_stopped() -> None:
    step, params, batches = problem()
    step = sw.pipeline(sw.shard_params(step, "dp", 3), "pp", "1f1b", 2)
    mesh = sw.Mesh(dp=2, pp=2)

    def resumed() -> bool:
        straight = step.init(params, mesh, seed=7)
        for b in batches:
            straight, _ = step(straight, b)
        state = step.init(params, mesh, seed=7)
        state, _ = step(state, batches[0])
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        random.seed(99)  # the resumed process's own generators hold anything
        np.random.seed(99)
        state = torch.load(buffer, weights_only=False)
        for b in batches[1:]:
            state, _ = step(state, b)
        return _equal(optree.tree_leaves(step.full_params(state)), optree.tree_leaves(step.full_params(straight)))

    assert all(sw.launch(resumed, 4))


def _users_draws_after(step: Any, params: Any, batches: Any, user_seed: int) -> tuple[float, float, float]:
    random.seed(user_seed)
    np.random.seed(user_seed)
    np.random.standard_normal()  # numpy keeps the second of a pair of normals: part of its state
    _run(step, params, batches, None)
    return random.random(), float(np.random.random()), float(np.random.standard_normal())


def test_the_users_generators_go_on_from_their_own_state_whatever_the_step_drew() -> None:
    """The user's streams after a run of steps depend on their state before it only (and on the number of
    steps): steps drawing from them (under remat, which replays) and as many steps drawing nothing leave
    them alike; another user seed differs."""
    step, params, batches = problem()
    drawing = _users_draws_after(sw.remat(step), params, batches, 5)
    torch.manual_seed(0)
    chain, quiet_params = sw.functionalize(nn.Sequential(nn.Linear(4, 4)).double())
    quiet = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    quiet_batches = [(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))] * len(batches)
    assert _users_draws_after(quiet, quiet_params, quiet_batches, 5) == drawing
    assert _users_draws_after(sw.remat(step), params, batches, 5) == drawing
    assert _users_draws_after(sw.remat(step), params, batches, 6) != drawing


def test_a_rank_waiting_in_a_collective_inside_its_compute_keeps_its_host_streams() -> None:
    """Thread ranks share Python's and numpy's generators as they share torch's: a rank that waits in a
    collective inside its compute lends them, and takes them back as it left them. Each rank's draw after
    the wait follows its draw before it in one stream (unlent, it would come from the other rank's)."""
    follows: list[bool] = []

    def mixed(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        numpy_before, python_before = np.random.get_state(), random.getstate()
        drawn = (np.random.rand(), random.random())
        y = sw.collectives.pmean(x @ p["w"], "dp")
        after = (np.random.rand(), random.random())
        numpy_after, python_after = np.random.get_state(), random.getstate()
        np.random.set_state(numpy_before)
        random.setstate(python_before)
        one_stream = ((np.random.rand(), random.random()), (np.random.rand(), random.random()))
        follows.append(one_stream == (drawn, after))
        np.random.set_state(numpy_after)
        random.setstate(python_after)
        return y * (1.0 + drawn[0] + after[1])

    chain = sw.Chain([sw.Layer("mixed", mixed, ("w",)), sw.Layer("out", lambda p, x: x @ p["v"], ("v",))])
    gen = torch.Generator().manual_seed(0)
    params = {"mixed": {"w": torch.randn(4, 6, generator=gen, dtype=torch.float64)},
              "out": {"v": torch.randn(6, 2, generator=gen, dtype=torch.float64)}}
    step = sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "dp", 3)
    _, _, batches = problem()

    def run() -> list[torch.Tensor]:
        mesh = sw.Mesh(dp=2)
        with mesh:  # the layer's pmean finds the mesh
            return _run(step, params, batches, mesh)

    first, second = sw.launch(run, 2, timeout=20), sw.launch(run, 2, timeout=20)
    assert follows and all(follows)
    assert all(_equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_loss_drawing_from_pythons_random_is_not_taken_for_a_loss_that_is_no_mean() -> None:
    """The loss probe evaluates loss_fn on parts of the first micro-batch to check it is a mean over the
    rows; a loss that draws (here a random weight from Python's random) gives parts that differ by their
    draws, which it took for another computation and refused, as it does not for torch's draws."""
    step, params, batches = problem()

    def noisy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) * (1.0 + random.random())

    zero3 = sw.shard_params(sw.train_step(step.chain, noisy, sw.optim.sgd(0.1)), "dp", 3)
    mesh = sw.Mesh(dp=2)
    first, second = (sw.launch(lambda: _run(zero3, params, batches, mesh), 2) for _ in range(2))
    assert all(_equal(a, b) for a, b in zip(first, second, strict=True))


class _HostDropout(nn.Module):
    """Draws from Python's ``random`` and numpy's global generator in every forward, fake tensors included."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (1.0 + random.random()) * (1.0 + float(np.random.rand()))
        return self.fc(x) * scale


def test_a_prediction_on_fake_tensors_leaves_the_host_generators_as_it_found_them() -> None:
    """A pipeline predicts its stage boundaries by running the layers on fake tensors, and their host draws
    run for real there. Thread ranks share the generators: a rank predicting while another computed shifted
    the other's draws, and a zero-bubble step's first run differed from the next, at random, under load
    (test_remat_host_random.py's zero-bubble test failed 2 to 3 times in 12). The prediction now holds the
    generators, as a compute does, and leaves them as it found them."""
    model = nn.Sequential(_HostDropout(), _HostDropout(), nn.Linear(4, 2)).double()
    chain, params = sw.functionalize(model)
    step = sw.pipeline(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "pp", "zb_h1", 2)
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    random.seed(7)
    np.random.seed(7)
    python, numpy = random.getstate(), np.random.get_state()
    step.plan(sw.Mesh(pp=2), params, batch)
    assert random.getstate() == python
    after = np.random.get_state()
    assert after[0] == numpy[0] and np.array_equal(after[1], numpy[1]) and after[2:] == numpy[2:]
