"""Tensors a transform makes itself go to the parameters' device, not torch's default device.

CI has no GPU. A tensor made without naming a device (zeros for a gradient no
forward produced, a rank's metrics, a message header) lands on torch's default
device; on a GPU the first operation mixing it with the parameters fails
("Expected all tensors to be on the same device"), which is how the pipeline
first failed on one. Here the steps run under ``with torch.device("meta")``
while parameters and batches stay on the CPU: every such tensor becomes a meta
tensor, which either breaks the step or shows up in its results.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.testing.equivalence import (
    COMPARED_METRICS,
    DEFAULT_RTOL,
    compare_histories,
    record_history,
)


class WithSpare(nn.Module):
    """A Linear beside a parameter no forward uses: its gradient is made as zeros."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


def _model() -> tuple[sw.Chain, Any, list[tuple[Tensor, Tensor]]]:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.GELU(), WithSpare(8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3)]
    chain, params = sw.functionalize(nn.Sequential(*layers).double())
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return chain, params, batches


def _cases() -> dict[str, tuple[Any, Any, dict[str, int]]]:
    """name -> (the step under test, its single-device reference, the mesh shape)."""
    chain, _, _ = _model()
    step = sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-2), clip_norm=1.0)
    mixed = sw.mixed_precision(step, "params=f64,compute=f32,output=f64", loss_scale="dynamic")
    cases: dict[str, tuple[Any, Any, dict[str, int]]] = {"single, mixed precision": (mixed, mixed, {"dp": 1})}
    for stage in (1, 2, 3):
        cases[f"shard_params stage {stage}"] = (sw.shard_params(step, "dp", stage=stage), step, {"dp": 2})
    cases["shard_params stage 3, mixed precision"] = (sw.shard_params(mixed, "dp", stage=3), mixed, {"dp": 2})
    for schedule in ("1f1b", "interleaved_1f1b", "zb_h1", "zb_v"):
        cases[f"pipeline {schedule}"] = (sw.pipeline(step, "pp", schedule, 4), step, {"pp": 2})
    composed = sw.mixed_precision(
        sw.remat(sw.pipeline(sw.shard_params(step, "dp", stage=3), "pp", "1f1b", 2), policy=sw.policies.dots_saveable),
        "params=f64,compute=f32,output=f64",
        loss_scale="dynamic",
    )
    cases["dp x pp, remat, mixed precision"] = (composed, mixed, {"dp": 2, "pp": 2})
    return cases


CASES = _cases()


def _meta_leaves(tree: Any) -> list[str]:
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return [str(p) for p, t in zip(paths, leaves, strict=True) if isinstance(t, Tensor) and t.is_meta]


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_under_a_meta_default_device_makes_nothing_on_it(name: str) -> None:
    distributed, reference, shape = CASES[name]
    _, params, batches = _model()
    expected = record_history(reference, reference.init(params), batches)

    def program() -> tuple[list[Any], list[str]]:  # one rank
        mesh = sw.Mesh(**shape)
        state = distributed.init(params) if shape == {"dp": 1} else distributed.init(params, mesh)
        history, metas = [], []
        with torch.device("meta"):
            for batch in batches:  # record_history's loop, also looking at the whole state and metrics
                state, metrics = distributed(state, batch)
                full = distributed.full_params(state)
                metas += _meta_leaves((state.params, state.opt_state, metrics, full))
                history.append(({k: metrics[k] for k in COMPARED_METRICS if k in metrics}, full))
        return history, metas

    per_rank = sw.launch(program, sw.Mesh(**shape).size)
    for r, (_, metas) in enumerate(per_rank):
        assert metas == [], f"rank {r}: tensors on the default (meta) device: {metas}"
    # Mixed precision computes in float32 (summation order differs by rank count), the rest in float64.
    rtol = DEFAULT_RTOL[torch.float32 if "mixed" in name else torch.float64]
    compare_histories([history for history, _ in per_rank], expected, rtol=rtol)
