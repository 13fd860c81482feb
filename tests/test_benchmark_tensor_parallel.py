"""benchmarks/tensor_parallel.py, tiny, on two gloo processes: ours and torch's DTensor tensor
parallel on the same Llama, with and without sequence parallel, print comparable JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.engine.plan.actions import REPLICA_BINS

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--hidden", "32", "--intermediate", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--vocab", "128", "--seq", "16", "--batch", "2"]


@pytest.mark.gloo  # two gloo processes
def test_tensor_parallel_benchmark_compares_ours_with_dtensor() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tensor_parallel.py"), "--worlds", "2", "--sp", "off,on",
           "--steps", "2", "--warmup", "1", *TINY]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    cases = {(row["sequence_parallel"], row["variant"]): row for row in rows}
    assert set(cases) == {(sp, v) for sp in (False, True) for v in ("ours", "torch")}
    for sp in (False, True):
        ours, torch_row = cases[(sp, "ours")], cases[(sp, "torch")]
        assert ours["tp"] == torch_row["tp"] == 2
        assert ours["median_step_s"] > 0 and torch_row["median_step_s"] > 0
        assert torch_row["ratio_to_torch"] == 1.0
        # The ratio is of the unrounded step times, rounded to 3 places; the times printed are rounded
        # too (to 5 places: a 50 ms step to 10 us), so their quotient may round to its neighbour.
        assert ours["ratio_to_torch"] == pytest.approx(ours["median_step_s"] / torch_row["median_step_s"], abs=1e-3)
        # The same split of the same parameters: every rank holds the same bytes under both, and
        # the Plan says so before the step runs.
        assert ours["param_bytes_per_rank"] == torch_row["param_bytes_per_rank"] == ours["plan_param_bytes_per_rank"]
        # Same init, same batches, same maths in float32: the losses agree to rounding (relative 1e-6).
        assert ours["max_abs_loss_diff"] == torch_row["max_abs_loss_diff"]
        assert ours["max_abs_loss_diff"] <= 1e-6 * ours["final_loss"], ours
        assert ours["plan_matches_ledger"] is True
        # Every collective torch issued was counted; sequence parallel changes which ones run.
        assert "uncounted_ops" not in torch_row
        for row in (ours, torch_row):
            ops = set(row["sent_bytes_by_op"])
            assert row["sent_bytes_per_step"] == sum(v["sent_bytes"] for v in row["sent_bytes_by_op"].values())
            if sp:
                assert {"tp:all_gather", "tp:psum_scatter"} <= ops, row["sent_bytes_by_op"]
            else:
                assert "tp:psum_scatter" not in ops, row["sent_bytes_by_op"]
        assert cases[(False, "torch")]["sent_bytes_by_op"].keys() == {"tp:psum"}
        # The same bytes as torch's, with and without sequence parallel, but for what only ours sends: the
        # replica check (an all-gather of 520 B, 32 bins' sums and magnitudes and the batch's fingerprint in float64:
        # 520 B sent at tp 2) and the metrics' all-reduce (20 B in, 20 B
        # sent: the loss, and the batch's fingerprint and the step's digest, each with a weighted copy).
        # At tp 2 the loss's maximum costs both the same (ours all-gathers it, torch all-reduces it with
        # MAX). Under sequence parallel the embedding's output is reduce-scattered and the head's input gradient
        # too, as torch does (they were all-reduced: 1/3 more bytes at those ends).
        check = (2 * REPLICA_BINS + 1) * 8
        assert ours["sent_bytes_per_step"] - torch_row["sent_bytes_per_step"] == check + 20, (ours, torch_row)
        if sp:
            assert ours["sent_bytes_by_op"]["tp:psum_scatter"] == torch_row["sent_bytes_by_op"]["tp:psum_scatter"]
