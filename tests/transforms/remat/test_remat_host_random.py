"""remat's recomputation replays what a layer drew from numpy's global generator and Python's ``random``.

torch's checkpoint restores only torch's generators for the recomputation. A layer drawing a mask with
``np.random`` or a LayerDrop decision with ``random.random()`` drew other numbers in backward than in
forward before, and the gradient was that of another forward, without an error. Now the recomputation
starts from the state the forward found and leaves the backward's own state as it was: remat's steps
are bitwise the steps without it (float64), with every policy and under a zero-bubble schedule, whose
two backward passes recompute the layer twice.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.transforms.remat import dots_saveable, everything_saveable, nothing_saveable, remat


class NumpyMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5).to(x.dtype)
        return self.fc(x) * keep


class LayerDrop(nn.Module):
    """Skips its residual block with probability 0.5, decided with ``random.random()``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if random.random() < 0.5 else x + torch.tanh(self.fc(x))


class _NoisyGrad(torch.autograd.Function):
    """Identity in forward; backward scales the gradient by a factor drawn with ``random.random()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * (1.0 + random.random())


class NoisyBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoisyGrad.apply(self.fc(x))


def _problem() -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = nn.Sequential(NoisyBackward(), NumpyMask(), LayerDrop(), LayerDrop(), nn.Linear(6, 2)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64))
        for _ in range(4)
    ]
    return step, params, batches


def _run(step: sw.Step, params: dict, batches: list, mesh: sw.Mesh | None = None) -> list[torch.Tensor]:
    state = step.init(params, mesh)
    for b in batches:
        state, _ = step(state, b)
    return optree.tree_leaves(step.full_params(state))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("policy", [nothing_saveable, dots_saveable], ids=["nothing_saveable", "dots_saveable"])
def test_remat_replays_the_host_draws_of_the_forward(policy: Any) -> None:
    """The backward of the first layer draws from Python's random after the layers above it were
    recomputed: it draws what it draws without remat (the backward's own stream, left as it was)."""
    step, params, batches = _problem()
    plain = _run(step, params, batches)
    assert _equal(_run(remat(step, policy), params, batches), plain)
    assert _equal(_run(remat(step, policy, layers=["1", "2"]), params, batches), plain)


def test_a_zero_bubble_schedule_recomputes_twice_from_the_forwards_draws() -> None:
    step, params, batches = _problem()
    mesh = sw.Mesh(pp=2)
    piped = sw.pipeline(step, "pp", "zb_h1", 2)
    expected = sw.launch(lambda: _run(piped, params, batches, mesh), 2)
    got = sw.launch(lambda: _run(remat(piped), params, batches, mesh), 2)
    assert all(_equal(a, b) for a, b in zip(got, expected, strict=True))


class _OwnGenerator(nn.Module):
    """Draws a LayerDrop decision from a generator object it holds (``draw=False``: holds it, draws nothing)."""

    def __init__(self, rng: Any, draw: bool = True) -> None:
        super().__init__()
        self.fc, self.rng, self.draw = nn.Linear(4, 4), rng, draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.draw and self.rng.random() < 0.5:
            return x
        return x + torch.tanh(self.fc(x))


@pytest.mark.parametrize("make", [lambda: random.Random(0), lambda: np.random.default_rng(0),
                                  lambda: np.random.RandomState(0)], ids=["Random", "Generator", "RandomState"])
def test_a_layer_drawing_from_a_generator_object_of_its_own_is_refused_under_remat(make: Any) -> None:
    """Its recomputation would draw the object's next numbers: refused, naming the layer and the attribute.
    Without remat, under everything_saveable (nothing recomputed), and under remat when it holds one but
    draws nothing, the step runs."""
    torch.manual_seed(0)
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64))
    for draw in (True, False):
        chain, params = sw.functionalize(nn.Sequential(nn.Linear(4, 4), _OwnGenerator(make(), draw)).double())
        step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
        step(step.init(params), batch)
        if not draw:
            remat(step)(remat(step).init(params), batch)
            continue
        saving = remat(step, everything_saveable)  # recomputes nothing: not refused
        saving(saving.init(params), batch)
        with pytest.raises(ValueError, match=r"layer '1' draws from a random generator object of its own "
                                             r"\(_OwnGenerator\.rng\).*Draw from the global ones"):
            remat(step)(remat(step).init(params), batch)
        zero3, mesh = remat(sw.shard_params(step, "dp", 3)), sw.Mesh(dp=2)  # rank threads: each its own copy
        with pytest.raises(sw.collectives.RankFailed, match=r"draws from a random generator object of its own"):
            sw.launch(lambda z=zero3, p=params, m=mesh: z(z.init(p, m), batch), 2)


_GLOBAL_GENERATORS: dict[str, Any] = {}


class _HeldElsewhere(nn.Module):
    """Draws from a numpy Generator held in a list, on a plain helper object, or by a global name."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc, self.where = nn.Linear(4, 4), where
        self.rngs = [np.random.default_rng(0)]
        self.helper = type("Helper", (), {})()
        self.helper.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rng = {"list": self.rngs[0], "helper": self.helper.rng, "global": _GLOBAL_GENERATORS.get("rng")}[self.where]
        keep = torch.from_numpy(rng.random(x.shape) > 0.5).to(x.dtype)
        return x + torch.tanh(self.fc(x)) * keep


@pytest.mark.parametrize(("where", "named"), [("list", r"_HeldElsewhere\.rngs\[0\]"),
                                              ("helper", r"_HeldElsewhere\.helper\.rng"),
                                              ("global", r"global [\w.]+\._GLOBAL_GENERATORS\['rng'\]")])
def test_a_generator_object_held_in_a_container_a_helper_or_a_global_is_refused_too(where: str, named: str) -> None:
    """A review's cases: remat recomputed with the object's next numbers, a gradient of another forward
    (losses apart from step 2), where only a generator held as an attribute was seen."""
    _GLOBAL_GENERATORS["rng"] = np.random.default_rng(0)
    torch.manual_seed(0)
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64))
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(4, 4), _HeldElsewhere(where)).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=rf"draws from a random generator object of its own \({named}\)"):
        remat(step)(remat(step).init(params), batch)


class _Draws(nn.Module):
    """A LayerDrop whose draw is made on every call (its effect only sometimes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if random.random() < 0.5 else x + self.fc(x)


@pytest.mark.parametrize("draws", [False, True])
def test_the_host_state_is_saved_each_step_only_for_layers_whose_forward_drew(
    draws: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving and comparing numpy's and Python's state for every remat'd layer cost a 6-block GPT's remat step
    2.6%, every step: a layer whose watched forward drew nothing is not saved for again; one that drew is."""
    from shardwise.engine.model import host_random

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), _Draws() if draws else nn.Tanh()), nn.Linear(4, 4)]
    chain, params = sw.functionalize(nn.Sequential(*layers).double())
    step = remat(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)))
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64))
    state, _ = step(step.init(params), batch)  # the watched first forward
    captured = []
    real = host_random.capture
    monkeypatch.setattr(host_random, "capture", lambda: captured.append(1) or real())
    step(state, batch)
    assert bool(captured) == draws
