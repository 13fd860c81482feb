"""In-place optimizers: bitwise the out-of-place results, written into the state they were given."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp

FACTORIES = {
    "sgd": lambda inplace: sw.optim.sgd(0.1, inplace=inplace),
    "sgd momentum": lambda inplace: sw.optim.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, inplace=inplace),
    "sgd nesterov": lambda inplace: sw.optim.sgd(0.1, momentum=0.9, nesterov=True, inplace=inplace),
    "adamw": lambda inplace: sw.optim.adamw(1e-2, inplace=inplace),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_inplace_update_is_bitwise_the_pure_one_and_reuses_the_tensors(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    params = {
        "a": {"w": torch.randn(3, 4, generator=gen)},
        "b": {"v": torch.randn(5, generator=gen, dtype=torch.float64)},
    }
    pure, inplace = FACTORIES[name](False), FACTORIES[name](True)
    p1 = {k: {n: t.clone() for n, t in v.items()} for k, v in params.items()}
    p2 = {k: {n: t.clone() for n, t in v.items()} for k, v in params.items()}
    s1, s2 = pure.init(p1), inplace.init(p2)
    for _ in range(5):
        grads = {
            k: {n: torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in v.items()} for k, v in params.items()
        }
        before = p2["a"]["w"]
        p1, s1 = pure.update(grads, s1, p1)
        p2, s2 = inplace.update(grads, s2, p2)
        assert p2["a"]["w"] is before  # written into the given tensor
        for layer in params:
            for n in params[layer]:
                assert torch.equal(p1[layer][n], p2[layer][n])


STEPS = {
    "single": lambda s: s,
    "zero1": lambda s: sw.shard_params(s, "dp", 1),
    "zero3": lambda s: sw.shard_params(s, "dp", 3, accumulation=2),
    "pipeline": lambda s: sw.pipeline(s, "pp", "1f1b", 2),
}


@pytest.mark.parametrize("kind", sorted(STEPS))
def test_steps_with_an_inplace_optimizer_match_the_pure_ones_exactly(kind: str) -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 6, 2]).double())
    kept = {k: {n: t.clone() for n, t in v.items()} for k, v in params.items()}
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
                torch.randn(8, 2, generator=gen, dtype=torch.float64)) for _ in range(3)]
    make = lambda inplace: STEPS[kind](  # noqa: E731
        sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2, inplace=inplace)))
    mesh = sw.Mesh(pp=2) if kind == "pipeline" else sw.Mesh(dp=2)

    def run(inplace: bool) -> list:
        step = make(inplace)
        return sw.testing.record_history(step, step.init(params, mesh), batches)

    pure = sw.launch(lambda: run(False), 2)
    sw.testing.compare_histories(sw.launch(lambda: run(True), 2), pure[0], rtol=0.0)
    for layer, tensors in params.items():  # init copied them: the caller's params are untouched
        for n, t in tensors.items():
            assert torch.equal(t, kept[layer][n])
