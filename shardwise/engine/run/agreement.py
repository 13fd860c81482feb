"""Every rank builds the same step: checked once, at ``init``, before anything can diverge.

SPMD programs compute the step on every rank from the same code, but a rank
can still end up with another one (a flag read differently, an environment
variable, a schedule file that differs on one host). The ranks would then run
different Plans and hang, or train on silently wrong. So ``Step.init`` gathers
a fingerprint of what the rank built (the transform stack, the schedule, the
mesh, the parameters' names, shapes and dtypes) from every rank and refuses a
mismatch, naming the ranks that differ from rank 0 and what differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...collectives import all_gather
from ...collectives.mesh import Mesh


def fingerprint(parts: Mapping[str, str]) -> tuple[int, ...]:
    """One 52-bit digest per part (exact in float64, so it can travel in a collective)."""
    return tuple(int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "big") >> 4 for text in parts.values())


def check_ranks_agree(mesh: Mesh, parts: Mapping[str, str], device: torch.device) -> None:
    """Gather every rank's fingerprint of ``parts`` (an all-gather per mesh axis) and refuse a
    mismatch on every rank alike, naming the ranks and the parts that differ."""
    if mesh.size == 1:
        return
    mine = torch.tensor(fingerprint(parts), dtype=torch.float64, device=device)
    gathered = mine[None]
    for axis in reversed(mesh.axis_names):  # row-major: the last axis varies fastest
        gathered = all_gather(gathered, axis, tiled=True, mesh=mesh)
    rows: Sequence[Any] = gathered.tolist()
    names = list(parts)
    differing = {
        rank: [names[i] for i, (a, b) in enumerate(zip(row, rows[0], strict=True)) if a != b]
        for rank, row in enumerate(rows)
        if row != rows[0]
    }
    if differing:
        detail = "; ".join(f"rank {rank} differs from rank 0 in its {', '.join(what)}" for rank, what in differing.items())
        raise ValueError(
            f"the ranks built different steps: {detail}. Every rank must build the same step, schedule, "
            "mesh, parameters and seed: build them from the same code and inputs on every rank"
        )
