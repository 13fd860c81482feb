"""Dropout is reproducible: per-rank, per-compute random streams seeded from the TrainState.

Thread ranks share torch's global generators, so without the step's own streams two
identical runs with dropout differ. With them: two runs on threads are bitwise equal,
processes equal threads, a resumed run equals an uninterrupted one, remat replays the
forward's masks, and another seed gives other masks (the streams are really random).
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import optree
import pytest
import torch

import shardwise as sw


def _problem() -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 16), torch.nn.Dropout(0.3),
        torch.nn.Linear(16, 2),
    ).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]
    return step, params, batches


# Built once, at import (in each process of the processes backend too): thread ranks that built the
# model themselves would race on the global generator while initialising it (issue 19, not this one).
PROBLEM = _problem()


def _run(step: sw.Step, params: dict, batches: list, mesh: sw.Mesh, seed: int = 0) -> list[torch.Tensor]:
    state = step.init(params, mesh, seed=seed)
    for b in batches:
        state, _ = step(state, b)
    return optree.tree_leaves(step.full_params(state))


def _sharded() -> tuple[sw.Step, dict, list, sw.Mesh]:
    step, params, batches = PROBLEM
    return sw.shard_params(sw.pipeline(step, "pp", "1f1b", 2), "dp", 3), params, batches, sw.Mesh(dp=2, pp=2)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_two_runs_on_threads_are_bitwise_equal_and_another_seed_differs() -> None:
    step, params, batches, mesh = _sharded()
    first = sw.launch(lambda: _run(step, params, batches, mesh), 4)
    second = sw.launch(lambda: _run(step, params, batches, mesh), 4)
    other = sw.launch(lambda: _run(step, params, batches, mesh, seed=1), 4)
    assert all(_equal(a, b) for a, b in zip(first, second, strict=True))
    assert not _equal(first[0], other[0])  # the masks depend on the seed: dropout really drops


def test_the_single_device_step_is_repeatable_whatever_the_global_generator() -> None:
    step, params, batches = PROBLEM
    torch.manual_seed(123)
    a = _run(step, params, batches, None)  # type: ignore[arg-type]
    torch.manual_seed(456)
    b = _run(step, params, batches, None)  # type: ignore[arg-type]
    assert _equal(a, b)


def _pipelined_run() -> list[torch.Tensor]:
    step, params, batches = PROBLEM
    return _run(sw.pipeline(step, "pp", "1f1b", 2), params, batches, sw.Mesh(pp=2))


def _sharded_run() -> list[torch.Tensor]:
    step, params, batches, mesh = _sharded()
    return _run(step, params, batches, mesh)


@pytest.mark.gloo
def test_processes_draw_the_masks_threads_draw(gloo2: Any, gloo4: Any) -> None:
    """A pipeline moves values exactly, so processes equal threads bitwise. With data parallelism
    gloo sums gradients in another order than threads, so they agree to float64 rounding only:
    other masks would differ by far more (dropout 0.3 changes every update). (The gloo ranks are
    the suite's shared processes: the masks come from the step's seed, not from a fresh process.)"""
    assert all(_equal(a, b) for a, b in zip(sw.launch(_pipelined_run, 2), gloo2.run(_pipelined_run), strict=True))
    for a, b in zip(sw.launch(_sharded_run, 4), gloo4.run(_sharded_run), strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


def test_a_resumed_run_continues_identically() -> None:
    step, params, batches, mesh = _sharded()

    def resumed() -> bool:
        straight = step.init(params, mesh, seed=7)
        for b in batches:
            straight, _ = step(straight, b)
        state = step.init(params, mesh, seed=7)
        state, _ = step(state, batches[0])
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
        for b in batches[1:]:
            state, _ = step(state, b)
        return _equal(optree.tree_leaves(step.full_params(state)), optree.tree_leaves(step.full_params(straight)))

    assert all(sw.launch(resumed, 4))


def test_remat_replays_the_forward_masks() -> None:
    """Backward recomputes each checkpointed layer: with other masks the gradients would differ."""
    step, params, batches = PROBLEM
    plain = _run(step, params, batches, None)  # type: ignore[arg-type]
    rematted = _run(sw.remat(step), params, batches, None)  # type: ignore[arg-type]
    assert _equal(plain, rematted)
    piped_mesh = sw.Mesh(pp=2)
    piped = sw.launch(lambda: _run(sw.pipeline(step, "pp", "zb_h1", 2), params, batches, piped_mesh), 2)
    piped_remat = sw.launch(lambda: _run(sw.remat(sw.pipeline(step, "pp", "zb_h1", 2)), params, batches, piped_mesh), 2)
    assert all(_equal(a, b) for a, b in zip(piped, piped_remat, strict=True))


def test_a_bad_seed_is_refused() -> None:
    step, params, _ = PROBLEM
    with pytest.raises(TypeError, match="seed of the step's random streams is an int"):
        step.init(params, seed="0")  # type: ignore[arg-type]


class _Slow(torch.nn.Module):
    """Computes for ``seconds`` in every forward once ``on`` (in short sleeps, so that the launcher
    can stop its thread); not during functionalize."""

    on = False

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deadline = time.monotonic() + (self.seconds if _Slow.on else 0.0)
        while time.monotonic() < deadline:
            time.sleep(0.02)
        return x


def test_a_compute_holding_the_generators_past_the_timeout_fails_the_launch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), _Slow(8.0), torch.nn.Linear(8, 2)
    ).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    step = sw.shard_params(step, "dp")
    batch = PROBLEM[2][0]
    mesh, timeout = sw.Mesh(dp=2), 1.0

    def run() -> None:
        step(step.init(params, mesh), batch)

    _Slow.on = True
    started = time.monotonic()
    try:
        expected = (r"rank \d waited 1 s for torch's shared random generators "
                    r".*rank \d holds them .* raise launch\(timeout=\.\.\.\)")
        with pytest.raises(sw.collectives.RankFailed, match=expected):
            sw.launch(run, mesh.size, backend="threads", timeout=timeout)
    finally:
        _Slow.on = False
    assert time.monotonic() - started < timeout + 4.0


@pytest.mark.parametrize(
    "values", [(0, 0, 0, 0, 1), (2**62 + 12345, 3, 7, 2, 2), (-5, 1, 0, 9, 3), (2**64 + 1, 2, 4, 6, 8)]
)
def test_a_compute_seed_mixed_in_two_parts_is_the_seed_mixed_at_once(values: tuple[int, ...]) -> None:
    # The executor mixes (step seed, rank) once per step and each compute's (stage, micro-batch,
    # kind) after it: the seeds, and so every dropout mask, must be those of mix(all five).
    from shardwise.engine.run.rng import MASK, START, mix, mixed

    assert mixed(mixed(START, *values[:2]), *values[2:]) & MASK == mix(*values)


def test_joined_computes_draw_the_masks_of_separate_ones() -> None:
    """Untraced, the forwards of consecutive layers run as one loop and their backwards as one call
    (run_shape.joined_forwards / joined_backwards); traced, every compute runs alone, seeded on its
    own. Each layer must draw the same masks either way, on one device and in a pipeline's ranks."""
    from shardwise.engine.run.run_shape import joined_backwards, joined_forwards

    step, params, batches = PROBLEM
    actions = step.plan(None, params).for_rank(0)
    covered = joined_backwards(actions)[1]
    assert joined_forwards(actions, {(s + 1, m) for s, m in covered}) == {0: len(step.chain.names)}  # one run
    plain = _run(step, params, batches, None)  # type: ignore[arg-type]
    assert _equal(plain, _run(step.with_trace(), params, batches, None))  # type: ignore[arg-type]
    assert not _equal(plain, _run(step, params, batches, None, seed=1))  # type: ignore[arg-type]
    piped = sw.pipeline(step, "pp", "1f1b", 2)
    mesh = sw.Mesh(pp=2)
    joined = sw.launch(lambda: _run(piped, params, batches, mesh), 2)
    alone = sw.launch(lambda: _run(piped.with_trace(), params, batches, mesh), 2)
    assert all(_equal(a, b) for a, b in zip(joined, alone, strict=True))


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``Executor.<name>`` (the counts go into the returned list)."""
    from shardwise.engine.run.executor import Executor

    calls: list[int] = []
    original = getattr(Executor, name)

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Executor, name, counted)
    return calls


def test_stages_that_draw_nothing_run_unseeded_and_step_as_seeded_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage of layers whose forwards draw no random numbers (a Linear, a GELU, called directly) runs
    without seeding the generators; the seed would change nothing it computes, since every compute
    seeds its own. So the steps are bitwise those of a run that seeds every stage (as with no layer
    known to draw nothing), and only the dropout stages seed their forwards."""
    from shardwise.engine.model import module_call

    step, params, batches = PROBLEM
    seeds, quiet = _counting(monkeypatch, "_forward_seed"), _counting(monkeypatch, "_run_quiet")
    unseeded = _run(step, params, batches, None)  # type: ignore[arg-type]
    dropouts = sum(isinstance(step.chain[n].fn.module, torch.nn.Dropout) for n in step.chain.names)
    stages = len(step.chain.names)
    assert (len(seeds), len(quiet)) == (dropouts * len(batches), (stages - dropouts) * len(batches))
    seeds.clear(), quiet.clear()
    monkeypatch.setattr(module_call, "DRAWS_NOTHING", frozenset())
    seeded_everywhere = _run(step, params, batches, None)  # type: ignore[arg-type]
    assert (len(seeds), len(quiet)) == (stages * len(batches), 0)
    assert _equal(unseeded, seeded_everywhere)
    assert not _equal(unseeded, _run(step, params, batches, None, seed=1))  # type: ignore[arg-type]


