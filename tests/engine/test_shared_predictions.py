"""A pipeline's stage boundaries are predicted once per process for what decides them (shared_predictions.py):
by the Plan, and not again by the step's thread ranks; again for another micro-batch shape."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.step import layouts


def _pipeline(width: int = 8) -> tuple[sw.Step, dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.Tanh())])
    chain, params = sw.functionalize(model)
    step = sw.pipeline(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "pp", "1f1b", microbatches=2)
    return step, params


@pytest.fixture
def predictions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fake runs of ``predict_boundaries`` made, by micro-batch rows."""
    made: list[int] = []
    predict = layouts.predict_boundaries

    def counted(chain: Any, placement: Any, shapes: Any, dtype_of: Any, inputs: Any, **kwargs: Any) -> Any:
        made.append(int(inputs.shape[0]))  # (the micro-batch's inputs: one tensor here)
        return predict(chain, placement, shapes, dtype_of, inputs, **kwargs)

    monkeypatch.setattr(layouts, "predict_boundaries", counted)
    return made


def test_the_plan_predicts_once_and_the_thread_ranks_reuse_it(predictions: list[int]) -> None:
    step, params = _pipeline()
    mesh = sw.Mesh(pp=2)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    plan = step.plan(mesh, params, batch)
    assert predictions == [2], predictions  # two rank classes (the stages), one prediction of 2-row micro-batches

    def rank() -> float:
        _, metrics = step(step.init(params, mesh), batch)
        return float(metrics["loss"])

    losses = sw.launch(rank, 2)
    assert predictions == [2], predictions  # neither rank predicted again
    assert len(set(losses)) == 1 and len(plan.actions) == 2
    longer = (torch.randn(6, 8), torch.randn(6, 8))
    sw.launch(lambda: step(step.init(params, mesh), longer), 2)
    assert predictions == [2, 3], predictions  # 3-row micro-batches: predicted once more, for both ranks


def test_each_rank_still_gets_its_stages_right_from_the_shared_prediction() -> None:
    step, params = _pipeline()
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(2)]
    reference = sw.train_step(step.chain, F.mse_loss, sw.optim.sgd(0.1))
    sw.testing.assert_equivalent(step, reference, sw.Mesh(pp=2), batches, params, rtol=1e-6)


def test_the_rank_classes_of_one_plan_predict_a_like_update_once_and_plan_what_each_predicts_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two tensor-parallel ranks are two rank classes whose shards have one shape: one plan predicts
    their optimizer's update on fake tensors once (``plan_of`` shares its fake runs, as a plan search
    shares them across its plans), and plans what predicting it for each class gives."""
    from shardwise.engine.model import reuse
    from shardwise.engine.step import held_levels
    from shardwise.engine.step.planning import plan_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    chain, params = sw.functionalize(model)
    step = sw.tensor_parallel(sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-3)), "tp",
                              {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()})
    mesh, batch = sw.Mesh(tp=2), (torch.randn(4, 8), torch.randn(4, 8))
    updates: list[int] = []
    predict = held_levels.predict_update_held

    def counted(*args: Any, **kwargs: Any) -> Any:
        updates.append(1)
        return predict(*args, **kwargs)

    monkeypatch.setattr(held_levels, "predict_update_held", counted)
    shared = step.plan(mesh, params, batch)
    assert len(updates) == 1, updates
    updates.clear()
    monkeypatch.setattr(reuse, "results_for", lambda purpose: {})  # every class predicts its own
    alone = step.plan(mesh, params, batch)
    assert len(updates) == 2, updates
    assert shared.actions == alone.actions and dict(shared.memory) == dict(alone.memory)
    assert shared.memory["update_buffers"][0] > 0  # AdamW's new state and temporaries, counted
    monkeypatch.undo()
    monkeypatch.setattr(held_levels, "predict_update_held", counted)
    updates.clear()
    reference = plan_of(step, mesh, params, batch, share_identical_ranks=False)  # each rank on its own
    assert len(updates) == 2, updates
    assert reference.actions == shared.actions and dict(reference.memory) == dict(shared.memory)
