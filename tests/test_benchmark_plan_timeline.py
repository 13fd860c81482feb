"""benchmarks/plan_timeline.py, tiny on threads: it calibrates, simulates and compares a dp=2 x pp=2 step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plan_timeline_benchmark_compares_simulated_with_measured(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "plan_timeline.py"), "--backend", "threads", "--steps", "4",
           "--warmup", "1", "--hidden", "16", "--layers", "4", "--batch", "16", "--cores", "0",
           "--draw", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["kind"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {"calibration", "compare"}
    assert set(rows["calibration"]["alpha_s"]) == {"psum", "all_gather", "psum_scatter", "send"}
    compare = rows["compare"]
    for key in ("step", "bubble"):
        measured, simulated = compare[f"measured_{key}" + ("_s" if key == "step" else "")], compare[
            f"simulated_{key}" + ("_s" if key == "step" else "")]
        assert measured > 0 and simulated > 0
        assert compare[f"{key}_ratio"] == round(simulated / measured, 3)
    assert compare["cores_modelled"] is None
    for name in ("simulated", "measured"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["traceEvents"]
        assert (tmp_path / f"{name}.txt").read_text().startswith(f"{name}: makespan")
