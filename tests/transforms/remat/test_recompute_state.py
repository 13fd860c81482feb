"""State a recomputed layer's forward leaves and its recomputation reads (transforms/remat/recompute_state.py).

The review (layers F4): truncated BPTT's ``self.hidden = (h.detach(), c.detach())`` under ``sw.remat`` alone, on one
device, trained on another gradient (grad_norm 4.0e-3 off at step 1) without an error: the recomputation started
from the state its forward left, and torch's checkpoint stops a recomputation before the write, so nothing
looked changed at the end of the step. A counter written after the layer's last op likewise. Refused now; state
set from the input's shape, and layers left out of remat, still train as torch's loop does.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_spec = importlib.util.spec_from_file_location(
    "_stateful_layers", Path(__file__).resolve().parents[2] / "engine" / "_stateful_layers.py")
assert _spec is not None and _spec.loader is not None
_stateful_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_stateful_layers)
_ShapeCache, _HiddenTuple = _stateful_layers.ShapeCache, _stateful_layers.HiddenTuple

POLICIES = {"nothing_saveable": sw.policies.nothing_saveable, "dots_saveable": sw.policies.dots_saveable}


class _CounterAtTheEnd(nn.Module):
    """A warm-up ramp whose counter is advanced after the layer's last op (a recomputation stops before it)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * min(1.0, (self.calls + 1) / 4)
        self.calls += 1
        return out


def _model(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), cls(4), nn.Tanh(), nn.Linear(4, 2)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 4, generator=g, dtype=torch.float64),
             torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(3)]


def _steps(cls: type[nn.Module], transform: Any) -> tuple[list[float], list[float]]:
    """The losses of the transformed step and of torch's loop (SGD), each from its own copy of the model."""
    model = _model(cls)
    chain, params = sw.functionalize(model)
    step = transform(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)))
    state, got = step.init(params), []
    for batch in _batches():
        state, metrics = step(state, batch)
        got.append(float(metrics["loss"]))
    torch_model, want = _model(cls), []
    opt = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad()
        loss = F.mse_loss(torch_model(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    return got, want


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize(("cls", "attributes"), [(_HiddenTuple, "['hidden']"), (_CounterAtTheEnd, "['calls']")])
def test_state_a_recomputation_would_read_is_refused(cls: type[nn.Module], attributes: str, policy: str) -> None:
    with pytest.raises(ValueError, match=rf"layer '1' changed its module's attributes {re.escape(attributes)} "
                                         r"during forward, "
                                         r"and a second call on the same input computes another output.*leave this "
                                         r"layer out of remat"):
        _steps(cls, lambda s: sw.remat(s, policy=POLICIES[policy]))


@pytest.mark.parametrize("cls", [_HiddenTuple, _CounterAtTheEnd, _ShapeCache])
def test_without_remat_of_that_layer_the_step_is_torchs(cls: type[nn.Module]) -> None:
    got, want = _steps(cls, lambda s: sw.remat(s, layers=["0", "3"]))
    assert got == pytest.approx(want, rel=1e-13)


def test_state_from_the_inputs_shape_passes_under_remat() -> None:
    got, want = _steps(_ShapeCache, sw.remat)
    assert got == pytest.approx(want, rel=1e-13)
