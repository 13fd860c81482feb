"""Suite-wide settings: strict warnings (pyproject), deterministic torch, hypothesis profiles,
and long-lived gloo process pools shared by every multi-process test."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
