"""Micro-batches' gradients under a precision policy that computes in bf16 and reduces in float32.

Torch sums a second backward into a leaf's ``.grad`` in the leaf's dtype, and the leaves are the bf16 compute
copies: with ``accumulation=16`` each micro-batch's gradient was rounded to bf16 again as it was added, and the
gradient came out 7.7e-3 (relative to its largest element) from the float32 sum of the micro-batches' bf16
gradients (ZeRO-3's micro-batch shares, reduced in float32, were summed in bf16 likewise: 1.1e-2 at 8). Now they are
summed in the policy's ``reduce`` dtype, which the reduction sends and the update reads (engine/run/wide_grads.py,
run/zero.py), as FSDP2's ``reduce_dtype`` accumulates. The reference here does that arithmetic by hand, and the
step's gradient (read back through SGD with lr 1) equals it to float32's rounding (sums in another order, and the
read-back).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardwise as sw

D, OUT, BATCH = 32, 4, 64
POLICY = "params=f32,compute=bf16,output=f32,reduce=f32"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, OUT))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def _reference(world: int, microbatches: int) -> list[torch.Tensor]:
    """Each micro-batch's gradient made in bf16 (bf16 copies of the float32 weights, each layer's output in
    float32), summed in float32 over the micro-batches and the ranks (in whichever order: float32's rounding)."""
    model, (x, y) = _model(), _batch()

    def forward(h: torch.Tensor) -> torch.Tensor:
        for layer in model:
            weights = {n: p.to(torch.bfloat16) for n, p in layer.named_parameters()}
            h = torch.func.functional_call(layer, weights, (h.to(torch.bfloat16),)).to(torch.float32)
        return h

    total: list[torch.Tensor] | None = None
    for xr, yr in zip(x.chunk(world), y.chunk(world), strict=True):
        for xs, ys in zip(xr.chunk(microbatches), yr.chunk(microbatches), strict=True):
            loss = nn.functional.mse_loss(forward(xs), ys) / (world * microbatches)
            grads = [g.to(torch.float32) for g in torch.autograd.grad(loss, list(model.parameters()))]
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    assert total is not None
    return total


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(("world", "stage", "microbatches"), [(1, 1, 16), (2, 2, 8), (2, 3, 8), (1, 3, 16)])
def test_micro_batches_are_summed_in_the_reduce_dtype(
        world: int, stage: int, microbatches: int) -> None:
    chain, params = sw.functionalize(_model())
    step = sw.mixed_precision(sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(1.0)), POLICY)
    sharded = sw.shard_params(step, "dp", stage=stage, accumulation=microbatches)
    batch = _batch()

    def run() -> dict[str, dict[str, torch.Tensor]]:
        state = sharded.init(copy.deepcopy(params), sw.Mesh(dp=world))
        return sharded.full_params(sharded(state, batch)[0])

    after = sw.launch(run, world=world)[0]
    before = [p for layer in params.values() for p in layer.values()]
    got = [b - a for b, a in zip(before, [p for layer in after.values() for p in layer.values()], strict=True)]
    assert _relative(got, _reference(world, microbatches)) < 1e-6  # (was 6.4e-3 to 1.1e-2)


def test_a_pipelines_micro_batches_are_summed_in_the_reduce_dtype() -> None:
    """The same on a pipeline's stages (2 ranks, 16 micro-batches): each stage's leaves held the bf16 sum (7.7e-3)."""
    model = _model()
    chain, params = sw.functionalize(model, units=["0", "2"])
    step = sw.mixed_precision(sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(1.0)), POLICY)
    piped = sw.pipeline(step, "pp", "1f1b", microbatches=16)
    batch = _batch()

    def run() -> dict[str, dict[str, torch.Tensor]]:
        state = piped.init(copy.deepcopy(params), sw.Mesh(pp=2))
        return piped.full_params(piped(state, batch)[0])

    after = sw.launch(run, world=2)[0]
    before = [p for layer in params.values() for p in layer.values()]
    got = [b - a for b, a in zip(before, [p for layer in after.values() for p in layer.values()], strict=True)]
    assert _relative(got, _reference(1, 16)) < 1e-6  # (was 7.7e-3)


@pytest.mark.parametrize(("stage", "world", "microbatches"), [(2, 2, 1), (2, 2, 2), (3, 2, 1), (3, 2, 2), (1, 1, 4)])
@pytest.mark.parametrize("scale", [64.0, 128.0])
def test_an_f16_gradient_skips_the_step_where_one_device_skips_it_whatever_the_layout(
        stage: int, world: int, microbatches: int, scale: float) -> None:
    """A whole-batch gradient of 51200 x (scale / 64): finite in f16 at 64, infinite at 128, where one device skips
    the step. The review found the step taken at dp 2 (ZeRO-2; ZeRO-3 without accumulation), each rank's half
    finite in f16 and their sum made in f32 never marked; the reduced sum is read against the dtype the
    gradients were made in now, as a micro-batches' sum is."""
    model = nn.Sequential(nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.01)
    chain, params = sw.functionalize(model)
    step = sw.mixed_precision(sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(1e-6)),
                              "params=f32,compute=f16,output=f32,reduce=f32", loss_scale=scale)
    batch = (torch.full((8, 4), 100.0), torch.zeros(8, 1))
    one_device = bool(step(step.init(copy.deepcopy(params)), batch)[1]["skipped"])
    assert one_device == (scale == 128.0)
    sharded = sw.shard_params(step, "dp", stage, accumulation=microbatches)

    def run() -> bool:
        return bool(sharded(sharded.init(copy.deepcopy(params), sw.Mesh(dp=world)), batch)[1]["skipped"])

    assert sw.launch(run, world=world) == [one_device] * world
