"""Which ranks hold each of the optimizer's other tensors (those not shaped like the parameters).

A step count is held by every rank alike, but a per-parameter one (torch.optim's ``state[p]["step"]``
kept as ``step.<param>``), or a factored moment, only by the pipeline stage that holds its parameter:
a save writes each from the lowest rank holding it, and a load checks that the ranks together want
every tensor the checkpoint has.
"""

from __future__ import annotations

import torch

from ...collectives.mesh import Mesh
from ..run.agreement import gather_texts


def every_ranks_names(mesh: Mesh | None, names: list[str], device: torch.device) -> list[set[str]]:
    """Each rank's ``names``, by rank (a collective: every rank calls it)."""
    if mesh is None:
        return [set(names)]
    # gather_texts gathers as many texts from each rank: pad each rank's to the most any has
    count = max(int(ts[0]) for ts in gather_texts(mesh, [str(len(names))], device))
    if count == 0:
        return [set() for _ in range(mesh.size)]
    texts = gather_texts(mesh, sorted(names) + [""] * (count - len(names)), device)
    return [{t for t in ts if t} for ts in texts]
