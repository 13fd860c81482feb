"""A Plan and what reads it: its actions, the simulation's timeline and costs, and the simulator's errors.

``step.plan(mesh, params, batch)`` returns a ``Plan``: every rank's typed ``Action``\\ s in order,
the bytes each rank holds and sends. ``sw.simulate(plan, costs)`` runs it on paper into a
``PlanTimeline``; ``PlanCosts`` (what computes cost) and ``CommModel`` (latency + bandwidth per
op) are fitted from traced runs (``step.with_trace()``, ``measured_transfers``). A Plan whose
ranks would wait for each other forever raises ``PlanDeadlock``; one a run disagrees with,
``PlanMismatch``.

>>> import torch, shardwise as sw
>>> chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
>>> step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)
>>> plan = step.plan(sw.Mesh(dp=2), params, (torch.randn(4, 4), torch.randn(4, 2)))
>>> isinstance(plan, sw.plan.Plan), plan.count("gather", rank=0)   # for forward and backward, the last kept
(True, 3)
>>> type(sw.simulate(plan)) is sw.plan.PlanTimeline
True
"""

from .engine.plan.actions import Action, Plan
from .transforms.pipeline import (
    CommModel,
    PlanCosts,
    PlanDeadlock,
    PlanMismatch,
    PlanTimeline,
    measured_transfers,
)

# A traceback names an exception by its module: the public one, not where it happens to live.
PlanDeadlock.__module__ = PlanMismatch.__module__ = __name__

__all__ = [
    "Action",
    "CommModel",
    "Plan",
    "PlanCosts",
    "PlanDeadlock",
    "PlanMismatch",
    "PlanTimeline",
    "measured_transfers",
]
