"""benchmarks/seed_systems.py: FairScale and DeepSpeed are optional. A benchmark reports a system whose
package is missing as skipped, with how to install it, and builds nothing; where they are installed,
each trains as torch does on two gloo processes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fairscale", "deepspeed")


@pytest.fixture
def benchmarks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The benchmarks folder on sys.path (its scripts import each other by their bare names)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import seed_systems

    return seed_systems


def hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` look not installed (a None entry in sys.modules: find_spec then finds nothing)."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize("package", PACKAGES)
def test_a_missing_package_skips_its_systems_with_the_install_command(
        benchmarks: Any, monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    from torch import nn

    hide(monkeypatch, package)
    systems = [s for s in benchmarks.SYSTEMS if benchmarks.PACKAGE_OF[s] == package]
    assert systems
    for system in systems:
        reason = benchmarks.missing(system)
        assert reason is not None and f"{package} is not installed" in reason and "pip install" in reason
        adamw = benchmarks.AdamW(1e-3, (0.9, 0.999), 1e-8, 0.0)
        # Refused before anything else is asked of it: no process group is needed to be told.
        with pytest.raises(benchmarks.SystemMissing, match=f"{package} is not installed"):
            benchmarks.build(system, nn.Linear(2, 2), [], nn.functional.mse_loss, adamw, 1)
    others = [s for s in benchmarks.SYSTEMS if benchmarks.PACKAGE_OF[s] != package]
    for system in others:  # hiding one package says nothing about the other
        other = benchmarks.PACKAGE_OF[system]
        assert (benchmarks.missing(system) is None) == (importlib.util.find_spec(other) is not None)


def test_the_benchmarks_turn_a_missing_system_into_a_skipped_row(benchmarks: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import memory
    import shard_params

    hide(monkeypatch, "fairscale")
    hide(monkeypatch, "deepspeed")
    cfg = memory.Config(width=8, layers=2, batch=4, steps=1, world=2)
    for variant in ("fairscale_fsdp", "deepspeed_zero3", "deepspeed_zero3_init"):
        row = memory.measured(cfg, variant)  # starts no process for a skipped system
        assert set(row) == {"skipped"} and "is not installed" in row["skipped"], row
    speed_cfg = shard_params.Config("mlp", world=2, steps=1, warmup=1, batch=4)
    for system in benchmarks.SYSTEMS:
        with pytest.raises(benchmarks.SystemMissing):  # bench_rank reports it as the variant's "skipped"
            shard_params.make_variant(system, speed_cfg)


def test_an_unknown_system_is_refused_by_name(benchmarks: Any) -> None:
    with pytest.raises(ValueError, match=r"unknown seed system 'zero4'.*fairscale_fsdp"):
        benchmarks.missing("zero4")


# Where they are installed, each trains as torch does: test_benchmark_shard_params.py, on that benchmark's
# one run for the suite.
