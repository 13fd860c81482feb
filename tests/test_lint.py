"""Lint and types are part of the suite, so the one test command is all of CI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    assert shutil.which("ruff"), "ruff is missing: pip install -e '.[test]'"
    result = _run(["ruff", "check", "shardwise", "tests", "examples", "benchmarks"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean(mypy_result: subprocess.CompletedProcess[str]) -> None:
    """mypy ran beside the tests since they were collected (conftest.py)."""
    assert mypy_result.returncode == 0, mypy_result.stdout + mypy_result.stderr
