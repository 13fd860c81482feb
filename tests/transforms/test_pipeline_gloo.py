"""pipeline on gloo processes: point-to-point sends between real processes, same results.

Each rank rebuilds the seeded problem; the parent computes the single-device
reference. float64 and SGD with momentum: 1e-12 relative, as on threads.
"""

from __future__ import annotations

import time

import pytest
import torch

import shardwise as sw
from shardwise.collectives.backends.processes import launch_processes
from shardwise.testing.models import mlp

pytestmark = pytest.mark.gloo


def _problem():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 9, 7, 6, 5, 3], "tanh").double())  # 9 layers
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
                torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return step, params, batches


def _build(step: sw.Step, case: str) -> sw.Step:
    if case == "composed":
        return sw.shard_params(sw.pipeline(step, "pp", "1f1b", 4), "dp", 3)
    name, stages = {"1f1b": ("1f1b", None), "interleaved": ("interleaved_1f1b", 4), "zb_v": ("zb_v", None),
                    "zb_h1": ("zb_h1", None)}[case]
    return sw.pipeline(step, "pp", name, 4, stages=stages, poison=True)


def _mesh(case: str, world: int) -> sw.Mesh:
    return sw.Mesh(dp=2, pp=world // 2) if case == "composed" else sw.Mesh(pp=world)


def _run_rank(case: str, world: int) -> list:
    step, params, batches = _problem()
    piped = _build(step, case)
    return sw.testing.record_history(piped, piped.init(params, _mesh(case, world)), batches)


def _reference() -> list:
    step, params, batches = _problem()
    return sw.testing.record_history(step, step.init(params), batches)


CASES = [("1f1b", "gloo2"), ("interleaved", "gloo2"), ("zb_v", "gloo2"), ("zb_h1", "gloo4"), ("composed", "gloo4")]


@pytest.mark.parametrize("case,pool_name", CASES)
def test_pipeline_on_gloo_equals_single_device(case: str, pool_name: str, request: pytest.FixtureRequest) -> None:
    pool = request.getfixturevalue(pool_name)
    sw.testing.compare_histories(pool.run(_run_rank, case, int(pool_name[-1])), _reference(), rtol=1e-12)


def _all_four_rank(world: int) -> list:
    step, params, batches = _problem()
    composed = sw.mixed_precision(sw.remat(sw.pipeline(sw.shard_params(step, "dp", 3), "pp", "1f1b", 4)),
                                  "params=f64,compute=f64,output=f64,reduce=f64", loss_scale="dynamic")
    return sw.testing.record_history(composed, composed.init(params, sw.Mesh(dp=2, pp=world // 2)), batches)


def test_all_four_transforms_on_gloo_equal_single_device(gloo4: object) -> None:
    """mixed_precision(remat(pipeline(shard_params))) on dp=2 x pp=2 processes, in float64 (so the
    bound is 1e-12 as above), with dynamic loss scaling on: the scale must divide back out exactly
    (it is a power of two)."""
    step, params, batches = _problem()
    policy = "params=f64,compute=f64,output=f64,reduce=f64"
    reference = sw.mixed_precision(step, policy, loss_scale="dynamic")
    expected = sw.testing.record_history(reference, reference.init(params), batches)
    sw.testing.compare_histories(gloo4.run(_all_four_rank, 4), expected, rtol=1e-12)  # type: ignore[attr-defined]


def _loss_failing_on_call(fail_at: int):  # type: ignore[no-untyped-def]
    calls = [0]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == fail_at:
            raise ValueError(f"the loss broke on purpose at call {fail_at}")
        return torch.nn.functional.mse_loss(out, target)

    return loss


def _rank_whose_last_stage_fails(schedule: str) -> None:
    """Stage 1's loss raises in the middle of the second step, while rank 0 waits for its gradients."""
    step, params, batches = _problem()
    step = sw.train_step(step.chain, _loss_failing_on_call(fail_at=6), step.optimizer)  # step 2's 2nd micro-batch
    piped = sw.pipeline(step, "pp", schedule, 4, stages=4 if schedule == "interleaved_1f1b" else None)
    state = piped.init(params, sw.Mesh(pp=2))
    for batch in batches:
        state, _ = piped(state, batch)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_a_rank_failing_mid_step_ends_every_rank_with_its_error(schedule: str) -> None:
    """No hang: the failing rank's error is the one raised, long before the 60 s a receive may wait.
    The bound counts two processes' start (6 s alone here; 20 s beside the rest of the suite on two
    cores), so it sits between that and the receive's timeout, which a rank left waiting would reach."""
    start = time.monotonic()
    with pytest.raises(sw.collectives.RankFailed) as info:
        launch_processes(_rank_whose_last_stage_fails, 2, timeout=60.0, args=(schedule,))
    assert time.monotonic() - start < 40.0
    assert info.value.rank == 1
    assert "the loss broke on purpose at call 6" in str(info.value)


def _run_structured_rank() -> list:
    from .test_pipeline_step import _data_dependent_structured_problem

    step, params, batches = _data_dependent_structured_problem()
    piped = sw.pipeline(step, "pp", "gpipe", 1, partition=[2, 1])
    return sw.testing.record_history(piped, piped.init(params, sw.Mesh(pp=2)), batches)


def test_an_unpredicted_structured_output_crosses_processes(gloo2) -> None:  # type: ignore[no-untyped-def]
    """The header of an unpredicted transfer (its count and pickled structure) between real processes."""
    from .test_pipeline_step import _data_dependent_structured_problem

    step, params, batches = _data_dependent_structured_problem()
    reference = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories(gloo2.run(_run_structured_rank), reference, rtol=1e-12)
