"""sw.context_parallel as a step on gloo processes (torch.distributed's ppermute and all-to-all), against the
single-device step: the same losses and parameters after two steps.

float64: the transport moves exact bytes, so the threads tests' rounding bound applies unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.transforms.context_parallel import context_parallel

from .test_cp_step import batches, gpt

pytestmark = pytest.mark.gloo


def _rank(attention: str) -> tuple[list[float], Any]:
    step, params = gpt()
    composed = context_parallel(step, "cp", attention=attention)
    with sw.Mesh(cp=2) as mesh:
        state = composed.init(params, mesh)
        losses = []
        for batch in batches():
            state, metrics = composed(state, batch)
            losses.append(float(metrics["loss"]))
        return losses, composed.full_params(state)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_cp_step_on_gloo_equals_the_single_device_step(attention: str, gloo2: Any) -> None:
    step, params = gpt()
    state, want = step.init(params), []
    for batch in batches():
        state, metrics = step(state, batch)
        want.append(float(metrics["loss"]))
    for losses, full in gloo2.run(_rank, attention):
        assert losses == pytest.approx(want, rel=1e-12)
        for layer, tensors in step.full_params(state).items():
            for name, t in tensors.items():
                torch.testing.assert_close(full[layer][name], t, rtol=1e-10, atol=1e-12)
