"""benchmarks/expert_parallel.py, tiny, on two gloo processes: shardwise's MoE dispatch and FairScale's
MOELayer on the same experts print comparable JSON lines, and agree where nothing is dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--worlds", "2", "--hidden", "8", "--ffn", "16", "--tokens", "32", "--steps", "2", "--warmup", "1"]

pytest.importorskip("fairscale", reason="the benchmark compares against FairScale's MOELayer")


@pytest.mark.gloo  # two gloo processes
def test_expert_parallel_benchmark_prints_every_system() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "expert_parallel.py"), *TINY]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["variant"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {"shardwise", "shardwise_cap1", "fairscale", "fairscale_nodrop", "single_device"}
    assert rows.pop("single_device")["median_step_s"] > 0
    assert rows["fairscale"]["ratio_to_fairscale"] == 1.0
    for name, row in rows.items():
        assert row["median_step_s"] > 0, name
        assert row["sent_bytes_per_step"] == row["formula_sent_bytes"] > 0, name
    # Nothing dropped: both equal the single-device layer on every rank's tokens (float32 sums in
    # other orders), and both exchange the same slots per (rank, expert).
    for name in ("shardwise", "fairscale_nodrop"):
        assert rows[name]["dropped_fraction"] == 0.0
        assert rows[name]["max_abs_diff_to_single_device"] <= 1e-5, name
    assert rows["shardwise"]["slots"] == rows["fairscale_nodrop"]["slots"]
    # A capacity factor of 1 is Top2Gate's capacity, 2 x tokens / experts.
    assert rows["shardwise_cap1"]["slots"] <= rows["fairscale"]["slots"] == 2 * 32 // 8
