"""Drawings: ASCII timeline, Gantt chart (PNG/SVG with matplotlib), Chrome trace file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.transforms.pipeline import (
    SCHEDULES,
    ascii_timeline,
    gantt,
    one_f_one_b,
    simulate,
    write_chrome_trace,
    zb_h1,
)


@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(1, 4), m=st.integers(1, 5))
def test_ascii_shows_every_op(name: str, p: int, m: int) -> None:
    stages = 2 * p if name == "zb_v" else p
    schedule = SCHEDULES[name](p, stages, p * m if name == "interleaved_1f1b" else m)
    timeline = simulate(schedule)
    text = ascii_timeline(timeline, legend=False)
    lines = text.splitlines()
    assert lines[0].startswith(f"{schedule.name}: makespan {timeline.makespan:g}, bubble")
    rows = lines[1:]
    assert len(rows) == p
    for rank, row in enumerate(rows):
        body = row.split("|")[1]
        assert re.findall(r"\d+[FBIW]\d+", body) == [str(op) for op in schedule.ranks[rank]]
        assert len(body) == len(rows[0].split("|")[1])  # every row spans the makespan


def test_ascii_layout() -> None:
    """One column block per time unit wide enough for a label; idle time is dots."""
    text = ascii_timeline(simulate(one_f_one_b(2, 2, 2)))
    assert text.splitlines()[1:] == [
        "rank 0 |0F0 0F1 ........0B0     ....0B1     |",
        "rank 1 |....1F0 1B0     1F1 1B1     ........|",
        "legend: 0F1 = stage 0, micro-batch 1 (F forward, B backward); . idle",
    ]


def test_the_legend_names_the_glyphs_the_drawing_shows() -> None:
    zero_bubble = ascii_timeline(simulate(zb_h1(2, 2, 3))).splitlines()[-1]
    assert zero_bubble == ("legend: 0F1 = stage 0, micro-batch 1 "
                           "(F forward, I backward's input half, W its weight half); . idle")
    assert "legend" not in ascii_timeline(simulate(zb_h1(2, 2, 3)), legend=False)


def test_ascii_fixed_width_cuts_labels() -> None:
    text = ascii_timeline(simulate(zb_h1(2, 2, 4)), width=30, legend=False)
    assert all(len(row.split("|")[1]) == 30 for row in text.splitlines()[1:])
    with pytest.raises(ValueError, match="width must be >= 1"):
        ascii_timeline(simulate(zb_h1(2, 2, 4)), width=0)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_gantt_writes_a_picture(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    path = gantt(simulate(zb_h1(3, 3, 6)), tmp_path / f"zb_h1{suffix}")
    data = path.read_bytes()
    assert len(data) > 1000
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data


def test_gantt_refuses_other_formats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        gantt(simulate(one_f_one_b(2, 2, 2)), tmp_path / "chart.pdf")


def test_gantt_without_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'shardwise\[plot\]'"):
        gantt(simulate(one_f_one_b(2, 2, 2)), tmp_path / "chart.png")


def test_write_chrome_trace(tmp_path: Path) -> None:
    timeline = simulate(one_f_one_b(2, 2, 3))
    path = write_chrome_trace(timeline, tmp_path / "trace.json")
    loaded = json.loads(path.read_text())
    assert loaded == timeline.to_chrome_trace()
    assert sum(e["ph"] == "X" for e in loaded["traceEvents"]) == 12
