"""Steps for the ``shardwise`` command: ``shardwise plan`` and ``shardwise verify`` import these.

    shardwise plan examples/cli_steps.py:composed --mesh dp=2,pp=2 --simulate
    shardwise verify examples/cli_steps.py:verified --mesh dp=2,pp=2
    shardwise verify examples/cli_steps.py:verified --mesh dp=2,pp=2 --backend processes

A function for ``plan`` returns ``(step, params, batch)``; one for ``verify``
returns ``(step, reference, params, batches)``. Both take no arguments. The
loss is a top-level function so that the step pickles for ``--backend processes``.
"""

from __future__ import annotations

from typing import Any

import torch

import shardwise as sw
from shardwise.testing.models import mlp

BATCH, FEATURES, TARGETS = 8, 6, 3


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def single_device() -> tuple[sw.Step, Any]:
    """A float64 MLP's single-device step: equivalence then holds to rounding (about 1e-12)."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([FEATURES, 16, 12, TARGETS]).double())
    return sw.train_step(chain, mse, sw.optim.sgd(0.1, momentum=0.9)), params


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
         torch.randn(BATCH, TARGETS, generator=gen, dtype=torch.float64))
        for _ in range(count)
    ]


def composed_from(reference: sw.Step) -> Any:
    """ZeRO-3 over ``dp`` inside a 1F1B pipeline over ``pp`` with two microbatches."""
    return sw.pipeline(sw.shard_params(reference, "dp", stage=3), "pp", schedule="1f1b", microbatches=2)


def composed() -> tuple[Any, Any, Any]:
    """For ``shardwise plan``: (step, params, batch)."""
    reference, params = single_device()
    return composed_from(reference), params, batches(1)[0]


def verified() -> tuple[Any, Any, Any, Any]:
    """For ``shardwise verify``: (step, reference, params, batches)."""
    reference, params = single_device()
    return composed_from(reference), reference, params, batches(3)
