"""Lint and types are part of the suite, so the one test command is all of CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    assert shutil.which("ruff"), "ruff is missing: pip install -e '.[test]'"
    result = _run(["ruff", "check", "shardwise", "tests", "examples", "benchmarks"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean() -> None:
    result = _run([sys.executable, "-m", "mypy"])
    assert result.returncode == 0, result.stdout + result.stderr
