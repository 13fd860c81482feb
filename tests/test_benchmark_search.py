"""benchmarks/search.py's statistics: Spearman's rank correlation, ties at their average rank."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # its ``from _common import ...``
        spec = importlib.util.spec_from_file_location("benchmark_search", BENCHMARKS / "search.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, "benchmark_search", module)  # dataclasses look their module up
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
