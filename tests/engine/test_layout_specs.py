"""The TrainState's layout has a spec for every parameter and for every optimizer-state leaf."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp


def _chain() -> tuple[sw.Chain, dict]:
    torch.manual_seed(0)
    return sw.functionalize(mlp([4, 8, 8, 3]))


@pytest.mark.parametrize(
    "name,transform,mesh",
    [
        ("one device", lambda s: s, None),
        ("zero-1", lambda s: sw.shard_params(s, "dp", 1), sw.Mesh(dp=2)),
        ("zero-3", lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2)),
        ("pipeline", lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2)),
        ("tensor parallel", lambda s: sw.tensor_parallel(s, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}),
         sw.Mesh(tp=2)),
    ],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_every_optimizer_state_leaf_has_the_spec_of_its_parameter(name: str, transform, mesh, optimizer: str) -> None:
    chain, params = _chain()
    opt = sw.optim.sgd(0.1, momentum=0.9) if optimizer == "sgd" else sw.optim.adamw(1e-3)
    step = sw.mixed_precision(transform(sw.train_step(chain, torch.nn.functional.mse_loss, opt)), "params=f64,compute=f32")
    layout = step.layout(mesh, params)
    mirrors = {"sgd": ["momentum"], "adamw": ["exp_avg", "exp_avg_sq"]}[optimizer]
    assert sorted(layout.opt_leaves) == mirrors
    for path in mirrors:
        specs = layout.opt_leaves[path]
        assert set(specs) == set(layout.leaves)  # every parameter has its state's spec
        for key, spec in specs.items():
            # The state lives where its parameter does, cut the same way, in the master dtype.
            assert spec == dataclasses.replace(layout.leaves[key], dtype=torch.float64)
    scalars = ["step"]
    assert sorted(layout.opt_scalars) == scalars
    assert all(f"optimizer {p}: " in layout.describe() for p in mirrors + scalars)


def test_a_tensor_parallel_state_spec_says_its_split() -> None:
    chain, params = _chain()
    step = sw.tensor_parallel(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)),
                              "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()})
    layout = step.layout(sw.Mesh(tp=2), params)
    momentum = layout.opt_leaves["momentum"]
    assert momentum[("0", "weight")].split == sw.layout.TensorSplit("tp", 0, 2)
    assert momentum[("2", "weight")].split == sw.layout.TensorSplit("tp", 1, 2)
    assert momentum[("2", "bias")].split is None  # added once, after the sum: whole on every rank
    assert momentum[("0", "weight")].shape == (8, 4) and momentum[("0", "weight")].local_shape == (4, 4)


def test_a_layout_memoises_a_bounded_number_of_input_layouts() -> None:
    # Varying sequence lengths: one set of actions and boundaries per input layout, never without end.
    chain, params = _chain()
    step = sw.pipeline(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "pp", "1f1b", 2)
    layout = step.layout(sw.Mesh(pp=2), params)
    for rows in range(2, 400, 2):
        step.boundaries(layout, torch.randn(rows, 4))
    assert 0 < len(layout.cache) <= 64
