"""benchmarks/search.py's statistics: Spearman's rank correlation, ties at their average rank."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # its ``from _common import ...``
        spec = importlib.util.spec_from_file_location("search", BENCHMARKS / "search.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        # Dataclasses look their module up, and gloo ranks import the functions they run by it.
        patch.setitem(sys.modules, "search", module)
        spec.loader.exec_module(module)
        yield module


def test_ranks_average_ties(bench: ModuleType) -> None:
    assert bench.ranks_of([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    assert bench.ranks_of([5.0, 1.0, 5.0, 0.0]) == [3.5, 2.0, 3.5, 1.0]


def test_spearman(bench: ModuleType) -> None:
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Without ties it is 1 - 6 sum(d^2) / (n (n^2 - 1)): d = (0, -2, 1, 1) gives 1 - 36/60.
    assert bench.spearman([1, 2, 3, 4], [1, 4, 2, 3]) == pytest.approx(0.4)
    assert math.isnan(bench.spearman([1, 1, 1], [1, 2, 3]))


@pytest.mark.gloo  # two gloo processes (the session's gloo2)
def test_a_tiny_run_prints_consistent_rankings(bench: ModuleType, gloo2: Any) -> None:
    """The whole benchmark on 2 gloo ranks: a 2-block TinyGPT, 2 layouts measured for 1 step, two
    pricings. Each pricing's rankings order its layouts by their own predicted and measured
    seconds, and its summary's first choice, best and ratio are read off those same lines."""
    args = bench.main_parser().parse_args(["--tiny", "--models", "gpt", "--limit", "2", "--steps", "1",
                                           "--warmup", "0", "--remat", "none",
                                           "--pricing", "issue@measured,plain@1"])
    rows: list[dict[str, Any]] = []
    # The ranks import this folder's modules (search, _common, collectives) as the script's do.
    gloo2.run(exec, f"import sys; sys.path.append({str(BENCHMARKS)!r})")
    try:
        bench.run(args, gloo2, rows.append)
    finally:
        gloo2.run(exec, f"import sys; sys.path.remove({str(BENCHMARKS)!r})")
    probe = [r for r in rows if r.get("probe")]
    assert len(probe) == 1 and probe[0]["cores_measured"] > 0
    # The issue probe's wall times are kept as CPU time: times each rank's share of a core then.
    assert probe[0]["issue_core_share"] == pytest.approx(min(1.0, probe[0]["cores_measured"] / 2), abs=0.01)
    assert set(probe[0]["issue_s"]) == {"send", "all_gather", "psum_scatter", "psum"}
    for pricing in ("issue@measured", "plain@1"):
        for statistic in ("median", "min"):
            mine = [r for r in rows if r.get("pricing") == pricing and r["measured"] == statistic]
            layouts = [r for r in mine if "stack" in r]
            (summary,) = [r for r in mine if r.get("summary")]
            orders = {r["ranking"]: r["order"] for r in mine if "ranking" in r}
            assert len(layouts) == summary["layouts"] == 2
            assert {"predicted_s", "measured_s", "ratio", "peak_bytes", "simulated_cores"} <= set(layouts[0])
            assert summary["simulated_cores"] == (1 if pricing == "plain@1" else layouts[0]["simulated_cores"])
            by_stack = {r["stack"]: r for r in layouts}
            for ranking, field in (("predicted", "predicted_s"), ("measured", "measured_s")):
                assert sorted(orders[ranking]) == sorted(by_stack)
                values = [by_stack[s][field] for s in orders[ranking]]
                assert values == sorted(values)
            assert summary["top_choice"] == orders["predicted"][0]
            assert summary["measured_best"] == orders["measured"][0]
            best = by_stack[summary["measured_best"]]["measured_s"]
            assert summary["top_choice_vs_best"] == pytest.approx(
                by_stack[summary["top_choice"]]["measured_s"] / best, abs=1e-3)
            assert -1.0 <= summary["spearman"] <= 1.0
