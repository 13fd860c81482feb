"""The equivalence checker passes equal steps and pinpoints the first divergence of unequal ones."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.testing import NotEquivalentError
from shardwise.testing.models import mlp


def _problem(lr: float = 0.1):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([3, 5, 2]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr, momentum=0.9))
    batches = [(torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)) for _ in range(3)]
    return step, params, batches


def test_identical_steps_are_equivalent_with_zero_error() -> None:
    step, params, batches = _problem()
    report = sw.testing.assert_equivalent(step, step, sw.Mesh(dp=2), batches, params)
    assert report.steps == 3 and max(report.max_rel_err) == 0.0


def test_first_divergence_is_reported_with_step_path_and_errors() -> None:
    step, params, batches = _problem()
    other, _, _ = _problem(lr=0.1 + 1e-9)
    with pytest.raises(NotEquivalentError) as info:
        sw.testing.assert_equivalent(other, step, sw.Mesh(dp=2), batches, params, rtol=1e-12)
    err = info.value
    # The loss of step 1 is computed before the first update, so it agrees; parameters do not.
    assert err.step == 1 and err.path.startswith("params[") and err.rank == 0
    assert 0 < err.rel_err < 1e-7
    assert "first divergence at step 1" in str(err) and "max abs error" in str(err)


def test_loose_tolerance_accepts_the_same_difference() -> None:
    step, params, batches = _problem()
    other, _, _ = _problem(lr=0.1 + 1e-9)
    sw.testing.assert_equivalent(other, step, sw.Mesh(dp=1), batches, params, rtol=1e-6)


def test_nan_in_one_place_only_is_a_divergence() -> None:
    step, params, batches = _problem()
    with pytest.raises(NotEquivalentError, match="step 1, loss"):
        sw.testing.assert_equivalent(_Poison(step), step, sw.Mesh(dp=1), batches[:1], params)


class _Poison:
    """A step whose loss is NaN: NaN against a finite reference must fail."""

    def __init__(self, step: sw.Step) -> None:
        self.step = step

    def init(self, params, mesh=None):  # type: ignore[no-untyped-def]
        return self.step.init(params, mesh)

    def full_params(self, state):  # type: ignore[no-untyped-def]
        return self.step.full_params(state)

    def __call__(self, state, batch):  # type: ignore[no-untyped-def]
        state, metrics = self.step(state, batch)
        return state, {**metrics, "loss": metrics["loss"] * float("nan")}
