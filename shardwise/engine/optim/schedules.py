"""Learning-rate schedules: small frozen dataclasses mapping an update count to a learning rate.

``schedule(step)`` is the learning rate of update number ``step``, counting from 0 for the
first update. That is what ``torch.optim.lr_scheduler`` gives when ``scheduler.step()`` is
called once after every ``optimizer.step()``: the first update runs at ``lr_lambda(0)``.
The optimizers in :mod:`shardwise.engine.optim.optimizers` call ``lr(state.step)`` before counting the
update, so a schedule passed as ``lr`` follows exactly that convention.

Schedules are plain data (a readable repr, equality, hashing, pickling) and pure: calling
one never changes it. Compose them with :func:`join`, as ``optax.join_schedules`` does.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from torch import Tensor

__all__ = [
    "Constant",
    "CosineDecay",
    "Join",
    "Linear",
    "LinearWarmup",
    "Schedule",
    "WarmupCosine",
    "constant",
    "cosine_decay",
    "join",
    "linear",
    "linear_warmup",
    "warmup_cosine",
]

# Any callable from an update count to a learning rate is a schedule; the dataclasses below
# are the built-in ones. A plain function (e.g. a lambda) is accepted wherever one is.
Schedule: TypeAlias = Callable[[int], float]


def as_step(step: int | Tensor) -> int:
    """The update count ``step`` as a Python int: an int, or a 0-d integer tensor such as
    an optimizer state's ``step``. Refuses floats and negative counts."""
    if isinstance(step, Tensor):
        if step.numel() != 1 or step.is_floating_point() or step.is_complex():
            raise TypeError(
                f"step: expected an int or a 0-d integer tensor, got a {step.dtype} tensor of "
                f"shape {tuple(step.shape)}; pass the optimizer state's `step` or an int"
            )
        step = int(step.item())
    elif isinstance(step, bool):
        raise TypeError("step: expected an int, got a bool")
    else:
        try:
            step = operator.index(step)
        except TypeError:
            raise TypeError(
                f"step: expected an int update count, got {type(step).__name__} {step!r}; "
                "schedules count whole updates from 0"
            ) from None
    if step < 0:
        raise ValueError(f"step: must be >= 0 (updates count from 0), got {step}")
    return step


def _check_lr(name: str, value: float) -> None:
    # `not value >= 0` also refuses NaN.
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"{name}: a learning rate must be finite and >= 0, got {value}")


def _check_steps(name: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name}: expected an int number of updates, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum} updates, got {value}")


def _warmup_fraction(t: int, warmup_steps: int) -> float:
    # The fraction first, then the product: `peak * n / n` can round above peak, whereas
    # `n / n` is exactly 1 and a correctly rounded quotient never decreases as t grows.
    return (t + 1) / warmup_steps


def _cosine(peak: float, end: float, t: int, steps: int) -> float:
    """Half a cosine from ``peak`` (t = 0) to ``end`` (t >= steps)."""
    done = (1 - math.cos(math.pi * min(t, steps) / steps)) / 2  # 0 at t = 0, exactly 1 at t = steps
    # Interpolate from the nearer end, as torch.lerp does, so both landmarks are exact:
    # `end + (peak - end) * 1` (torch's closed form at t = 0) can round to a neighbour of peak.
    if done < 0.5:
        return peak - (peak - end) * done
    return end + (peak - end) * (1 - done)


@dataclass(frozen=True)
class Constant:
    """The same learning rate for every update."""

    lr: float

    def __post_init__(self) -> None:
        _check_lr("lr", self.lr)

    def __call__(self, step: int | Tensor) -> float:
        as_step(step)
        return self.lr


@dataclass(frozen=True)
class Linear:
    """``start`` at update 0, moving linearly to ``end`` at update ``steps`` and staying
    there (optax ``linear_schedule``). ``steps=0`` means ``end`` from the first update."""

    start: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        _check_lr("start", self.start)
        _check_lr("end", self.end)
        _check_steps("steps", self.steps, minimum=0)

    def __call__(self, step: int | Tensor) -> float:
        t = as_step(step)
        if t >= self.steps:
            return self.end
        return self.start + (self.end - self.start) * (t / self.steps)


@dataclass(frozen=True)
class LinearWarmup:
    """Ramps linearly to ``peak`` over the first ``warmup_steps`` updates, then holds it.

    Update ``t < warmup_steps`` runs at ``peak * ((t + 1) / warmup_steps)``, so no update is
    wasted at lr 0 and update ``warmup_steps - 1`` is the first at ``peak``. (optax's
    ``linear_schedule(0, peak, n)`` starts at 0 instead; use :func:`linear` for that.)
    """

    peak: float
    warmup_steps: int

    def __post_init__(self) -> None:
        _check_lr("peak", self.peak)
        _check_steps("warmup_steps", self.warmup_steps, minimum=0)

    def __call__(self, step: int | Tensor) -> float:
        t = as_step(step)
        if t >= self.warmup_steps:
            return self.peak
        return self.peak * _warmup_fraction(t, self.warmup_steps)


