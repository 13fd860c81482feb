"""A Plan's text form: every rank's actions, ranks with the same actions folded, lines never cut in an action.

Hundreds of data-parallel ranks run the same actions: they print once, as
``ranks 0-3 (pp=0): 19 actions``, with the mesh coordinates they share. A rank
that differs from an earlier one in a few actions only (a peer, an axis) prints as
that rank "but" those actions. Lines wrap between actions, never inside one
(``send_activation(stage0, mb=1, to=1)`` has spaces of its own).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ...collectives.mesh import Mesh

if TYPE_CHECKING:
    from .actions import Plan

WIDTH = 96
INDENT = "  "
FIGURES_AS_A_LIST = 8  # up to this many ranks, a figure per rank prints as a plain list
MOST_DIFFERENCES = 3  # up to this many differing actions, a rank prints as another "but ..."
LONGEST_RANK_LIST = 40  # characters; a longer list of ranks is named by the coordinates they share


def plan_text(plan: Plan) -> str:
    mesh = plan.mesh
    lines = [f"Plan on {mesh!r}: {mesh.size} rank{'s' if mesh.size != 1 else ''}"]
    texts = [tuple(str(a) for a in actions) for actions in plan.actions]
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, text in enumerate(texts):
        groups.setdefault(text, []).append(rank)
    shown: list[int] = []  # the first rank of each group printed in full
    for text, ranks in groups.items():
        head = group_head(mesh, ranks)
        like = next((r for r in shown if len(texts[r]) == len(text)
                     and sum(a != b for a, b in zip(texts[r], text, strict=True)) <= MOST_DIFFERENCES), None)
        if like is None:
            shown.append(ranks[0])
            lines.append(f"{head}: {len(text)} actions")
            lines.extend(wrap(text))
        else:
            changes = [f"action {i} is {b} (not {a})" for i, (a, b) in enumerate(zip(texts[like], text, strict=True))
                       if a != b]
            lines.append(f"{head}: same as rank {like} but {'; '.join(changes)}")
    if any(_waits_before_gathers([a.kind for a in actions]) for actions in plan.actions):
        lines.append("wait_params before gather_params: the previous step's, in flight (overlap_gather)")
    for layer, notes in plan.layers.items():
        lines.append(f"layer {layer}: {'; '.join(notes)}")
    for key, per_rank in plan.memory.items():  # a figure per rank: which ranks hold what, folded
        lines.append(f"{key} bytes per rank: {per_rank_figures(per_rank)}")
    for (axis, op), per_rank in plan.comm_bytes().items():
        if any(per_rank):
            lines.append(f"{op} over {axis!r} bytes per rank: {per_rank_figures(per_rank)}")
    return "\n".join(lines)


def _waits_before_gathers(kinds: Sequence[str]) -> bool:
    """Whether a rank's first ``wait_params`` comes before its first ``gather_params``."""
    return "wait_params" in kinds and kinds.index("wait_params") < (
        kinds.index("gather_params") if "gather_params" in kinds else len(kinds))


def wrap(tokens: Sequence[str], width: int = WIDTH, indent: str = INDENT) -> list[str]:
    """``tokens`` joined by spaces into lines of at most ``width`` characters, each token whole
    (one longer than a line gets a line of its own)."""
    lines: list[str] = []
    line = ""
    for token in tokens:
        if line and len(indent) + len(line) + 1 + len(token) > width:
            lines.append(indent + line)
            line = token
        else:
            line = f"{line} {token}" if line else token
    if line:
        lines.append(indent + line)
    return lines


def group_head(mesh: Mesh, ranks: Sequence[int]) -> str:
    """``ranks 1, 3, ..., 15 (pp=1)``: the ranks and the coordinates they share; where the list
    would be long and the coordinates say which ranks they are, ``the 256 ranks with pp=1``."""
    coords = shared_coords(mesh, ranks)
    listed = rank_list(ranks)
    if len(listed) > LONGEST_RANK_LIST and coords:
        axes = dict(pair.split("=") for pair in coords.split(", "))
        holders = [r for r in range(mesh.size) if all(str(mesh.coords_of(r)[a]) == v for a, v in axes.items())]
        if holders == list(ranks):
            return f"the {len(ranks)} ranks with {coords}"
    return listed + (f" ({coords})" if coords else "")


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0, 2, 5-7``: runs of consecutive ranks as ranges, and
    ranks at a constant stride as ``ranks 1, 3, ..., 15``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    steps = {b - a for a, b in itertools.pairwise(ranks)}
    if len(ranks) > 3 and len(steps) == 1 and steps != {1}:
        return f"ranks {ranks[0]}, {ranks[1]}, ..., {ranks[-1]}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


def shared_coords(mesh: Mesh, ranks: Sequence[int]) -> str:
    """The mesh coordinates every rank of ``ranks`` has (``pp=0``); empty when they share none, or
    for the one rank of a world-1 mesh."""
    if mesh.size == 1:
        return ""
    coords: list[Mapping[str, int]] = [mesh.coords_of(r) for r in ranks]
    return ", ".join(f"{axis}={value}" for axis, value in coords[0].items() if all(c[axis] == value for c in coords))


def per_rank_figures(per_rank: Sequence[int]) -> str:
    """``448 on each of 4 ranks`` when they are all the same; ``[448, 976, 448, 976]`` on a few
    ranks; on many, each figure with its ranks: ``448 (ranks 0-255), 976 (ranks 256-511)``."""
    if len(per_rank) > 1 and len(set(per_rank)) == 1:
        return f"{per_rank[0]} on each of {len(per_rank)} ranks"
    if len(per_rank) <= FIGURES_AS_A_LIST:
        return str(list(per_rank))
    holders: dict[int, list[int]] = {}
    for rank, figure in enumerate(per_rank):
        holders.setdefault(figure, []).append(rank)
    return ", ".join(f"{figure} ({rank_list(ranks)})" for figure, ranks in holders.items())
