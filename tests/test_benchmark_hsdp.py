"""benchmarks/hsdp.py's smoke run: a tiny Llama on 2 nodes x 2 ranks, planned and simulated both ways."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_tiny_run_shows_hsdp_ahead_on_a_slow_network(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("benchmark_hsdp", BENCHMARKS / "hsdp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "benchmark_hsdp", module)
        spec.loader.exec_module(module)
        assert module.main(["--tiny", "--ratios", "10"]) == 0
    rows = {row["layout"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    flat, hsdp = rows["flat"], rows["hsdp"]
    assert (flat["mesh"], hsdp["mesh"]) == ("Mesh(dp=4)", "Mesh(node=2, dp=2)")
    assert hsdp["step_s"] < flat["step_s"] and hsdp["hsdp_speedup"] > 1
    assert hsdp["slow_link_bytes"] < flat["slow_link_bytes"]
    assert hsdp["hsdp_state_ratio"] == pytest.approx(2.0, rel=0.01)  # half the shards per rank
