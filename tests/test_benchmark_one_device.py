"""benchmarks/one_device.py's smoke run: the single-device step and the plain torch loop train alike."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_one_device_step_and_torch_loop_give_the_same_losses(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("benchmark_one_device", BENCHMARKS / "one_device.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # the script imports _common, as when run from there
        patch.setitem(sys.modules, "benchmark_one_device", module)
        spec.loader.exec_module(module)
        module.main(["--models", "mlp", "--rounds", "2", "--steps", "1", "--warmup", "1", "--paired", "3",
                     "--mlp-hidden", "16"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["model"], r["optim"]) for r in rows] == [("mlp", "sgd"), ("mlp", "adamw")]
    for row in rows:
        # Clipping by the global norm included: the same float32 losses bit for bit, every step.
        assert row["max_rel_loss_diff"] == 0.0, row
        assert row["cpu_ms_torch"] > 0 and row["cpu_ms_shardwise"] > 0 and len(row["cpu_ratios"]) == 2
        assert row["mlp_hidden"] == 16 and row["paired_steps"] == 3 and row["paired_cpu_ratio"] > 0


@pytest.mark.parametrize("mode", ["default", "steady", "live"])
def test_a_malloc_mode_sets_the_ranks_environment_and_is_read_back(monkeypatch: pytest.MonkeyPatch,
                                                                   mode: str) -> None:
    """``--malloc``: the environment rank processes start with, and what ``environment()`` reports; undone after."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _common

    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(key, raising=False)
    with _common.malloc_mode(mode):
        assert _common.malloc_now() == mode == _common.environment()["malloc"]
        assert {k: os.environ[k] for k in _common.MALLOC_ENVS.get(mode, {})} == _common.MALLOC_ENVS.get(mode, {})
    assert _common.malloc_now() == "default" and "MALLOC_MMAP_THRESHOLD_" not in os.environ