def test_a_hook_that_draws_makes_the_stage_seeded() -> None:
    """A global forward hook makes every module call run through ``Module.__call__``, which runs the
    hook: a hook that draws random numbers then draws from the stage's seeded stream, whatever the
    global generator's state (unseeded, the two runs below would draw different numbers)."""
    step, params, batches = PROBLEM
    drawn: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(module, torch.nn.Linear):
            drawn.append(torch.rand(3))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        torch.manual_seed(1)
        first = _run(step, params, batches[:1], None)  # type: ignore[arg-type]
        first_draws, drawn[:] = list(drawn), []
        torch.manual_seed(2)
        second = _run(step, params, batches[:1], None)  # type: ignore[arg-type]
    finally:
        handle.remove()
    assert len(first_draws) == 3 and _equal(first_draws, drawn)
    assert _equal(first, second)


# --- a layer's generator attribute is that generator ----------------------------------------


class _Noisy(torch.nn.Module):
    """Drops inputs with a mask drawn from ``gen`` (None: torch's default, without generator=)."""

    def __init__(self, gen: torch.Generator | None) -> None:
        super().__init__()
        self.fc, self.gen = torch.nn.Linear(4, 4), gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=self.gen, dtype=x.dtype) > 0.5
        return self.fc(x * keep)


