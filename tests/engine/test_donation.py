"""An in-place optimizer consumes the TrainState it steps: stepping that state again is refused
(it would start from tensors a later update wrote), a functional one may be stepped again."""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp


def _problem(optimizer: Any) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, optimizer)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen, dtype=torch.float64),
                torch.randn(4, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    return step, params, batches


OPTIMIZERS = {
    "sgd": lambda inplace: sw.optim.sgd(0.1, inplace=inplace),
    "sgd_momentum": lambda inplace: sw.optim.sgd(0.1, momentum=0.9, inplace=inplace),
    "adamw": lambda inplace: sw.optim.adamw(1e-2, inplace=inplace),
}
STACKS = {
    "one_device": (lambda step: step, None),
    "zero1": (lambda step: sw.shard_params(step, "dp", stage=1), 2),
    "zero3": (lambda step: sw.shard_params(step, "dp", stage=3), 2),
}


def _run(stack: str, body: Any) -> list[Any]:
    wrap, world = STACKS[stack]
    if world is None:
        return [body(wrap, None)]
    return sw.launch(lambda: body(wrap, sw.Mesh(dp=world)), world)


# Plain SGD under ZeRO-1/2 updates shards cut (copied) from the full parameters and holds no state:
# stepping a state again is then right, and allowed. Everywhere else the update writes the state.
SAFE_AGAIN = {("sgd", "zero1")}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_stepping_a_consumed_state_again_is_refused_or_right(name: str, stack: str) -> None:
    def body(inplace: bool) -> Any:
        step, params, batches = _problem(OPTIMIZERS[name](inplace))

        def run(wrap: Any, mesh: Any) -> Any:
            s = wrap(step)
            first = s.init(params, mesh)
            second, _ = s(first, batches[0])
            third, _ = s(second, batches[1])  # the state the last call returned: fine
            try:
                again, _ = s(second, batches[2])
            except ValueError as refused:
                assert "(step 1) was consumed by an in-place update" in str(refused), refused
                with pytest.raises(ValueError, match=r"step 0\) was consumed"):
                    s(first, batches[2])
                s(third, batches[2])  # the live state still steps
                return "refused"
            return optree.tree_leaves(s.full_params(again))

        return _run(stack, run)

    in_place, functional = body(True), body(False)
    if (name, stack) in SAFE_AGAIN:
        assert all(torch.equal(x, y) for a, b in zip(in_place, functional, strict=True)
                   for x, y in zip(a, b, strict=True))
    else:
        assert in_place == ["refused"] * len(in_place), (name, stack)


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_functional_state_steps_again_alike(stack: str) -> None:
    step, params, batches = _problem(sw.optim.adamw(1e-2))

    def body(wrap: Any, mesh: Any) -> bool:
        s = wrap(step)
        state, _ = s(s.init(params, mesh), batches[0])
        a, _ = s(state, batches[1])
        b, _ = s(state, batches[1])  # the same state again: the same result
        return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(s.full_params(a)),
                                                     optree.tree_leaves(s.full_params(b)), strict=True))

    assert all(_run(stack, body))


def test_an_in_place_run_equals_the_functional_one() -> None:
    """The tags change nothing: in place and functional give the same parameters bitwise."""
    results = []
    for inplace in (False, True):
        step, params, batches = _problem(sw.optim.adamw(1e-2, inplace=inplace))
        state = step.init(params)
        for batch in batches:
            state, _ = step(state, batch)
        results.append(optree.tree_leaves(state.params))
    assert all(torch.equal(x, y) for x, y in zip(*results, strict=True))
