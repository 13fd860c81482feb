"""A one-device step with an in-place optimizer keeps its leaves and bound layers for the next step
(run/bindings.py): every step must be bitwise the step that binds afresh, which these tests run beside
it (the same steps with the bindings switched off)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.run.bindings import StageBindings
from shardwise.engine.run.executor import Executor
from shardwise.engine.step import run_inputs
from shardwise.testing.models import TinyGPT

Batch = tuple[torch.Tensor, torch.Tensor]


def _mlp() -> tuple[nn.Module, Callable[[Any, Any], torch.Tensor], list[Batch]]:
    torch.manual_seed(0)
    # Dropout draws from the seeded generators; the buffer of the norm is read in every step.
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 16), nn.LayerNorm(16),
                          nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(4)]
    return model, F.mse_loss, batches


def _gpt() -> tuple[nn.Module, Callable[[Any, Any], torch.Tensor], list[Batch]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8, tie_weights=True)  # a tied weight
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (2, 8), generator=gen), torch.randint(0, 32, (2, 8), generator=gen))
               for _ in range(4)]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, loss, batches


MODELS = {"mlp": _mlp, "gpt": _gpt}
OPTIMIZERS = {
    "sgd_momentum": lambda: sw.optim.sgd(0.05, momentum=0.9, inplace=True),
    "adamw": lambda: sw.optim.adamw(1e-2, inplace=True),
}


def _steps(model_name: str, optimizer: str, keep: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], int]:
    """Every step's loss, norm, parameters and optimizer state (copied), and how many steps found
    their bindings kept from the step before."""
    with monkeypatch.context() as patch:
        kept = [0]
        if keep:
            ready = StageBindings.ready_for

            def counting(self: StageBindings, chain: Any, compute: Any) -> bool:
                found = ready(self, chain, compute)
                kept[0] += found
                return found

            patch.setattr(StageBindings, "ready_for", counting)
        else:
            patch.setattr(run_inputs, "_bindings", lambda *args: None)
        module, loss_fn, batches = MODELS[model_name]()
        refuse = [False]

        def loss(output: Any, targets: Any) -> torch.Tensor:
            if refuse[0]:
                raise ValueError("refused on purpose")
            return loss_fn(output, targets)

        chain, params = sw.functionalize(module)
        step = sw.train_step(chain, loss, OPTIMIZERS[optimizer](), clip_norm=0.5)
        other_params = optree.tree_map(lambda t: t * 0.5, params)
        state, other = step.init(params), step.init(other_params)
        seen: list[Any] = []

        def record(state: Any, metrics: Any) -> None:
            seen.append([metrics["loss"].clone(), metrics["grad_norm"].clone(),
                         *[t.clone() for t in optree.tree_leaves((state.params, state.opt_state))]])

        for batch in batches[:2]:
            state, metrics = step(state, batch)
            record(state, metrics)
        other, metrics = step(other, batches[2])  # another state of the same layout: bound again
        record(other, metrics)
        refuse[0] = True
        with pytest.raises(ValueError, match="on purpose"):  # a step failing in its loss, after every layer ran
            step(state, batches[0])
        refuse[0] = False
        finish = Executor.finish_grads

        def failing(self: Executor, action: Any) -> None:
            raise RuntimeError("failed on purpose after the backward")

        patch.setattr(Executor, "finish_grads", failing)
        with pytest.raises(RuntimeError, match="after the backward"):  # gradients left in the leaves
            step(state, batches[1])
        patch.setattr(Executor, "finish_grads", finish)
        for batch in batches[2:]:
            state, metrics = step(state, batch)
            record(state, metrics)
        return seen, kept[0]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_kept_bindings_step_bitwise_as_fresh_ones(
    model_name: str, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, times_kept = _steps(model_name, optimizer, True, monkeypatch)
    fresh, _ = _steps(model_name, optimizer, False, monkeypatch)
    # Kept from step 1 to 2, and for the last step; the other state and the step after it bind again.
    assert times_kept >= 2, times_kept
    assert len(kept) == len(fresh) == 5
    for k, (a, b) in enumerate(zip(kept, fresh, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), f"step {k} differs"


def test_bindings_only_for_an_in_place_optimizer_on_one_device() -> None:
    module, loss_fn, batches = _mlp()
    chain, params = sw.functionalize(module)
    for inplace, expected in ((True, StageBindings), (False, type(None))):
        step = sw.train_step(chain, loss_fn, sw.optim.sgd(0.1, momentum=0.9, inplace=inplace))
        state = step.init(params)
        prepared = run_inputs.prepare_run(step, state, state.layout, batches[0])
        assert isinstance(prepared.executor.bindings, expected)
    # A precision policy makes new compute copies each step: nothing to keep.
    step = sw.mixed_precision(sw.train_step(chain, loss_fn, sw.optim.sgd(0.1, inplace=True)), "params=f32,compute=bf16")
    state = step.init(params)
    assert run_inputs.prepare_run(step, state, state.layout, batches[0]).executor.bindings is None


def test_kept_leaves_hold_no_gradient_between_steps() -> None:
    """The leaves kept for the next step drop this step's gradients (the optimizer has them): no
    gradient memory is held between steps, and the next backward writes fresh ones."""
    module, loss_fn, batches = _mlp()
    chain, params = sw.functionalize(module)
    step = sw.train_step(chain, loss_fn, sw.optim.sgd(0.1, momentum=0.9, inplace=True))
    state = step.init(params)
    state, _ = step(state, batches[0])
    found = [v for v in state.layout.cache.values() if isinstance(v, StageBindings)]
    assert len(found) == 1 and found[0].leaves
    leaves = dict(found[0].leaves)
    assert all(leaf.grad is None for leaf in leaves.values())
    state, _ = step(state, batches[1])
    assert all(found[0].leaves[k] is leaf for k, leaf in leaves.items())  # the same leaves served it
    assert all(leaf.grad is None for leaf in leaves.values())
