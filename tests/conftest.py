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
