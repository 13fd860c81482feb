"""The one-device step against torch's own training loop, bit for bit (shared by the tests of what a
forward does that only one device keeps as torch does: embedding options, writes into parameters)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw


def assert_one_device_equals_torch_sgd(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                                       lr: float = 0.1) -> dict[str, dict[str, torch.Tensor]]:
    """``model`` (a Sequential: its parameters' paths start with the layer's name) trained by the one-device
    step and by torch's SGD loop on ``batches`` with the MSE loss: losses and parameters bitwise equal. Returns
    the step's trained parameters (``full_params``) for a test's own further checks."""
    reference = copy.deepcopy(model)
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(lr))
    state, losses = step.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    opt = torch.optim.SGD(reference.parameters(), lr=lr)
    expected = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == expected
    full = step.full_params(state)
    for path, p in reference.named_parameters():
        layer, _, local = path.partition(".")
        assert torch.equal(full[layer][local], p), path
    return full
