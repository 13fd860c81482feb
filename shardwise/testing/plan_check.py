"""The Plan against a run: every rank issues, in order, exactly the collectives its Plan lists.

A step's Plan says before a run what each rank will send (op, axis, dtype, bytes); one step on thread
ranks under the communication ledger records what each did send. :func:`assert_plan_is_run` holds the
two to each other; :func:`measure` and :func:`ranks_off_plan` are its parts (the ``shardwise plan
--measure`` command prints them).
"""

from __future__ import annotations

from typing import Any

from ..collectives.launch import launch
from ..collectives.ledger import CommRecord, Ledger, comm_ledger
from ..collectives.mesh import Mesh
from ..engine.plan.actions import Plan


class PlanNotRunError(AssertionError):
    """A rank issued other collectives than its Plan lists."""


def measure(step: Any, params: Any, batch: Any, mesh: Mesh, timeout: float = 120.0) -> Ledger:
    """Run one step on ``mesh`` (ranks as threads) under the communication ledger: the step's
    collectives only, not those of ``init`` (its agreement checks are not the step's)."""

    def program() -> tuple[CommRecord, ...]:
        state = step.init(params, mesh)
        with comm_ledger() as mine:
            step(state, batch)
        return mine.records

    ledger = Ledger()
    for records in launch(program, mesh.size, timeout=timeout):
        for record in records:
            ledger.add(record)
    return ledger


def _sent(records: Any) -> list[tuple[str, str, str, int]]:
    return [(r.op, r.axis, str(r.dtype), r.nbytes) for r in records]


def ranks_off_plan(plan: Plan, ledger: Ledger) -> list[int]:
    """The ranks whose recorded collectives are not, in order, the ones their Plan lists."""
    return [
        rank for rank in range(plan.mesh.size)
        if _sent(r for r in ledger.records if r.rank == rank) != _sent(plan.collectives(rank))
    ]


def assert_plan_is_run(step: Any, mesh: Mesh, params: Any, batch: Any, *, timeout: float = 120.0) -> Plan:
    """The Plan of ``step`` on ``mesh`` for ``batch``, after checking that one step on thread ranks issues
    on every rank, in order, exactly the collectives (op, axis, dtype, bytes) the Plan lists for it;
    :class:`PlanNotRunError` names the first rank that did not and where its lists part.

    >>> import torch, shardwise as sw
    >>> from shardwise.testing.models import mlp
    >>> chain, params = sw.functionalize(mlp([4, 8, 2]))
    >>> step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", 3)
    >>> plan = sw.testing.assert_plan_is_run(step, sw.Mesh(dp=2), params, (torch.randn(4, 4), torch.randn(4, 2)))
    >>> sorted({c.op for c in plan.collectives(0)})
    ['all_gather', 'psum', 'psum_scatter']
    """
    plan = step.plan(mesh, params, batch)
    ledger = measure(step, params, batch, mesh, timeout)
    for rank in ranks_off_plan(plan, ledger):
        got, want = _sent(r for r in ledger.records if r.rank == rank), _sent(plan.collectives(rank))
        at = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
        raise PlanNotRunError(
            f"rank {rank} issued {len(got)} collectives and its Plan lists {len(want)}; they part at #{at}: "
            f"issued {got[at] if at < len(got) else 'nothing'}, listed {want[at] if at < len(want) else 'nothing'}"
            f"\nissued: {got}\nlisted: {want}"
        )
    return plan
