"""A layer that normalises with the statistics of the batch it is called on (BatchNorm in training mode,
or without running statistics) under the transforms that cut the batch.

functionalize refuses a BatchNorm that updates running statistics and suggested
``track_running_stats=False``; such a layer normalises each call's batch with that batch's own mean and
variance. Under data parallel, accumulation or a pipeline's micro-batches each part of the batch was
normalised with its own statistics: the loss differed from the single-device step's by 4% (relative),
without an error. It is refused where the batch is cut, naming the layer; where every rank computes on
the whole batch (one device, tensor_parallel alone, a pipeline of one micro-batch) it is the
single-device step, exactly as in any other model. Per-sample normalisations are never refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw

FIX = r"Use a per-sample normalisation \(nn.GroupNorm, nn.LayerNorm\) instead, or run without cutting the batch"


def _problem(norm: nn.Module, first: bool = False) -> tuple[sw.Step, Any, list[Any]]:
    """A tiny float64 MLP with ``norm`` after its first Linear (or before it, ``first``)."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), norm, nn.ReLU(), nn.Linear(8, 2)] if not first else [
        norm, nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)]
    chain, params = sw.functionalize(nn.Sequential(*layers).double())
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
                torch.randn(8, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


CUTTING: dict[str, tuple[Callable[[sw.Step], sw.Step], str]] = {
    "data parallel": (lambda s: sw.shard_params(s, "dp", 3), r"shard_params \(data parallel over axis 'dp'\)"),
    "accumulation": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
                     r"shard_params \(data parallel over axis 'dp', accumulation=2\)"),
    "hsdp": (lambda s: sw.shard_params(s, "dp", 3, replicate="rep"),
             r"shard_params \(data parallel over axis 'dp' and 'rep'\)"),
    "micro-batches": (lambda s: sw.pipeline(s, "pp", "gpipe", 2), r"pipeline with 2 micro-batches"),
}


@pytest.mark.parametrize("cut", sorted(CUTTING))
@pytest.mark.parametrize("norm", ["training, no running stats", "eval, no running stats", "sync"])
def test_batch_statistics_are_refused_where_the_batch_is_cut(cut: str, norm: str) -> None:
    module = {
        "training, no running stats": nn.BatchNorm1d(8, track_running_stats=False),
        "eval, no running stats": nn.BatchNorm1d(8, track_running_stats=False).eval(),
        "sync": nn.SyncBatchNorm(8, track_running_stats=False),
    }[norm]
    step, _, _ = _problem(module)
    transform, words = CUTTING[cut]
    kind = type(module).__name__
    mode = "training" if module.training else "eval"
    with pytest.raises(ValueError, match=rf"'1' \({kind}, track_running_stats=False, in {mode} mode\) normalises "
                       rf"over the batch dimension.*under {words} each rank \(or micro-batch\) calls it on a part "
                       rf"of the batch: each part would be normalised with its own statistics.*{FIX}"):
        transform(step)


def test_the_refusal_names_the_module_path_inside_a_layer_and_the_others() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU())
            self.norms = nn.ModuleList([nn.BatchNorm1d(8, track_running_stats=False) for _ in range(2)])
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.body(x)
            for norm in self.norms:
                x = norm(x)
            return self.head(x)

    for units in (None, ["body", "norms", "head"]):
        chain, _ = sw.functionalize(Net().double(), units=units)
        step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1))
        with pytest.raises(ValueError, match=r"^'body.1' \(BatchNorm1d, track_running_stats=False, in training "
                           r"mode\) \(and 2 more: 'norms.0', 'norms.1'\) normalises over the batch"):
            sw.shard_params(step, "dp", 1, accumulation=2)


NOT_CUTTING: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "one device": (lambda s: s, sw.Mesh(world=1)),
    "a pipeline of one micro-batch": (lambda s: sw.pipeline(s, "pp", "gpipe", 1), sw.Mesh(pp=2)),
    "tensor_parallel alone": (lambda s: sw.tensor_parallel(s, "tp", {"1": sw.tp.Colwise(), "3": sw.tp.Rowwise()}),
                              sw.Mesh(tp=2)),
}


@pytest.mark.parametrize("where", sorted(NOT_CUTTING))
def test_batch_statistics_are_the_single_device_step_where_every_rank_has_the_whole_batch(where: str) -> None:
    """BatchNorm before the tensor-parallel pair sees the replicated input: its statistics are the batch's."""
    step, params, batches = _problem(nn.BatchNorm1d(4, track_running_stats=False), first=True)
    transform, mesh = NOT_CUTTING[where]
    sw.testing.assert_equivalent(transform(step), step, mesh, batches, params, rtol=1e-12)


@pytest.mark.parametrize("norm", ["LayerNorm", "GroupNorm", "RMSNorm", "InstanceNorm1d", "BatchNorm1d.eval()"])
@pytest.mark.parametrize("cut", ["data parallel", "micro-batches"])
def test_per_sample_normalisations_and_running_statistics_are_accepted_and_exact(norm: str, cut: str) -> None:
    module = {
        "LayerNorm": lambda: nn.LayerNorm(8),
        "GroupNorm": lambda: nn.GroupNorm(2, 8),
        "RMSNorm": lambda: nn.RMSNorm(8),
        # each row as 2 channels of 4 positions: every sample's channel normalised over its own positions
        "InstanceNorm1d": lambda: nn.Sequential(nn.Unflatten(1, (2, 4)), nn.InstanceNorm1d(2), nn.Flatten()),
        "BatchNorm1d.eval()": lambda: nn.BatchNorm1d(8).eval(),
    }[norm]()
    step, params, batches = _problem(module)
    transform, _ = CUTTING[cut]
    mesh = sw.Mesh(dp=2) if cut == "data parallel" else sw.Mesh(pp=2)
    sw.testing.assert_equivalent(transform(step), step, mesh, batches, params, rtol=1e-12)
