"""``train_step(metrics=...)`` / ``step.with_metrics``: every kind of step reports what it is
asked for, updates exactly as it does reporting everything, and sums across ranks only what a
metric or a rule (clipping, mixed precision's skip) needs.

The ledger counts the all-reduces (``psum``) each step issues: the metrics' exchange is the
only one a step of these kinds makes, so a step asked for nothing must issue none. When a
distributed step exchanges anything, four more values ride along: the fingerprint of the batch and
the digest of the step, each with a weighted copy, which tell whether every rank passed the same
batch to the same step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp

# name -> (transform, mesh axes, psums per exchange: pipeline x dp sums over pp, then over dp)
KINDS: dict[str, tuple[Callable[[Any], Any], dict[str, int], int]] = {
    "single device": (lambda s: s, {}, 0),
    "zero-1": (lambda s: sw.shard_params(s, "dp", stage=1), {"dp": 2}, 1),
    "zero-3": (lambda s: sw.shard_params(s, "dp", stage=3), {"dp": 2}, 1),
    "pipeline": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), {"pp": 2}, 1),
    "pipeline x zero-3": (lambda s: sw.shard_params(sw.pipeline(s, "pp", "1f1b", 2), "dp", 3), {"dp": 2, "pp": 2}, 2),
}
SELECTIONS = [(), ("loss",), ("grad_norm",), ("loss", "grad_norm")]
BATCH_CHECK = 4  # the batch fingerprint and the step digest, each with a weighted copy


def _problem(clip_norm: float | None = None) -> tuple[Any, Any, list[Any]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([3, 6, 5, 2], "tanh").double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=clip_norm)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, generator=gen, dtype=torch.float64),
                torch.randn(8, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return step, params, batches


def _run(step: Any, axes: dict[str, int], params: Any, batches: list[Any]) -> list[Any]:
    """Per rank: (full params after the steps, metrics of each step, shapes of every psum issued)."""

    def body() -> Any:
        mesh = sw.Mesh(**axes) if axes else None
        state = step.init(params, mesh) if mesh is not None else step.init(params)
        reported = []
        with sw.collectives.comm_ledger() as ledger:
            for batch in batches:
                state, metrics = step(state, batch)
                reported.append({k: v.clone() for k, v in metrics.items() if k in ("loss", "grad_norm")})
        psums = [r.shape for r in ledger.records if r.op == "psum"]
        return step.full_params(state), reported, psums

    return sw.launch(body, math.prod(axes.values())) if axes else [body()]


def _assert_same_params(got: Any, expected: Any) -> None:
    for layer, tensors in expected.items():
        for name, tensor in tensors.items():
            assert torch.equal(got[layer][name], tensor), (layer, name)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_selection_reports_it_updates_the_same_and_exchanges_only_what_it_needs(kind: str) -> None:
    transform, axes, psums_per_exchange = KINDS[kind]
    step, params, batches = _problem()
    full = _run(transform(step), axes, params, batches)
    for selection in SELECTIONS:
        chosen = transform(step).with_metrics(selection)
        got = _run(chosen, axes, params, batches)
        for (params_got, reported, psums), (params_full, reported_full, _) in zip(got, full, strict=True):
            _assert_same_params(params_got, params_full)
            for metrics, metrics_full in zip(reported, reported_full, strict=True):
                assert sorted(metrics) == sorted(selection), (kind, selection)
                for name in selection:
                    assert torch.equal(metrics[name], metrics_full[name]), (kind, selection, name)
            # One value per asked-for metric (and the batch's two), in every psum of every step; none
            # when nothing is asked.
            expected = [(len(selection) + BATCH_CHECK,)] * (psums_per_exchange * len(batches)) if selection else []
            assert psums == expected, (kind, selection)


def test_transforms_keep_the_selection_of_the_step_they_rewrite() -> None:
    step, _, _ = _problem()
    quiet = step.with_metrics(["grad_norm"])
    for transform, _, _ in KINDS.values():
        assert transform(quiet).metrics == ("grad_norm",)
    assert sw.remat(sw.mixed_precision(quiet)).metrics == ("grad_norm",)


@pytest.mark.parametrize("kind", ["zero-3", "pipeline", "pipeline x zero-3"])
def test_clipping_still_sums_the_norm_when_no_metric_is_asked_for(kind: str) -> None:
    transform, axes, psums_per_exchange = KINDS[kind]
    step, params, batches = _problem(clip_norm=0.05)  # small enough to clip every step
    full = _run(transform(step), axes, params, batches)
    got = _run(transform(step).with_metrics(()), axes, params, batches)
    for (params_got, reported, psums), (params_full, _, _) in zip(got, full, strict=True):
        _assert_same_params(params_got, params_full)
        assert reported == [{}, {}]
        assert psums == [(1 + BATCH_CHECK,)] * (psums_per_exchange * len(batches))  # the squared norm alone


@pytest.mark.parametrize("kind", ["zero-3", "pipeline"])
def test_mixed_precision_still_sums_the_finite_flag_when_no_metric_is_asked_for(kind: str) -> None:
    transform, axes, psums_per_exchange = KINDS[kind]
    step, params, batches = _problem()
    mixed = sw.mixed_precision(step, "params=f64,compute=f32,output=f64", loss_scale="dynamic")
    full = _run(transform(mixed), axes, params, batches)
    got = _run(transform(mixed).with_metrics(()), axes, params, batches)
    for (params_got, _, psums), (params_full, _, _) in zip(got, full, strict=True):
        _assert_same_params(params_got, params_full)
        assert psums == [(1 + BATCH_CHECK,)] * (psums_per_exchange * len(batches))


def test_a_quiet_step_reports_nothing_but_precision_state() -> None:
    step, params, batches = _problem()
    mixed = sw.mixed_precision(step, "params=f64,compute=f32,output=f64", loss_scale="dynamic").with_metrics(())
    state = mixed.init(params)
    _, metrics = mixed(state, batches[0])
    assert sorted(metrics) == ["loss_scale", "skipped"]


@pytest.mark.parametrize(
    ("metrics", "error", "words"),
    [
        ("loss", TypeError, "write metrics=('loss',)"),
        (("loss", "accuracy"), ValueError, "unknown ['accuracy']"),
        (3, TypeError, "collection of metric names"),
    ],
)
def test_a_bad_selection_is_refused_with_what_to_write(metrics: Any, error: type[Exception], words: str) -> None:
    step, _, _ = _problem()
    with pytest.raises(error, match=re.escape(words)):
        step.with_metrics(metrics)
    with pytest.raises(error):
        sw.train_step(step.chain, step.loss_fn, step.optimizer, metrics=metrics)


@pytest.mark.parametrize("kind", ["zero-3", "pipeline x zero-3"])
def test_a_loop_may_log_every_other_step_on_one_state(kind: str) -> None:
    """The logging loop of the docs: a quiet step between reporting ones, on the same state."""
    transform, axes, _ = KINDS[kind]
    step, params, batches = _problem()
    loud = transform(step)
    quiet = loud.with_metrics(())
    batches = batches * 2

    def body() -> Any:
        mesh = sw.Mesh(**axes)
        mixed, alone = loud.init(params, mesh), loud.init(params, mesh)
        for i, batch in enumerate(batches):
            mixed, reported = (loud if i % 2 else quiet)(mixed, batch)
            # every ZeRO step measures peak_gathered_bytes
            expected = ({"loss", "grad_norm"} if i % 2 else set()) | {"peak_gathered_bytes"}
            assert set(reported) == expected
            alone, _ = loud(alone, batch)
        return loud.full_params(mixed), loud.full_params(alone)

    for mixed, alone in sw.launch(body, 4 if "pipeline" in kind else 2):
        _assert_same_params(mixed, alone)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_model_with_every_parameter_frozen_reports_its_loss_in_its_own_dtype(kind: str) -> None:
    """With nothing to train the metrics' dtype came from no parameter and fell back to float32: a
    float64 model reported its loss 3.6e-8 off the single device's. The frozen tensors decide now."""
    torch.manual_seed(0)
    model = mlp([3, 6, 5, 2], "tanh").double().requires_grad_(False)
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(0.05))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, generator=gen, dtype=torch.float64),
                torch.randn(8, 2, generator=gen, dtype=torch.float64))]
    transform, axes, _ = KINDS[kind]
    stepped = transform(step)

    def loss() -> torch.Tensor:
        mesh = sw.Mesh(**axes) if axes else None
        state = stepped.init(params, mesh) if mesh is not None else stepped.init(params)
        return stepped(state, batches[0])[1]["loss"]

    reported = sw.launch(loss, math.prod(axes.values())) if axes else [loss()]
    expected = torch.nn.functional.mse_loss(model(batches[0][0]), batches[0][1])
    for got in reported:
        assert got.dtype == torch.float64
        # the mean of two halves' means (dp) is the whole batch's up to one rounding
        torch.testing.assert_close(got, expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_with_every_parameter_frozen_keeps_its_state_through_steps(stage: int) -> None:
    """ZeRO-1/2 with no unit to update gathered nothing, and the next state's parameters were None:
    the next step ran, but ``full_params`` (and a checkpoint's save) failed on them."""
    torch.manual_seed(0)
    model = mlp([3, 6, 2], "tanh").double().requires_grad_(False)
    chain, params = sw.functionalize(model)
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(0.05)), "dp", stage)
    batch = (torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64))

    def run() -> Any:
        state = step.init(params, sw.Mesh(dp=2))
        for _ in range(2):
            state, _ = step(state, batch)
        return step.full_params(state)

    for full in sw.launch(run, 2):
        assert full == {layer: {} for layer in params}  # frozen weights live in the chain, not the state