@dataclass(frozen=True)
class CosineDecay:
    """Half a cosine from ``peak`` at update 0 to ``alpha * peak`` at update ``decay_steps``,
    then constant (optax ``cosine_decay_schedule``). Until ``decay_steps`` it is torch's
    ``CosineAnnealingLR(T_max=decay_steps, eta_min=alpha * peak)`` (to rounding: torch
    computes it recursively), which instead rises again after. Update 0 runs at exactly
    ``peak`` and update ``decay_steps`` at exactly ``alpha * peak``.
    """

    peak: float
    decay_steps: int
    alpha: float = 0.0

    def __post_init__(self) -> None:
        _check_lr("peak", self.peak)
        _check_steps("decay_steps", self.decay_steps, minimum=1)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(
                f"alpha: the final learning rate as a fraction of peak must be in [0, 1], got {self.alpha}"
            )

    def __call__(self, step: int | Tensor) -> float:
        return _cosine(self.peak, self.alpha * self.peak, as_step(step), self.decay_steps)


@dataclass(frozen=True)
class WarmupCosine:
    """:class:`LinearWarmup` to ``peak`` over ``warmup_steps`` updates, then half a cosine to
    ``end``, reached at update ``total_steps`` (which counts the warmup) and held after.
    Update ``warmup_steps`` is the top of the cosine and runs at ``peak``."""

    peak: float
    warmup_steps: int
    total_steps: int
    end: float = 0.0

    def __post_init__(self) -> None:
        _check_lr("peak", self.peak)
        _check_lr("end", self.end)
        _check_steps("warmup_steps", self.warmup_steps, minimum=0)
        _check_steps("total_steps", self.total_steps, minimum=1)
        if self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps: must exceed warmup_steps ({self.warmup_steps}) since it counts "
                f"the warmup too, got {self.total_steps}; for warmup alone use linear_warmup"
            )

    def __call__(self, step: int | Tensor) -> float:
        t = as_step(step)
        if t < self.warmup_steps:
            return self.peak * _warmup_fraction(t, self.warmup_steps)
        return _cosine(
            self.peak, self.end, t - self.warmup_steps, self.total_steps - self.warmup_steps
        )


@dataclass(frozen=True)
class Join:
    """``schedules[0]`` until ``boundaries[0]``, then ``schedules[1]`` restarted from 0,
    and so on (optax ``join_schedules``): update ``t`` with ``boundaries[i-1] <= t <
    boundaries[i]`` runs at ``schedules[i](t - boundaries[i-1])``."""

    schedules: tuple[Schedule, ...]
    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        # Accept lists but store tuples, so the dataclass stays hashable.
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "boundaries", tuple(self.boundaries))
        if len(self.schedules) != len(self.boundaries) + 1:
            raise ValueError(
                f"boundaries: need one fewer than schedules ({len(self.schedules)} schedules), "
                f"got {len(self.boundaries)}; boundary i is the update where schedule i+1 starts"
            )
        for i, schedule in enumerate(self.schedules):
            if not callable(schedule):
                raise TypeError(
                    f"schedules[{i}]: expected a schedule (step -> lr), got {schedule!r}"
                )
        for i, boundary in enumerate(self.boundaries):
            _check_steps(f"boundaries[{i}]", boundary, minimum=0)
        if any(b <= a for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)):
            raise ValueError(
                f"boundaries: must be strictly increasing, got {list(self.boundaries)}"
            )

    def __call__(self, step: int | Tensor) -> float:
        t = as_step(step)
        start = 0
        for schedule, boundary in zip(self.schedules, self.boundaries, strict=False):
            if t < boundary:
                return schedule(t - start)
            start = boundary
        return self.schedules[-1](t - start)


def constant(lr: float) -> Constant:
    """The same learning rate for every update."""
    return Constant(lr)


def linear(start: float, end: float, steps: int) -> Linear:
    """From ``start`` at update 0 linearly to ``end`` at update ``steps``, then ``end``."""
    return Linear(start, end, steps)


def linear_warmup(peak: float, warmup_steps: int) -> LinearWarmup:
    """``peak * ((t + 1) / warmup_steps)`` for update ``t < warmup_steps``, then ``peak``."""
    return LinearWarmup(peak, warmup_steps)


def cosine_decay(peak: float, decay_steps: int, alpha: float = 0.0) -> CosineDecay:
    """Half a cosine from ``peak`` to ``alpha * peak`` over ``decay_steps`` updates."""
    return CosineDecay(peak, decay_steps, alpha)


def warmup_cosine(
    peak: float, warmup_steps: int, total_steps: int, end: float = 0.0
) -> WarmupCosine:
    """Linear warmup to ``peak``, then half a cosine to ``end`` at update ``total_steps``."""
    return WarmupCosine(peak, warmup_steps, total_steps, end)


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Join:
    """Runs each schedule in turn, switching (and restarting its count) at each boundary."""
    return Join(tuple(schedules), tuple(boundaries))
