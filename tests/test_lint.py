"""Lint and types are part of the suite, so the one test command is all of CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    assert shutil.which("ruff"), "ruff is missing: pip install -e '.[test]'"
    result = _run(["ruff", "check", "shardwise", "tests", "examples", "benchmarks"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.beside([sys.executable, "-m", "mypy"], timeout=600)  # beside the other tests (conftest.py)
def test_mypy_clean(beside: subprocess.CompletedProcess[str]) -> None:
    assert beside.returncode == 0, beside.stdout + beside.stderr
