"""A checkpoint saved with some parameters frozen (``requires_grad=False``), loaded into a step that trains them (or
the reverse): the finetune review found it refused as "of another model", with no way on, though the checkpoint
holds every tensor (a frozen one beside the state). The refusal says what changed, and its way on works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.checkpoint.errors import CheckpointError


def _step(frozen: bool) -> tuple[sw.Step, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[0].weight.requires_grad_(not frozen)
    chain, params = sw.functionalize(model)
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("saved_frozen", "words"), [
    (True, r"was saved with \['0.weight'\] frozen \(requires_grad=False.*this step trains them"),
    (False, r"trained \['0.weight'\], which this step's model holds frozen"),
])
def test_the_refusal_says_what_changed_and_its_way_on_starts_from_the_weights(
        tmp_path: Path, saved_frozen: bool, words: str) -> None:
    before, params = _step(saved_frozen)
    state, _ = before(before.init(params), _batch())
    sw.checkpoint.save(tmp_path / "ck", state, before)
    weights = sw.checkpoint.full_state_dict(before, state)
    after, _ = _step(not saved_frozen)
    with pytest.raises(CheckpointError, match=words + r".*sw.checkpoint.init_from_dcp\(step, path, mesh, "
                                                      r"prefix='model.'\)"):
        sw.checkpoint.load(tmp_path / "ck", after)
    started = sw.checkpoint.init_from_dcp(after, tmp_path / "ck", prefix="model.")
    got = sw.checkpoint.full_state_dict(after, started)
    assert "0.weight" in weights and sorted(got) == sorted(weights)
    assert all(torch.equal(got[k], weights[k]) for k in weights)
