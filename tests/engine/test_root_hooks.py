"""Hooks on the model itself, which a split model never runs (engine/model/root_hooks.py).

The review (layers F20): a forward pre-hook, a forward hook or a full backward pre-hook registered on an
``nn.Sequential`` (or on a model split with ``units=``), or a forward set on the instance, were dropped by the
split, and the one-device step trained another model than torch's loop (0.13 of the loss, 0.56 split per unit).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

HOOKS: dict[str, Callable[[nn.Module], object]] = {
    "forward pre-hook": lambda m: m.register_forward_pre_hook(lambda mod, args: (args[0] * 3.0,)),
    "forward hook": lambda m: m.register_forward_hook(lambda mod, args, out: out * 3.0),
    "backward pre-hook": lambda m: m.register_full_backward_pre_hook(lambda mod, grad: (grad[0] * 3.0,)),
}


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()


@pytest.mark.parametrize("hook", list(HOOKS))
def test_a_hook_on_a_split_model_itself_is_refused_naming_it(hook: str) -> None:
    model = _sequential()
    HOOKS[hook](model)
    with pytest.raises(sw.FunctionalizeError, match=rf"Sequential has {hook} .*on the model itself.*would not run"):
        sw.functionalize(model)
    blocks = Blocks().double()
    HOOKS[hook](blocks)
    with pytest.raises(sw.FunctionalizeError, match=rf"Blocks has {hook} "):
        sw.functionalize(blocks, units=nn.Linear, example_input=torch.randn(2, 4, dtype=torch.float64))


def test_a_forward_set_on_the_instance_is_refused() -> None:
    model = _sequential()
    plain = model.forward
    model.forward = types.MethodType(lambda self, x: plain(x) * 3.0, model)  # type: ignore[method-assign]
    with pytest.raises(sw.FunctionalizeError, match=r"a forward set on the instance"):
        sw.functionalize(model)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed:UserWarning")
@pytest.mark.parametrize("hook", list(HOOKS))
def test_the_same_hook_on_a_layer_or_on_a_model_kept_whole_trains_as_torch(hook: str) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g,
                                                                                  dtype=torch.float64))
               for _ in range(2)]
    for kept_whole in (False, True):
        def build(kept_whole: bool = kept_whole) -> nn.Module:
            model = Blocks().double() if kept_whole else _sequential()
            HOOKS[hook](model if kept_whole else model[0])
            return model

        chain, params = sw.functionalize(build())
        step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
        state, got = step.init(params), []
        for batch in batches:
            state, metrics = step(state, batch)
            got.append(float(metrics["loss"]))
        reference, want = build(), []
        torch.manual_seed(0)
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        reference.load_state_dict(sw.checkpoint.full_state_dict(step, step.init(params)))
        for x, y in batches:
            opt.zero_grad()
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            opt.step()
            want.append(loss.item())
        assert got == pytest.approx(want, rel=1e-13), (hook, kept_whole)


def test_a_hook_that_only_looks_is_not_refused() -> None:
    """transformers' DebugUnderflowOverflow (the Trainer's --debug underflow_overflow) hooks every module, the root
    too, and changes nothing: not refused (the review)."""
    transformers = pytest.importorskip("transformers")
    from transformers.debug_utils import DebugUnderflowOverflow

    model = _sequential()
    DebugUnderflowOverflow(model)
    assert model._forward_hooks
    sw.functionalize(model)
    del transformers
