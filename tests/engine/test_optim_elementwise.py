"""A user's optimizer where a transform hands its update pieces of parameters: declared elementwise, or refused.

ZeRO (every stage) updates one flat 1-D shard per layer, tensor and expert parallel each rank's slices.
An update that reads a whole tensor (LARS's trust ratio: each parameter's norm; weight decay only where
``p.dim() >= 2``) computed another step on those pieces and trained on without an error (relative
errors of 0.03 to 0.07 on the first step): now refused when the transform is applied. Where every
parameter stays whole (one device, a pipeline, context parallel) any optimizer is taken. float64 on
thread ranks: an elementwise one equals the single-device step to rounding (assert_equivalent's
float64 default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.optim.optimizers import is_elementwise
from shardwise.testing.models import MoEBlock, TinyGPT, mlp


class Lars:
    """Per-tensor trust ratio (LARS): the step of each parameter scaled by ``|p| / |g|``."""

    def init(self, params: Any) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64)

    @torch.no_grad()
    def update(self, grads: Any, state: torch.Tensor, params: Any) -> tuple[Any, torch.Tensor]:
        return optree.tree_map(lambda p, g: p - 0.1 * p.norm() / (g.norm() + 1e-12) * g, params, grads), state + 1


class DecayMatrices:
    """SGD decaying only the weights with ``p.dim() >= 2`` (nanoGPT's rule, read off each tensor)."""

    def init(self, params: Any) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64)

    @torch.no_grad()
    def update(self, grads: Any, state: torch.Tensor, params: Any) -> tuple[Any, torch.Tensor]:
        return optree.tree_map(lambda p, g: p - 0.1 * (g + (0.5 * p if p.dim() >= 2 else 0)), params, grads), state + 1


class Momentum:
    """A user's elementwise optimizer (heavy-ball momentum), which says so."""

    elementwise = True

    def init(self, params: Any) -> dict[str, Any]:
        return {"step": torch.zeros((), dtype=torch.int64), "buf": optree.tree_map(torch.zeros_like, params)}

    @torch.no_grad()
    def update(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        bufs = optree.tree_map(lambda b, g: 0.9 * b + g, state["buf"], grads)
        return optree.tree_map(lambda p, b: p - 0.1 * b, params, bufs), {"step": state["step"] + 1, "buf": bufs}


PER_TENSOR: dict[str, Callable[[], Any]] = {"lars": Lars, "decay p.dim() >= 2": DecayMatrices}
TP_PLAN = {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}
# The transforms that hand the update pieces, and what the error says it gets.
PIECES: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh, str]] = {
    "ZeRO-1": (lambda s: sw.shard_params(s, "dp", 1), sw.Mesh(dp=2), "one flat 1-D shard per layer"),
    "ZeRO-2": (lambda s: sw.shard_params(s, "dp", 2), sw.Mesh(dp=2), "one flat 1-D shard per layer"),
    "ZeRO-3": (lambda s: sw.shard_params(s, "dp", 3), sw.Mesh(dp=2), "one flat 1-D shard per layer"),
    "pp x ZeRO-1": (lambda s: sw.shard_params(sw.pipeline(s, "pp", "gpipe", 2), "dp", 1), sw.Mesh(dp=2, pp=2),
                    "one flat 1-D shard per layer"),
    "tensor_parallel": (lambda s: sw.tensor_parallel(s, "tp", TP_PLAN), sw.Mesh(tp=2), "slices of the parameters"),
}
# Stacks that hand it whole parameters (each stage's, under a pipeline): any optimizer.
WHOLE: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "pipeline": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2)),
    "remat + mixed_precision": (lambda s: sw.remat(sw.mixed_precision(s, "params=f64,compute=f64")), sw.Mesh(world=1)),
}


