"""Learning-rate schedules: values, torch.optim.lr_scheduler parity, validation, and data-ness."""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.engine.optim.schedules import (
    Constant,
    CosineDecay,
    Join,
    Linear,
    LinearWarmup,
    WarmupCosine,
    constant,
    cosine_decay,
    join,
    linear,
    linear_warmup,
    warmup_cosine,
)

EPS64 = 2.0**-53  # unit roundoff of a Python float


def _torch_lrs(
    make_scheduler: Callable[[torch.optim.Optimizer], object], base_lr: float, steps: int
) -> list[float]:
    """The lr each of `steps` optimizer updates runs at, stepping the scheduler after each
    update as torch documents: entry t is the lr of update t, counting from 0."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base_lr)
    scheduler = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()  # type: ignore[attr-defined]
    return lrs


SCHEDULES = [
    constant(3e-4),
    linear(1e-3, 1e-5, 7),
    linear_warmup(3e-4, 5),
    cosine_decay(0.1, 9, alpha=0.1),
    warmup_cosine(1e-3, 4, 15, end=1e-5),
    join([linear_warmup(1.0, 3), constant(0.5), cosine_decay(0.5, 6)], [3, 8]),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_lambda_lr_with_the_same_function_gives_the_same_lrs(
    schedule: Callable[[int], float],
) -> None:
    # base lr 1.0: LambdaLR's lr is exactly 1.0 * schedule(t), so equality is exact.
    steps = 20
    lrs = _torch_lrs(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule), 1.0, steps)
    assert lrs == [schedule(t) for t in range(steps)]


@pytest.mark.parametrize(
    ("peak", "decay_steps", "alpha"),
    [(0.3, 20, 0.0), (0.3, 20, 0.1), (1e-3, 100, 0.05), (2.0, 7, 0.5)],
)
def test_cosine_decay_is_cosine_annealing_until_decay_steps(
    peak: float, decay_steps: int, alpha: float
) -> None:
    """CosineAnnealingLR computes the same curve through a recursion (each lr from the
    previous one), so its rounding drifts: each of the t steps adds a few roundings of at
    most EPS64 * peak and carries the earlier error along scaled by a ratio <= 1. Hence
    an absolute bound of 8 * decay_steps * EPS64 * peak (measured: ~3e-16 * peak)."""
    ours = cosine_decay(peak, decay_steps, alpha)
    lrs = _torch_lrs(
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=decay_steps, eta_min=alpha * peak
        ),
        peak,
        decay_steps + 1,
    )
    bound = 8 * decay_steps * EPS64 * peak
    for t, lr in enumerate(lrs):
        assert abs(ours(t) - lr) <= bound, (t, ours(t), lr)
    assert ours(0) == peak
    assert ours(decay_steps) == alpha * peak
    # Past decay_steps optax's schedule holds; torch's rises again.
    assert ours(decay_steps + 5) == alpha * peak


def test_values_at_the_landmarks() -> None:
    assert constant(0.1)(0) == constant(0.1)(10**9) == 0.1

    lin = linear(1.0, 0.0, 4)
    assert [lin(t) for t in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert linear(1.0, 2.0, 0)(0) == 2.0

    warm = linear_warmup(1.0, 4)
    assert [warm(t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert linear_warmup(0.5, 0)(0) == 0.5

    cos = cosine_decay(2.0, 10)
    assert cos(0) == 2.0 and cos(5) == pytest.approx(1.0, abs=1e-15) and cos(10) == 0.0

    wc = warmup_cosine(1.0, 2, 12, end=0.1)
    assert [wc(t) for t in range(3)] == [0.5, 1.0, 1.0]  # update `warmup_steps` is the cosine's top
    assert wc(7) == pytest.approx(0.55, abs=1e-15)
    assert wc(12) == wc(100) == pytest.approx(0.1, abs=1e-16)

    joined = join([constant(1.0), linear(0.5, 0.0, 2)], [3])
    assert [joined(t) for t in range(6)] == [1.0, 1.0, 1.0, 0.5, 0.25, 0.0]


@given(
    peak=st.floats(1e-6, 10.0),
    warmup=st.integers(0, 50),
    decay=st.integers(1, 200),
    end_fraction=st.floats(0.0, 1.0),
)
def test_warmup_cosine_is_join_of_warmup_and_cosine(
    peak: float, warmup: int, decay: int, end_fraction: float
) -> None:
    """The combinator's parity test: the fused schedule is exactly the joined parts."""
    fused = warmup_cosine(peak, warmup, warmup + decay, end=0.0)
    joined = join([linear_warmup(peak, warmup), cosine_decay(peak, decay)], [warmup])
    assert all(fused(t) == joined(t) for t in range(warmup + decay + 3))
    # Shape: rises to peak, then never increases, staying within [end, peak].
    end = end_fraction * peak
    wc = warmup_cosine(peak, warmup, warmup + decay, end=end)
    lrs = [wc(t) for t in range(warmup + decay + 3)]
    assert all(a <= b for a, b in itertools.pairwise(lrs[: warmup + 1]))
    assert lrs[warmup] == peak
    assert all(b <= a for a, b in itertools.pairwise(lrs[warmup:]))
    assert all(end <= lr <= peak for lr in lrs[warmup:])


