"""One data-parallel replica simulated in place of all of them.

Ranks that differ only in their ``dp`` coordinate run the same actions at the same costs (the
Plan lowers them as one rank class, and :func:`~shardwise.plan_search.rank.plan_costs` prices
them alike), so every ``dp`` collective finds its whole group arriving at the same moment. The
simulation of the ranks with ``dp`` coordinate 0 alone, with each ``dp`` collective priced at
the real group's size and links, is then the whole simulation: the same makespan for
``dp x`` fewer ranks, and the simulator's work grows with the square of the ranks it walks
(512 ranks of ``dp 8 x pp 8 x tp 8`` are 64). ``dp`` is the mesh's outermost axis
(:data:`~shardwise.plan_search.candidate.AXES`), so those ranks are the first ``world / dp``.
Under shared cores (``PlanCosts.cores``) the replicas' rates interlock; there the search
simulates every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..collectives.mesh import Mesh
from ..engine.plan.actions import Plan
from ..engine.simulate.costs import CommModel


@dataclass(frozen=True)
class _AtSize(CommModel):
    """One level's figures, pricing every collective over ``size`` ranks (the real ``dp`` group's)."""

    size: int = 1

    def time(self, op: str, nbytes: int, n: int, ranks: Iterable[int] | None = None) -> float:
        return super().time(op, nbytes, self.size)


@dataclass(frozen=True)
class ReplicaComm(CommModel):
    """``real`` for the one replica's simulation: a group of one rank is its ``dp`` group, priced
    as the ``dp`` ranks ``rank + i x stride`` over ``real``'s links; any other group as ``real``
    prices it (the replica's ranks are the real ones of ``dp`` coordinate 0)."""

    real: CommModel | None = None
    dp: int = 1
    stride: int = 1

    def level(self, ranks: Iterable[int] | None) -> CommModel:
        assert self.real is not None
        group = tuple(ranks) if ranks is not None else None
        if group is not None and len(group) == 1:
            whole = [group[0] + i * self.stride for i in range(self.dp)]
            model = self.real.level(whole)
            return _AtSize(model.alpha, model.beta, size=self.dp)
        return self.real.level(group)


def one_replica(plan: Plan, dp: int) -> Plan:
    """``plan``'s ranks of ``dp`` coordinate 0, on its mesh with ``dp`` of size 1."""
    mesh = plan.mesh
    if "dp" not in mesh.axis_names or mesh.axis_names[0] != "dp" or mesh.axis_size("dp") != dp:
        raise ValueError(f"one_replica: {mesh!r} needs 'dp' of size {dp} as its outermost axis")
    shape = dict(mesh.shape)
    shape["dp"] = 1
    width = mesh.size // dp
    memory = {k: v[:width] for k, v in plan.memory.items()}
    return Plan(Mesh(**shape), plan.actions[:width], memory, plan.layers)


def replica_comm(comm: CommModel, dp: int, stride: int) -> ReplicaComm:
    """``comm`` for :func:`one_replica`'s Plan of a mesh whose ``dp`` groups step by ``stride`` ranks."""
    return ReplicaComm(comm.alpha, comm.beta, real=comm, dp=dp, stride=stride)
