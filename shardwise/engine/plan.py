"""The Plan: one list of actions per rank, the unit of truth of a step.

``step.plan(mesh)`` returns it; the executor runs it; later the simulator and
the drawings read it. Actions are small frozen values with a short text form
(``F(blocks.0)``, ``B(head)``, ``update``) so a Plan prints readably and two
plans compare with ``==``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..collectives.mesh import Mesh

# Action kinds. Transforms add kinds of their own (gather, free, send, ...);
# the executor refuses a kind it does not know rather than skipping it.
FORWARD = "forward"
LOSS = "loss"
BACKWARD = "backward"
UPDATE = "update"

_SHORT = {FORWARD: "F", BACKWARD: "B"}


@dataclass(frozen=True)
class Action:
    """One thing a rank does: ``kind`` on ``layer`` (for ``microbatch``), with optional ``args``."""

    kind: str
    layer: str | None = None
    microbatch: int | None = None
    args: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        head = _SHORT.get(self.kind, self.kind)
        inner = [] if self.layer is None else [self.layer]
        if self.microbatch is not None:
            inner.append(f"mb={self.microbatch}")
        inner += [f"{k}={v}" for k, v in self.args]
        return f"{head}({', '.join(inner)})" if inner else head


@dataclass(frozen=True)
class Plan:
    """Per-rank action lists for one training step on ``mesh``, plus accounting figures.

    ``memory`` holds per-rank byte counts when the plan was made with the
    parameters (``step.plan(mesh, params)``): keys such as ``params``,
    ``grads``, ``opt_state``, each a tuple with one entry per rank.
    """

    mesh: Mesh
    actions: tuple[tuple[Action, ...], ...]
    memory: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.actions) != self.mesh.size:
            raise ValueError(
                f"Plan has {len(self.actions)} action lists but {self.mesh!r} has {self.mesh.size} ranks"
            )

    def for_rank(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def count(self, kind: str, rank: int | None = None) -> int:
        """How many actions of ``kind`` one rank (or all ranks together) performs."""
        ranks: Sequence[int] = range(self.mesh.size) if rank is None else [rank]
        return sum(1 for r in ranks for a in self.actions[r] if a.kind == kind)

    def __str__(self) -> str:
        lines = [f"Plan on {self.mesh!r}: {self.mesh.size} rank(s)"]
        for rank, actions in enumerate(self.actions):
            coords = ", ".join(f"{k}={v}" for k, v in self.mesh.coords_of(rank).items())
            body = " ".join(str(a) for a in actions)
            lines.append(f"rank {rank} ({coords}): {len(actions)} actions")
            lines.extend(textwrap.wrap(body, width=96, initial_indent="  ", subsequent_indent="  "))
        for key, per_rank in self.memory.items():
            lines.append(f"{key} bytes per rank: {list(per_rank)}")
        return "\n".join(lines)