def test_tensor_steps_are_accepted_like_ints() -> None:
    schedule = warmup_cosine(1.0, 3, 10)
    assert schedule(torch.tensor(4)) == schedule(4)
    assert schedule(torch.tensor(4, dtype=torch.int32)) == schedule(4)


@pytest.mark.parametrize(
    ("step", "error", "match"),
    [
        (-1, ValueError, "step: must be >= 0"),
        (torch.tensor(-2), ValueError, "step: must be >= 0"),
        (1.0, TypeError, "step: expected an int"),
        (True, TypeError, "step: expected an int"),
        (torch.tensor(1.0), TypeError, "step: expected an int or a 0-d integer tensor"),
        (torch.tensor([1, 2]), TypeError, "step: expected an int or a 0-d integer tensor"),
    ],
)
def test_bad_steps_are_refused(step: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        linear_warmup(1.0, 3)(step)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: constant(-0.1), ValueError, "lr: a learning rate must be finite and >= 0"),
        (lambda: constant(float("nan")), ValueError, "lr:"),
        (lambda: linear(1.0, -1.0, 3), ValueError, "end:"),
        (lambda: linear(1.0, 0.0, -3), ValueError, "steps: must be >= 0"),
        (lambda: linear(1.0, 0.0, 2.5), TypeError, "steps: expected an int"),
        (lambda: linear_warmup(1.0, -1), ValueError, "warmup_steps: must be >= 0"),
        (lambda: cosine_decay(1.0, 0), ValueError, "decay_steps: must be >= 1"),
        (lambda: cosine_decay(1.0, 10, alpha=1.5), ValueError, r"alpha: .* \[0, 1\]"),
        (lambda: warmup_cosine(1.0, 10, 10), ValueError, "total_steps: must exceed warmup_steps"),
        (lambda: warmup_cosine(1.0, 1, 10, end=-1.0), ValueError, "end:"),
        (
            lambda: join([constant(1.0)], [3]),
            ValueError,
            "boundaries: need one fewer than schedules",
        ),
        (
            lambda: join([constant(1.0), constant(2.0), constant(3.0)], [5, 5]),
            ValueError,
            "strictly increasing",
        ),
        (lambda: join([constant(1.0), 2.0], [5]), TypeError, r"schedules\[1\]"),
        (lambda: join([constant(1.0), constant(2.0)], [-1]), ValueError, r"boundaries\[0\]"),
    ],
)
def test_bad_arguments_name_themselves(
    make: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make()


def test_schedules_are_frozen_hashable_picklable_data_with_readable_reprs() -> None:
    schedule = warmup_cosine(1e-3, 10, 100)
    assert repr(schedule) == "WarmupCosine(peak=0.001, warmup_steps=10, total_steps=100, end=0.0)"
    assert schedule == WarmupCosine(1e-3, 10, 100) and hash(schedule) == hash(
        WarmupCosine(1e-3, 10, 100)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.peak = 1.0  # type: ignore[misc]
    joined = join([linear_warmup(1.0, 2), cosine_decay(1.0, 5)], [2])
    assert repr(joined) == (
        "Join(schedules=(LinearWarmup(peak=1.0, warmup_steps=2), "
        "CosineDecay(peak=1.0, decay_steps=5, alpha=0.0)), boundaries=(2,))"
    )
    for s in [*SCHEDULES, joined]:
        assert pickle.loads(pickle.dumps(s)) == s
    assert isinstance(constant(1.0), Constant) and isinstance(linear(1, 0, 1), Linear)
    assert isinstance(linear_warmup(1.0, 1), LinearWarmup) and isinstance(
        cosine_decay(1.0, 1), CosineDecay
    )
    assert isinstance(joined, Join)
    assert math.isfinite(hash(joined))
