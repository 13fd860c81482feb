"""Drawings of a ``Timeline``: ASCII for terminals and docstrings, a Gantt chart, a Chrome trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .schedule import B, F, I, W
from .simulate import Timeline

_COLORS = {F: "#4c9be8", B: "#e8734c", I: "#f2b134", W: "#6cc26c"}


def ascii_timeline(timeline: Timeline, width: int | None = None) -> str:
    """One row per rank; each action is its label drawn over its duration, idle time is '.'.

    By default the scale gives the shortest action room for its label and a
    space, so every action shows. With ``width`` (characters for the time
    axis) labels that do not fit are cut, and an action shorter than one
    character may vanish.
    """
    makespan = timeline.makespan
    durations = [s.end - s.start for row in timeline.ranks for s in row if s.end > s.start]
    labels = [len(str(s.op)) for row in timeline.ranks for s in row]
    if width is not None:
        if width < 1:
            raise ValueError(f"ascii_timeline: width must be >= 1, got {width}")
        scale = width / makespan if makespan else 1.0
    elif durations:
        scale = (max(labels) + 1) / min(durations)
    else:
        scale = 1.0
    columns = math.ceil(makespan * scale - 1e-9) if makespan else 0
    header = f"{timeline.schedule.name}: makespan {makespan:g}, bubble {timeline.bubble_fraction:.1%}"
    lines = [header]
    for rank, row in enumerate(timeline.ranks):
        cells = ["."] * columns
        for slot in row:
            first, last = round(slot.start * scale), round(slot.end * scale)
            room = last - first - (1 if width is not None else 0)
            cells[first:last] = list(str(slot.op)[: max(0, room)].ljust(last - first)[: last - first])
        lines.append(f"rank {rank} |{''.join(cells)}|")
    return "\n".join(lines)


def gantt(timeline: Timeline, path: str | Path) -> Path:
    """Write a Gantt chart to ``path`` (.png or .svg, by extension) with matplotlib."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"gantt writes .png or .svg files, got {path.name!r}")
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "gantt needs matplotlib: pip install 'shardwise[plot]' (or pip install matplotlib)"
        ) from err
    num_ranks = len(timeline.ranks)
    makespan = timeline.makespan or 1
    fig = Figure(figsize=(max(6.0, min(40.0, 0.25 * makespan + 2)), 0.6 * num_ranks + 1.2))
    ax: Any = fig.add_subplot()
    for rank, row in enumerate(timeline.ranks):
        for slot in row:
            duration = slot.end - slot.start
            ax.broken_barh(
                [(slot.start, duration)], (rank - 0.4, 0.8), facecolors=_COLORS[slot.op.kind], edgecolor="black", linewidth=0.5
            )
            if duration >= makespan / 60:
                ax.text(slot.start + duration / 2, rank, str(slot.op), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time")
    ax.set_title(f"{timeline.schedule.name}: bubble {timeline.bubble_fraction:.1%}")
    kinds = sorted({slot.op.kind for row in timeline.ranks for slot in row}, key=[F, B, I, W].index)
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in kinds], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format=path.suffix.lower()[1:])
    return path


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Write ``timeline.to_chrome_trace()`` as JSON; open it in Perfetto or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(timeline.to_chrome_trace(), indent=1))
    return path
