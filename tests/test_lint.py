"""Lint and types are part of the suite, so the one test command is all of CI."""

from __future__ import annotations

import os
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


# From the cache the last run kept (tests/mypy_warm.py): a fresh checkout's cold run analysed transformers and
# torch again, 35 s of CPU, for the same result. Beside the other tests (conftest.py).
@pytest.mark.beside([sys.executable, str(ROOT / "tests" / "mypy_warm.py")], timeout=600)
def test_mypy_clean(beside: subprocess.CompletedProcess[str]) -> None:
    assert beside.returncode == 0, beside.stdout + beside.stderr


def test_mypy_from_a_kept_cache_still_finds_an_error_in_an_unchanged_module(tmp_path: Path) -> None:
    """tests/mypy_warm.py keeps mypy's cache between runs, and the next run starts from it (its modules'
    metadata are fresh: builtins is not analysed again); an error that a change of one module makes in
    another, unchanged since the cache was written, is still reported."""
    work, kept = tmp_path / "work", tmp_path / "kept"
    work.mkdir()
    (work / "lib.py").write_text("def answer() -> int:\n    return 42\n")
    (work / "use.py").write_text("from lib import answer\n\nx: int = answer()\n")

    def warm_mypy() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(ROOT / "tests" / "mypy_warm.py"), "--verbose", "lib.py", "use.py"],
                              cwd=work, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "SHARDWISE_MYPY_CACHE": str(kept)})

    first = warm_mypy()
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    assert "Metadata fresh for builtins" not in first.stderr  # no cache to start from
    assert kept.is_dir() and any(kept.iterdir()), "the cache was not kept"
    (work / "lib.py").write_text("def answer() -> str:\n    return '42'\n")
    second = warm_mypy()
    assert "Metadata fresh for builtins" in second.stderr, second.stderr[-3000:]  # from the kept cache
    assert second.returncode == 1, second.stdout + second.stderr[-3000:]
    assert 'use.py:3: error: Incompatible types in assignment (expression has type "str", variable has type "int")' in (
        second.stdout), second.stdout
