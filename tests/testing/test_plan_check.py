"""``assert_plan_is_run``: a run that sends other bytes than its Plan (the verify review: a check of each
collective's op alone passed every test; a run gathering float64 where the Plan lists float32 was certified)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.collectives.ledger import Ledger
from shardwise.testing import plan_check
from shardwise.testing.models import mlp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _zero3() -> tuple[Any, Any, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 2]))
    step = sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "dp", 3)
    return step, params, (torch.randn(4, 4), torch.randn(4, 2))


def test_a_run_as_planned_is_certified() -> None:
    step, params, batch = _zero3()
    sw.testing.assert_plan_is_run(step, sw.Mesh(dp=2), params, batch)


@pytest.mark.parametrize("change", ["dtype and bytes", "axis", "one more"])
def test_a_run_whose_collective_differs_from_the_plan_is_refused(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    step, params, batch = _zero3()
    measured = plan_check.measure

    def off(*args: Any, **kwargs: Any) -> Ledger:
        ledger, out, done = measured(*args, **kwargs), Ledger(), False
        for r in ledger.records:
            if not done and r.rank == 0 and r.op == "all_gather":
                done = True
                if change == "dtype and bytes":
                    r = dataclasses.replace(r, dtype="torch.float64", nbytes=2 * r.nbytes, sent_bytes=2 * r.sent_bytes)
                elif change == "axis":
                    r = dataclasses.replace(r, axis="tp")
                else:
                    out.add(r)
            out.add(r)
        assert done
        return out

    monkeypatch.setattr(plan_check, "measure", off)
    with pytest.raises(sw.testing.PlanNotRunError):
        sw.testing.assert_plan_is_run(step, sw.Mesh(dp=2), params, batch)
