"""sw.optim's optimizers and schedules pickle (the processes backend sends the step to every
rank), and the unpickled optimizer updates bitwise as the original."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp

SCHEDULES: dict[str, Callable[[], object]] = {
    "float": lambda: 0.1,
    "constant": lambda: sw.optim.constant(0.1),
    "linear": lambda: sw.optim.linear(0.1, 0.01, 10),
    "linear_warmup": lambda: sw.optim.linear_warmup(0.1, 3),
    "cosine_decay": lambda: sw.optim.cosine_decay(0.1, 10, alpha=0.1),
    "warmup_cosine": lambda: sw.optim.warmup_cosine(0.1, 2, 10),
    "join": lambda: sw.optim.join([sw.optim.constant(0.1), sw.optim.linear(0.1, 0.0, 5)], [3]),
}
OPTIMIZERS: dict[str, Callable[[object], sw.optim.Optimizer]] = {
    "sgd": lambda lr: sw.optim.sgd(lr),
    "sgd-momentum-nesterov-decay": lambda lr: sw.optim.sgd(lr, momentum=0.9, weight_decay=0.01, nesterov=True),
    "sgd-inplace": lambda lr: sw.optim.sgd(lr, momentum=0.9, inplace=True),
    "adamw": lambda lr: sw.optim.adamw(lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "adamw-inplace": lambda lr: sw.optim.adamw(lr, inplace=True),
}


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(3, 4), "b": torch.randn(4)}


def _run(opt: sw.optim.Optimizer, steps: int = 4) -> dict[str, torch.Tensor]:
    params = _params()
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        params, state = opt.update(grads, state, params)
    return params


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizer_round_trips_through_pickle_and_updates_bitwise_the_same(optimizer: str, schedule: str) -> None:
    original = OPTIMIZERS[optimizer](SCHEDULES[schedule]())
    restored = pickle.loads(pickle.dumps(original))
    assert restored == original  # frozen dataclasses compare by their hyperparameters
    got, expected = _run(restored), _run(original)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not torch.equal(expected["w"], _params()["w"])  # it did update


def test_assert_equivalent_on_processes_with_the_librarys_optimizer() -> None:
    """Before the optimizers were module-level classes this failed: Can't pickle local object
    'sgd.<locals>.init'. World 2 of gloo processes, ZeRO-3, SGD with momentum and a schedule."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([3, 5, 2]).double())
    opt = sw.optim.sgd(sw.optim.warmup_cosine(0.1, 1, 4), momentum=0.9)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, opt)
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64))
        for _ in range(2)
    ]
    report = sw.testing.assert_equivalent(
        sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params, backend="processes", timeout=60
    )
    assert report.steps == 2
