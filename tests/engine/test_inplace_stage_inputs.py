"""A layer that writes into its input in place, first in a stage whose input is a leaf of its own (ZeRO-3's stages, a
pipeline's): refused naming the layer and inplace=False, not torch's leaf error from inside the step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw


def _vgg_features(inplace: bool) -> nn.Sequential:
    """torchvision's VGG / AlexNet features as they are written: ReLU(inplace=True) a child of its own."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=inplace), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=inplace), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10)).double()


def _batches() -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 8, 8, generator=gen, dtype=torch.float64), torch.randint(10, (8,), generator=gen))
            for _ in range(2)]


CUTS = {
    "zero-3 dp=2": (lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2)),
    "pipeline pp=2": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2)),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_an_in_place_relu_first_in_a_stage_is_refused_and_trains_out_of_place(cut: str) -> None:
    """Found by session 41's probing: torch's "a leaf Variable that requires grad is being used in an in-place
    operation", from deep inside the step, naming neither the layer nor the fix."""
    transform, mesh = CUTS[cut]
    chain, params = sw.functionalize(_vgg_features(inplace=True))
    step = sw.train_step(chain, F.cross_entropy, sw.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(sw.collectives.RankFailed, match=r"layer '[14]' writes into its input in place.*the first "
                       r"layer of a stage \(stage \d\).*inplace=False: the same values"):
        sw.testing.assert_equivalent(transform(step), step, mesh, _batches(), params)
    chain, params = sw.functionalize(_vgg_features(inplace=False))
    step = sw.train_step(chain, F.cross_entropy, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(transform(step), step, mesh, _batches(), params)
