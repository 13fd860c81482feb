"""benchmarks/plan_timeline.py, tiny on threads: it calibrates, simulates and compares a dp=2 x pp=2 step
and a tp=2 one. Its ``main`` runs in this process: its ranks are threads, so a fresh interpreter (torch
imported again for each stack) isolated nothing (its ranks' ``torch.set_num_threads(1)`` is this
process's setting already: tests/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


STACKS = {"dp2xpp2": ["--layers", "4", "--batch", "16"], "tp2": ["--layers", "2", "--batch", "4"]}


@pytest.mark.parametrize("stack", STACKS)
def test_plan_timeline_benchmark_compares_simulated_with_measured(
    stack: str, tmp_path: Path, benchmark_script: Callable[[str], Any], capsys: pytest.CaptureFixture[str]
) -> None:
    bench = benchmark_script("plan_timeline")
    capsys.readouterr()
    bench.main(["--backend", "threads", "--steps", "8", "--warmup", "1", "--hidden", "16", "--stack", stack,
                *STACKS[stack], "--cores", "0", "--draw", str(tmp_path)])
    rows = {row["kind"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"calibration", "compare"}
    # Which transfers some rank waited for depends on timing; those it fitted are the step's ops.
    # Ops no rank waited for are priced free, and named.
    fitted = set(rows["calibration"]["alpha_s"]) - set(rows["calibration"]["unfitted_ops"])
    assert fitted and fitted <= {"psum", "all_gather", "psum_scatter", "send"}, rows["calibration"]
    assert set(rows["calibration"]["unfitted_ops"]) <= set(rows["calibration"]["alpha_s"])
    compare = rows["compare"]
    for key in ("step", "bubble"):
        measured, simulated = compare[f"measured_{key}" + ("_s" if key == "step" else "")], compare[
            f"simulated_{key}" + ("_s" if key == "step" else "")]
        assert measured > 0 and simulated > 0
        # The ratio is of the unrounded figures, rounded to 3 places; the figures printed are rounded
        # to 6 (a 12 ms step to the microsecond), so their quotient may round to its neighbour.
        assert compare[f"{key}_ratio"] == pytest.approx(simulated / measured, abs=1e-3), compare
    assert compare["cores_modelled"] is None and compare["stack"] == stack
    # The prediction (each calibration step's own costs) and one simulation at the averaged costs.
    assert compare["averaged_costs_step_s"] > 0 and compare["simulated_no_comm_step_s"] <= compare["simulated_step_s"]
    assert compare["replay_step_ratio"] > 0 and compare["halves_step_ratio"] > 0
    ratios = [compare["step_ratio"], compare["bubble_ratio"]]
    if all(abs(abs(r - 1) - 0.15) > 1e-3 for r in ratios):  # away from where rounding decides
        assert compare["within_15pct"] == all(abs(r - 1) <= 0.15 for r in ratios)
    for name in ("simulated", "measured"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["traceEvents"]
        assert (tmp_path / f"{name}.txt").read_text().startswith(f"{name}: makespan")
