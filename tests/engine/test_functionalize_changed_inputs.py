"""A model whose forward changes a batch input in place, split by recording its calls.

``embed`` changes a copy of the input (its carry holds it); a replay up to its carried state (``head``, a
bridge) changes a copy of the carried input again and puts the carried values back at its carried state, so
the code after sees the input as the module has it there. A value the replayed code computes from the
changed input before the carried state is refused where the code after uses it; so is a unit changing its
input in place. Exact in float64: the split trains to the bit as the module as one layer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw
from shardwise.engine.model.functionalize import FunctionalizeError, functionalize

UNITS = ["layers.0", "layers.1"]


class MasksItsInput(nn.Module):
    """Doubles ``features`` and zeroes a random part of it, in place, before its layers; the code after
    them reads it again. ``early``: also a value computed from it before the change, used after the layers."""

    def __init__(self, early: bool = False) -> None:
        super().__init__()
        self.early = early
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.out = nn.Linear(8, 2)

    def forward(self, features: Tensor) -> Tensor:
        energy = features.abs().sum(-1, keepdim=True) if self.early else 0.0
        features.mul_(2)
        features[torch.rand(features.shape) < 0.3] = 0
        h = self.embed(features)
        for layer in self.layers:
            h = layer(h)
        return self.out(h) + features.sum(-1, keepdim=True) + energy


class ChangesInsideAUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Scaling(), Scaling()])

    def forward(self, features: Tensor) -> Tensor:
        h = features * 1.0
        for layer in self.layers:
            h = layer(h, features)
        return h


class Scaling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, h: Tensor, features: Tensor) -> Tensor:
        features.mul_(2)
        return h * self.w + features


def batches() -> list[tuple[dict[str, Tensor], Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [({"features": torch.randn(3, 5, 4, generator=g, dtype=torch.float64)},
             torch.randn(3, 5, 2, generator=g, dtype=torch.float64)) for _ in range(2)]


def mse(y: Tensor, t: Tensor) -> Tensor:
    return ((y - t) ** 2).mean()


def trained(units: Any, remat: bool = False) -> tuple[dict[str, Tensor], list[Any]]:
    torch.manual_seed(0)
    data = batches()
    chain, params = functionalize(MasksItsInput().double(), units=units, example_input=batches()[0][0])
    step = sw.train_step(chain, mse, sw.optim.sgd(0.1))
    if remat:
        step = sw.remat(step)  # recomputed in the backward: embed changes a fresh copy again
    state = step.init(params)
    for batch in data:
        state, _ = step(state, batch)
    return {name: t for layer in state.params.values() for name, t in layer.items()}, data


@pytest.mark.parametrize(("units", "remat"), [(UNITS, False), (UNITS, True), (None, True)],
                         ids=["split", "split-remat", "one-layer-remat"])
def test_a_model_changing_its_input_in_place_splits_and_trains_as_one_layer(units: Any, remat: bool) -> None:
    """Under remat, a layer's recomputation replays it on the input as it was (one layer, ``units=None``:
    torch's checkpoint failed with autograd's raw in-place error, the input changed already)."""
    (got, data), (expected, _) = trained(units, remat), trained(None)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], want) for name, want in expected.items())
    # The layers change copies: the batch is as it was given (the module changes the caller's tensor).
    assert all(torch.equal(x["features"], y["features"]) for (x, _), (y, _) in zip(data, batches(), strict=True))


def test_a_value_computed_from_the_changed_input_before_the_units_and_used_after_is_refused() -> None:
    """``head`` replays the code before the units on the input ``embed`` changed already, and changes it
    again with its own draws: what it computes there from it is not the module's value."""
    with pytest.raises(FunctionalizeError, match=r"after the last unit \(layer 'head'\).*input 'features'.*in place"):
        functionalize(MasksItsInput(early=True).double(), units=UNITS, example_input=batches()[0][0])


def test_a_unit_changing_the_input_in_place_is_refused_naming_it() -> None:
    with pytest.raises(FunctionalizeError, match=r"unit 'layers.0' changes the input's 'features' in place"):
        functionalize(ChangesInsideAUnit().double(), units=UNITS, example_input=batches()[0][0])
