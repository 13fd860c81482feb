"""A loss that reads the parameters of the model given to functionalize (engine/run/loss_reads.py).

The review (layers F21): ``loss = mse(out, y) + lam * sum(p.pow(2).sum() for p in model.parameters())`` trained
without the penalty on one device (1e-2 in the loss, 3e-2 in a weight after three steps), without an error: the
step trains its own copies, and the given module keeps its initial values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("mesh", [None, "zero3 dp2"])
def test_a_penalty_over_the_given_models_parameters_is_refused_naming_one(mesh: str | None) -> None:
    model = _model()
    chain, params = sw.functionalize(model)

    def penalized(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) + 0.05 * sum(p.pow(2).sum() for p in model.parameters())

    step = sw.train_step(chain, penalized, sw.optim.sgd(0.1))
    if mesh is None:
        with pytest.raises(ValueError, match=r"loss_fn reads '0.weight', a parameter of the Sequential given to "
                                             r"functionalize.*weight_decay"):
            step(step.init(params), _batch())
        return
    zero3 = sw.shard_params(step, "dp", stage=3)

    def rank() -> Any:
        return zero3(zero3.init(params, sw.Mesh(dp=2)), _batch())

    with pytest.raises(sw.collectives.RankFailed, match=r"loss_fn reads '0.weight'"):
        sw.launch(rank, 2)


def test_a_loss_of_the_output_and_a_frozen_parameter_passes() -> None:
    """A frozen parameter (requires_grad=False) is a constant in torch's loop too."""
    model = _model()
    model[2].bias.requires_grad_(False)
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, lambda out, y: F.mse_loss(out + model[2].bias, y), sw.optim.sgd(0.1))
    _, metrics = step(step.init(params), _batch())
    x, y = _batch()
    assert float(metrics["loss"]) == pytest.approx(F.mse_loss(model(x) + model[2].bias, y).item(), rel=1e-12)


def test_reading_a_parameters_device_dtype_or_shape_is_no_read() -> None:
    """The review: `labels.to(model.device)` (transformers' model.device reads next(parameters()).device) and
    a parameter's dtype, shape or numel were refused as reads of its values."""
    model = _model()
    chain, params = sw.functionalize(model)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = model[2].weight
        return F.mse_loss(out.view(-1, w.shape[0]), y.to(w.device, w.dtype)) * (w.numel() / w.numel())

    step = sw.train_step(chain, loss, sw.optim.sgd(0.1))
    _, metrics = step(step.init(params), _batch())
    x, y = _batch()
    assert float(metrics["loss"]) == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-12)


def test_a_teacher_of_its_own_and_a_reference_under_no_grad_pass() -> None:
    """Another model given to functionalize (a teacher with a step of its own) is not this step's; the given module
    read under torch.no_grad() (the initial model as a reference, on purpose) computes no gradient."""
    teacher, student = _model(), _model()
    sw.functionalize(teacher)
    chain, params = sw.functionalize(student)

    def distilled(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            reference = student(_batch()[0])
        return F.mse_loss(out, y) + F.mse_loss(out, teacher(_batch()[0]).detach()) + F.mse_loss(out, reference)

    step = sw.train_step(chain, distilled, sw.optim.sgd(0.1))
    _, metrics = step(step.init(params), _batch())
    assert torch.isfinite(metrics["loss"])
