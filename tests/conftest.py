"""Suite-wide settings: strict warnings (pyproject), deterministic torch, hypothesis profiles,
long-lived gloo process pools shared by every multi-process test, and mypy started beside the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" is fast and reproducible (derandomize); "dev" searches deeper:
#   HYPOTHESIS_PROFILE=dev pytest
settings.register_profile(
    "ci",
    max_examples=12,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)


def _pool(world: int) -> Iterator[object]:
    from shardwise.collectives.backends.processes import ProcessPool

    with ProcessPool(world, timeout=60.0) as pool:
        yield pool


@pytest.fixture(scope="session")
def gloo2() -> Iterator[object]:
    """Two gloo ranks as processes, reused by every test that asks (a process costs ~2 s to start)."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def gloo4() -> Iterator[object]:
    """Four gloo ranks as processes, reused by every test that asks."""
    yield from _pool(4)


class _StartedWith:
    """A pool whose processes start (and restart, after a failed run) with ``env`` in their environment."""

    def __init__(self, pool: object, env: dict[str, str]) -> None:
        self.pool, self.env = pool, env

    def run(self, fn: object, *args: object) -> list[object]:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in self.env.items():
                patch.setenv(key, value)
            return self.pool.run(fn, *args)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def live_malloc_gloo4() -> Iterator[object]:
    """Four gloo ranks whose glibc returns freed memory at once (``LIVE_MALLOC``: RSS follows live
    memory), shared by the tests that measure a rank's peak at world 4. Each measures after a warm-up
    of its own code on a tiny model, from a reset high-water mark (``PeakRSS``)."""
    from shardwise.collectives.backends.processes import ProcessPool
    from shardwise.testing.memory import LIVE_MALLOC

    with ProcessPool(4, timeout=240.0) as pool:
        yield _StartedWith(pool, LIVE_MALLOC)


# -- mypy beside the tests ------------------------------------------------------------------
# mypy reads the sources only and takes a core for 10-20 s (a fresh checkout has no cache). The
# tests run one at a time, torch on one thread, so a second core is mostly idle: mypy starts there
# as soon as the tests are collected, and test_mypy_clean reads its result.
ROOT = Path(__file__).resolve().parents[1]
_MYPY = pytest.StashKey[subprocess.Popen[str]]()


def _start_mypy() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "mypy"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.name == "test_mypy_clean" and item.path.name == "test_lint.py" for item in session.items):
        session.config.stash[_MYPY] = _start_mypy()


def pytest_sessionfinish(session: pytest.Session) -> None:
    proc = session.config.stash.get(_MYPY, None)
    if proc is not None and proc.poll() is None:  # the run stopped before test_mypy_clean read it
        proc.kill()
        proc.communicate()


@pytest.fixture
def mypy_result(request: pytest.FixtureRequest) -> subprocess.CompletedProcess[str]:
    """``python -m mypy`` on the package (pyproject's settings): the run started at collection."""
    proc = request.config.stash.get(_MYPY, None) or _start_mypy()
    out, _ = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
