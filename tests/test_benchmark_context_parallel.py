"""benchmarks/context_parallel.py, tiny, on two gloo processes: ring, Ulysses and the all-gather-KV
baseline print comparable JSON lines, and torch's context_parallel a line of its own (timed, or why not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One pool for timing and memory: the smoke run starts two processes, not four.
TINY = ["--seqs", "32", "--worlds", "2", "--heads", "2", "--head-dim", "4", "--steps", "2", "--warmup", "1",
        "--pools", "one"]


@pytest.mark.gloo  # two gloo processes
def test_context_parallel_benchmark_prints_every_system() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), *TINY]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["variant"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {"ring", "ulysses", "allgather_kv", "torch_cp"}
    assert {row["pools"] for row in rows.values()} == {"one"}
    torch_cp = rows.pop("torch_cp")
    # Either timed or skipped with the error that stopped it: never silently absent.
    assert "median_step_s" in torch_cp or torch_cp["skipped"].startswith("torch's context_parallel"), torch_cp
    assert rows["allgather_kv"]["ratio_to_allgather"] == 1.0
    for name, row in rows.items():
        assert (row["seq"], row["cp"], row["heads"], row["head_dim"]) == (32, 2, 2, 4)
        assert row["median_step_s"] > 0 and row["peak_bytes_per_rank"] >= 0
        # What the ledger saw is what the formulas say: the ring's K/V slice once each way, the
        # all-gather's the same, Ulysses' four all-to-alls; forward and backward.
        assert row["sent_bytes_per_step"] == row["formula_sent_bytes"] > 0, name
        # The same attention in float32 (sums in different orders): within a few ulps of O(1) values.
        assert row["max_abs_diff_to_allgather"] <= 1e-5, name