def _problem(optimizer: Any) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 2]).double())
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
                torch.randn(8, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return sw.train_step(chain, F.mse_loss, optimizer), params, batches


@pytest.mark.parametrize("optimizer", sorted(PER_TENSOR))
@pytest.mark.parametrize("stack", list(PIECES))
def test_a_per_tensor_optimizer_is_refused_where_its_update_gets_pieces(stack: str, optimizer: str) -> None:
    step, _, _ = _problem(PER_TENSOR[optimizer]())
    transform, _, pieces = PIECES[stack]
    name = type(step.optimizer).__qualname__
    with pytest.raises(ValueError, match=rf"hands the optimizer's update .*{pieces}.* not whole parameters, and the "
                                         rf"optimizer {name} does not say it is elementwise(.|\n)*p.dim\(\) >= 2"
                                         r"(.|\n)*elementwise = True on the optimizer(.|\n)*sw.optim.sgd"):
        transform(step)


def test_expert_parallel_hands_slices_of_the_experts() -> None:
    torch.manual_seed(0)
    chain, _ = sw.functionalize(nn.Sequential(nn.Linear(6, 8), MoEBlock(8, 2, 4, 4, 2), nn.Linear(8, 3)).double())
    with pytest.raises(ValueError, match=r"expert_parallel\(.*\) hands the optimizer's update this rank's slices of "
                                         r"the stacked expert weights(.|\n)*optimizer Lars does not say"):
        sw.expert_parallel(sw.train_step(chain, F.mse_loss, Lars()), "ep")


@pytest.mark.parametrize("stack", list(WHOLE))
def test_a_per_tensor_optimizer_is_taken_where_parameters_stay_whole(stack: str) -> None:
    step, params, batches = _problem(Lars())
    transform, mesh = WHOLE[stack]
    sw.testing.assert_equivalent(transform(step), step, mesh, batches, params)


def test_context_parallel_hands_whole_parameters() -> None:
    torch.manual_seed(0)
    chain, _ = sw.functionalize(TinyGPT(vocab=16, d_model=16, n_heads=4, n_layers=1, seq_len=8).double(),
                                units=["tok_emb", "blocks", "head"])
    sw.context_parallel(sw.train_step(chain, F.mse_loss, Lars()), "cp")


@pytest.mark.parametrize("stack", ["ZeRO-1", "ZeRO-3", "tensor_parallel"])
def test_a_users_elementwise_optimizer_equals_the_single_device_step(stack: str) -> None:
    step, params, batches = _problem(Momentum())
    transform, mesh, _ = PIECES[stack]
    sw.testing.assert_equivalent(transform(step), step, mesh, batches, params)


def test_a_functional_optimizer_declares_it_as_a_field() -> None:
    plain = sw.optim.sgd(0.1, momentum=0.9)

    def update(grads: Any, state: Any, params: Any) -> Any:
        return plain.update(grads, state, params)

    step, params, batches = _problem(sw.optim.Optimizer(plain.init, update, elementwise=True))
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
    with pytest.raises(ValueError, match=r"optimizer sw.optim.Optimizer\(update=.*update\) does not say"):
        sw.shard_params(dataclasses.replace(step, optimizer=sw.optim.Optimizer(plain.init, update)), "dp", 3)


@pytest.mark.parametrize("make", [
    lambda: sw.optim.sgd(0.1),
    lambda: sw.optim.sgd(sw.optim.warmup_cosine(0.1, 2, 10), momentum=0.9, nesterov=True, inplace=True),
    lambda: sw.optim.adamw(1e-3, groups=[sw.optim.group(where=lambda name, p: p.dim() < 2, weight_decay=0.0)]),
    lambda: sw.optim.Optimizer(sw.optim.adamw(1e-3).init, sw.optim.adamw(1e-3).update),  # a built-in's functions
], ids=["sgd", "sgd schedule nesterov inplace", "adamw groups", "Optimizer of adamw's functions"])
def test_sw_optims_optimizers_are_elementwise_under_every_transform(make: Callable[[], Any]) -> None:
    assert is_elementwise(make())
    step, _, _ = _problem(make())
    for transform, _, _ in PIECES.values():
        transform(step)


def test_an_optimizer_replaced_after_the_transform_is_refused_at_init() -> None:
    step, params, _ = _problem(sw.optim.sgd(0.1))
    replaced = dataclasses.replace(sw.shard_params(step, "dp", 1), optimizer=Lars())
    with pytest.raises(ValueError, match="optimizer Lars does not say it is elementwise"):
        replaced.init(params, sw.Mesh(dp=1))


def test_elementwise_is_a_bool() -> None:
    class Says(Momentum):
        elementwise = "yes"  # type: ignore[assignment]

    step, _, _ = _problem(Says())
    with pytest.raises(TypeError, match=r"optimizer.elementwise: a bool .* got str 'yes'"):
        sw.shard_params(step, "dp", 1)