def _noisy(gen: torch.Generator | None) -> tuple[sw.Step, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Noisy(gen), torch.nn.Linear(4, 2)).double()
    chain, params = sw.functionalize(model)
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), params


_NOISY_BATCHES = [
    (torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64))
    for g in [torch.Generator().manual_seed(2)] for _ in range(2)
]


def test_a_layer_drawing_from_the_default_generator_by_name_is_seeded_by_the_step_and_replayed_by_remat() -> None:
    """``generator=torch.default_generator`` is the stream the step seeds: the chain must not hold
    a private copy of it (the step's seed would not reach it and remat would refuse it as the
    layer's own)."""
    implicit, params = _noisy(None)
    explicit, _ = _noisy(torch.default_generator)
    expected = _run(implicit, params, _NOISY_BATCHES, None)  # type: ignore[arg-type]
    assert _equal(_run(explicit, params, _NOISY_BATCHES, None), expected)  # type: ignore[arg-type]
    rematted = sw.remat(explicit, sw.policies.nothing_saveable)
    assert _equal(_run(rematted, params, _NOISY_BATCHES, None), expected)  # type: ignore[arg-type]


def test_a_layer_drawing_from_its_own_generator_draws_from_the_users_generator() -> None:
    """Re-seeding the generator the layer holds reaches the chain's layer: it is the same object."""
    gen = torch.Generator()
    step, params = _noisy(gen)
    layer = step.chain["1"]
    x = torch.ones(2, 4, dtype=torch.float64)
    gen.manual_seed(7)
    first = layer(step.chain.layer_params(params, layer), x)
    gen.manual_seed(7)
    assert torch.equal(layer(step.chain.layer_params(params, layer), x), first)
    assert not torch.equal(layer(step.chain.layer_params(params, layer), x), first)  # the stream moved on


_DRAWN: dict[int, list[torch.Tensor]] = {}  # per thread (module-level: the chain copies the module)


class _Recording(torch.nn.Module):
    """Records, per thread, what it draws from its own generator."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.fc, self.gen = torch.nn.Linear(4, 4), gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _DRAWN.setdefault(threading.get_ident(), []).append(torch.rand(3, generator=self.gen))
        return self.fc(x)


def test_rank_threads_draw_from_their_own_copies_of_a_layers_generator_as_rank_processes_do() -> None:
    """Every rank process holds its own copy of a layer's generator, so each rank draws the same
    first numbers. The rank threads of the threads backend shared one generator for a while (when
    the chain began to keep the user's generator as itself): two ranks drew from one stream, in
    whichever order the threads ran, and the result changed from run to run. Each rank thread's
    replica now copies the generator (the default generators stay shared: the step seeds them)."""
    gen = torch.Generator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Recording(gen), torch.nn.Linear(4, 2)).double()
    chain, params = sw.functionalize(model)
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=2)
    gen.manual_seed(7)
    _DRAWN.clear()
    sw.launch(lambda: step(step.init(params, sw.Mesh(dp=2)), _NOISY_BATCHES[0]), 2, backend="threads")
    first = torch.rand(3, generator=torch.Generator().manual_seed(7))
    assert len(_DRAWN) == 2
    for draws in _DRAWN.values():
        assert torch.equal(draws[0], first), draws
