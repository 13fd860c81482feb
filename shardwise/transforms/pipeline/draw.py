"""Drawings of a timeline: ASCII for terminals and docstrings, a Gantt chart, a Chrome trace.

Each takes either kind of timeline: a schedule's ``Timeline`` or a Plan's
``PlanTimeline`` (simulated or measured). What they read of one: ``name``,
``makespan``, ``bubble_fraction``, ``ranks`` (rows of slots with ``start``,
``end``, ``label``, ``kind``, ``compute`` and ``waiting``), ``transfers`` (per
rank, what was in flight: collectives and messages; empty for a schedule) and
``to_chrome_trace()``; an ``ascii_width`` attribute sets the ASCII default width.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...engine.plan import actions as kinds
from ...engine.plan.text import wrap
from ...engine.simulate.timeline import SHORT_LABELS, PlanTimeline
from .schedule import B, F, I, W
from .simulate import Timeline

AnyTimeline = Timeline | PlanTimeline
_COMPUTE_COLORS = {F: "#4c9be8", B: "#e8734c", I: "#f2b134", W: "#6cc26c"}
_COLORS = {
    **_COMPUTE_COLORS,
    kinds.FORWARD: _COMPUTE_COLORS[F], kinds.BACKWARD: _COMPUTE_COLORS[B],
    kinds.BACKWARD_INPUT: _COMPUTE_COLORS[I], kinds.BACKWARD_WEIGHT: _COMPUTE_COLORS[W],
    kinds.LOSS: "#b07cd8", kinds.UPDATE: "#8c6d31",
    kinds.GATHER: "#17becf", kinds.GATHER_PARAMS: "#17becf", kinds.REDUCE_SCATTER: "#d62728",
    kinds.REDUCE_REPLICAS: "#ff9896",
    kinds.REDUCE_METRICS: "#9467bd", kinds.SEND_ACTIVATION: "#7f7f7f", kinds.SEND_GRAD: "#7f7f7f",
    kinds.SEND_TIED: "#7f7f7f",
}
_WAIT_COLOR, _OTHER_COLOR = "#dddddd", "#555555"
# The letter that marks a transfer in flight in the ASCII drawing's row under each rank.
_IN_FLIGHT = {kinds.GATHER: "g", kinds.GATHER_PARAMS: "p", kinds.REDUCE_SCATTER: "r", kinds.REDUCE_METRICS: "m",
              kinds.REDUCE_REPLICAS: "a", kinds.INSIDE: "i", kinds.CHECK_REPLICAS: "c"}


def _color(slot: Any) -> str:
    return _COLORS.get(slot.kind, _WAIT_COLOR if slot.waiting else _OTHER_COLOR)


def ascii_timeline(timeline: AnyTimeline, width: int | None = None, legend: bool = True) -> str:
    """One row per rank; each action is its label drawn over its duration, idle time is '.'.

    A wait (a receive, a wait for a collective) is drawn with '~'. By default the
    scale gives the shortest compute room for its label and a space, so every
    compute shows (a Plan's timeline defaults to its ``ascii_width`` instead).
    With ``width`` (characters for the time axis) labels that do not fit are
    cut, and an action shorter than one character may vanish. Under each rank of
    a simulated Plan, a row shows what it has in flight: ``g`` gathers, ``r``
    reduce-scatters, ``p`` parameter gathers, ``m`` metric all-reduces, ``i``
    collectives inside a layer, ``c`` replica checks, ``s`` messages sent. A legend under the drawing
    says what each glyph on it means (``legend=False`` leaves it out).
    """
    width = getattr(timeline, "ascii_width", None) if width is None else width
    makespan = timeline.makespan
    rows: Sequence[Sequence[Any]] = timeline.ranks
    computes = [s for row in rows for s in row if s.compute]
    durations = [s.end - s.start for s in computes if s.end > s.start]
    if width is not None:
        if width < 1:
            raise ValueError(f"ascii_timeline: width must be >= 1, got {width}")
        scale = width / makespan if makespan else 1.0
    elif durations:
        scale = (max(len(s.label) for s in computes) + 1) / min(durations)
    else:
        scale = 1.0
    columns = math.ceil(makespan * scale - 1e-9) if makespan else 0
    lines = [f"{timeline.name}: makespan {makespan:g}, bubble {timeline.bubble_fraction:.1%}"]
    cut = width is not None
    for rank, row in enumerate(rows):
        lines.append(f"rank {rank} |{_cells(row, columns, scale, cut)}|")
        if timeline.transfers and timeline.transfers[rank]:
            flight = ["."] * columns
            for t in timeline.transfers[rank]:
                first, last = round(t.start * scale), max(round(t.end * scale), round(t.start * scale) + 1)
                flight[first:last] = _IN_FLIGHT.get(t.kind, "s") * (min(last, columns) - first)
            lines.append(f"{'':>6} |{''.join(flight[:columns])}|")
    if legend:
        lines.extend(legend_lines(timeline))
    return "\n".join(lines)


# What a compute's letter means, and the words for what is in flight under a rank.
_COMPUTE_WORDS = {F: "F forward", B: "B backward", I: "I backward's input half", W: "W its weight half"}
_COMPUTE_LETTER = {kinds.FORWARD: F, kinds.BACKWARD: B, kinds.BACKWARD_INPUT: I, kinds.BACKWARD_WEIGHT: W}
_IN_FLIGHT_WORDS = {"g": "g gather", "p": "p parameter gather", "r": "r reduce-scatter",
                    "a": "a replicas' all-reduce", "m": "m metrics' all-reduce", "i": "i a collective inside a layer",
                    "c": "c replica check", "s": "s message sent"}


def legend_lines(timeline: AnyTimeline, width: int = 100) -> list[str]:
    """``legend: 0F1 = stage 0's forward of micro-batch 1 (B backward, ...); G gather, ...; '.' idle``:
    what each glyph of the drawing means, only those it shows, wrapped between entries."""
    slots = [slot for row in timeline.ranks for slot in row]
    letters = {_COMPUTE_LETTER.get(slot.kind, slot.kind) for slot in slots if slot.compute}
    entries = []
    if letters & set(_COMPUTE_WORDS):
        words = ", ".join(_COMPUTE_WORDS[letter] for letter in (F, B, I, W) if letter in letters)
        entries.append(f"0F1 = stage 0, micro-batch 1 ({words})")
    shorts = {slot.kind: SHORT_LABELS[slot.kind] for slot in slots if not slot.compute and slot.kind in SHORT_LABELS}
    entries += [f"{short} {kind}" for kind, short in sorted(shorts.items(), key=lambda item: item[1].lower())]
    inside = sorted({str(slot.label) for slot in slots if slot.kind == kinds.INSIDE})  # the op (short_label)
    if inside:
        entries.append(f"{', '.join(inside)} a collective inside a layer")
    if any(slot.waiting for slot in slots):
        entries.append("~ waiting")
    entries.append(". idle")
    flying = {_IN_FLIGHT.get(t.kind, "s") for row in (timeline.transfers or ()) for t in row}
    if flying:
        entries.append("under a rank, in flight: " + ", ".join(_IN_FLIGHT_WORDS[c] for c in "gpramics" if c in flying))
    lines = wrap([f"{entry};" for entry in entries[:-1]] + entries[-1:], width=width - len("legend: "), indent="")
    return ["legend: " + lines[0], *(" " * len("legend: ") + line for line in lines[1:])]


def _cells(row: Sequence[Any], columns: int, scale: float, cut: bool) -> str:
    cells = ["."] * columns
    for slot in row:
        first, last = round(slot.start * scale), round(slot.end * scale)
        room = last - first - (1 if cut and slot.compute else 0)
        pad = "~" if slot.waiting else " "
        cells[first:last] = list(slot.label[: max(0, room)].ljust(last - first, pad)[: last - first])
    return "".join(cells)


def gantt(timeline: AnyTimeline, path: str | Path) -> Path:
    """Write a Gantt chart to ``path`` (.png or .svg, by extension) with matplotlib.

    Computes are coloured by kind, waits grey; a Plan's transfers in flight are thin
    bars under each rank's row, coloured by what they move.
    """
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
    shown: dict[str, str] = {}
    rows: Sequence[Sequence[Any]] = timeline.ranks
    for rank, row in enumerate(rows):
        for slot in row:
            duration = slot.end - slot.start
            if duration <= 0:
                continue  # an action that takes no time (a free, an issue at zero cost) shows nowhere
            color = _color(slot)
            shown.setdefault("wait" if slot.waiting else slot.kind, color)
            ax.broken_barh(
                [(slot.start, duration)], (rank - 0.4, 0.6 if timeline.transfers else 0.8), facecolors=color,
                edgecolor="black", linewidth=0.5,
            )
            if slot.compute and duration >= makespan / 60:
                ax.text(slot.start + duration / 2, rank - 0.1 if timeline.transfers else rank, slot.label,
                        ha="center", va="center", fontsize=6)
        for t in timeline.transfers[rank] if timeline.transfers else ():
            shown.setdefault(t.kind, _COLORS.get(t.kind, _OTHER_COLOR))
            ax.broken_barh([(t.start, max(t.end - t.start, makespan / 500))], (rank + 0.25, 0.15),
                           facecolors=_COLORS.get(t.kind, _OTHER_COLOR), linewidth=0)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time")
    ax.set_title(f"{timeline.name}: bubble {timeline.bubble_fraction:.1%}")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in shown.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format=path.suffix.lower()[1:])
    return path


def write_chrome_trace(timeline: AnyTimeline, path: str | Path) -> Path:
    """Write ``timeline.to_chrome_trace()`` as JSON; open it in Perfetto or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(timeline.to_chrome_trace(), indent=1))
    return path
