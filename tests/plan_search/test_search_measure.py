"""The search's default costs, measured on one device: a step that cannot run the small share
(BatchNorm in training at one sample) is measured at more samples, and says so; one that cannot
run the batch at all is refused at the stage ``measure``, not blamed on each layout's plan.

The search measured its small point at ``1 / (world x largest micro-batch count)`` of the batch
(one sample of eight here), where BatchNorm raises; every layout was refused "by plan" with that
error, the one valid layout (a pipeline with one micro-batch, the guide's advice for BatchNorm)
among them, and the answer said no layout fits the memory though none was refused for memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.plan_search import Space
from shardwise.plan_search.rank import MEASURE

SPACE = Space(zero_stages=(1,), schedules=("gpipe",), microbatches=(1, 4), remat=(None,))


def _batch_norm_step() -> tuple[sw.Step, Any, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, track_running_stats=False),
                                torch.nn.ReLU(), torch.nn.Linear(8, 2)).double()
    chain, params = sw.functionalize(model)
    batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params, batch


def test_a_batch_norm_model_gets_its_valid_pipeline_layout_from_measured_costs() -> None:
    step, params, batch = _batch_norm_step()
    found = sw.search(step, params, batch, world=2, memory_per_rank="1MiB", space=SPACE)
    assert [str(p.candidate) for p in found.ranked] == ["pp2 gpipe mb1"], found.table()
    assert "the small point measured at 2 samples: at 1 samples the step raised ValueError" in found.compute_source
    sw.testing.assert_equivalent(found.best.candidate.apply(step), step, found.best.mesh, [batch], params)


class _RefusesRealData(torch.nn.Module):
    """Runs on fake tensors and zero stand-ins (what planning uses), raises on a real batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x != 0).any()):
            raise ValueError("this layer refuses real data")
        return x


def test_a_step_that_cannot_be_measured_is_refused_at_measure_and_the_answer_says_so() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4), _RefusesRealData(),
                                                         torch.nn.Linear(4, 2)))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    found = sw.search(step, params, (torch.randn(8, 4), torch.randn(8, 2)), world=2, memory_per_rank="1MiB",
                      space=SPACE)
    stages = {r.stage for r in found.refused}
    assert found.ranked == () and MEASURE in stages and "memory" not in stages, found.table()
    measured = next(r.reason for r in found.refused if r.stage == MEASURE)
    assert "raised on the whole batch while being measured (ValueError: this layer refuses real data)" in measured
    assert "pass compute=FlopCompute" in measured
    assert found.why_none().startswith("no layout of 2 ranks could be priced, none for want of memory")
