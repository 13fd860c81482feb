"""A float16 loss computed inside the model under a loss scale that float16 cannot hold (the default dynamic 65536):
the single-device step's seed is inf and its step skips; every layout's does too.

A step that cuts the batch into k parts seeds each part's loss with scale / k, which float16 holds (32768 at dp 2):
the step one device skips was applied at dp 2, in a pipeline and under accumulation, and the parameters parted
(0.86 after 3 steps, no error; nanoGPT returns its own loss). Under a static scale one device never trained, and
dp 2 trained every step: refused now, naming the fixes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw


class _OwnLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
        self.b = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.b(self.a(x)), y)


POLICY = "params=f32,compute=f16,output=f32"


def _setup() -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batches = [({"x": torch.randn(8, 6, generator=gen), "y": torch.randn(8, 3, generator=gen)}, None) for _ in range(3)]
    chain, params = sw.functionalize(_OwnLoss(), units=["a", "b"], example_input=batches[0][0])
    return sw.train_step(chain, lambda out, _: out, sw.optim.sgd(0.1, momentum=0.9)), params, batches


LAYOUTS = {
    "dp2": (lambda s: sw.shard_params(s, "dp", 1), lambda: sw.Mesh(dp=2)),
    "pp2 2 micro-batches": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), lambda: sw.Mesh(pp=2)),
    "accumulation 2": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2), lambda: sw.Mesh(dp=1)),
}


def _skips(step: sw.Step, mesh: sw.Mesh | None, params: Any, batches: list[Any]) -> list[tuple[bool, float]]:
    def run() -> list[tuple[bool, float]]:
        state = step.init(params) if mesh is None else step.init(params, mesh)
        out = []
        for batch in batches:
            state, metrics = step(state, batch)
            out.append((bool(metrics["skipped"]), float(state.loss_scale.scale)))
        return out

    return run() if mesh is None else sw.launch(run, mesh.size)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_skips_where_one_devices_float16_loss_seed_overflows(layout: str) -> None:
    step, params, batches = _setup()
    one = _skips(sw.mixed_precision(step, POLICY, loss_scale="dynamic"), None, params, batches)
    assert one == [(True, 32768.0), (False, 32768.0), (False, 32768.0)]
    transform, mesh = LAYOUTS[layout]
    assert _skips(sw.mixed_precision(transform(step), POLICY, loss_scale="dynamic"), mesh(), params, batches) == one


@pytest.mark.parametrize("layout", [None, "dp2"])
def test_a_static_scale_a_float16_loss_cannot_hold_is_refused(layout: str | None) -> None:
    step, params, batches = _setup()
    transform, mesh = LAYOUTS[layout] if layout else (lambda s: s, lambda: None)
    static = sw.mixed_precision(transform(step), POLICY, loss_scale=65536.0)
    with pytest.raises((ValueError, sw.collectives.RankFailed),
                       match=r"the loss is torch.float16 .* static loss scale 65536 is not finite in torch.float16.*"
                             r"every step would be skipped"):
        _skips(static, mesh(), params, batches)
    assert _skips(sw.mixed_precision(transform(step), POLICY, loss_scale=32768.0), mesh(), params, batches)[0][0] \
        is False
