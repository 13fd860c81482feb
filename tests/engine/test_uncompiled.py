"""A torch.compile'd model or block is split as its uncompiled code (engine/model/uncompiled.py).

torchtitan compiles each block (``block.compile()``), nanoGPT the whole model (``torch.compile(model)``).
functionalize splits the uncompiled module, so the step is a plain torch loop on the uncompiled model,
bitwise; the user's module stays compiled. Nothing here runs a compiled module (no compile cost).
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.torch_api import compiled_in_place, compiled_original, drop_compiled_call

with warnings.catch_warnings():  # torch.compile imports inductor, whose torch.utils.mkldnn warns (torch.jit)
    warnings.simplefilter("ignore", DeprecationWarning)
    torch.compile(nn.Linear(1, 1))  # imports what torch.compile does; compiles nothing until called


def test_torch_keeps_a_compiled_modules_original_and_compiled_call_where_we_read_them() -> None:
    """Fails loudly if torch moves OptimizedModule._orig_mod or Module._compiled_call_impl."""
    linear = nn.Linear(2, 2)
    assert compiled_original(linear) is None and not compiled_in_place(linear)
    assert compiled_original(torch.compile(linear)) is linear
    linear.compile()
    assert compiled_in_place(linear)
    drop_compiled_call(linear)
    assert not compiled_in_place(linear)
    assert torch.equal(linear(torch.ones(1, 2)), F.linear(torch.ones(1, 2), linear.weight, linear.bias))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]


def _torch_loop(model: nn.Module) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return dict(model.named_parameters())


def _trained(model: nn.Module, units: object, example: bool) -> dict[str, torch.Tensor]:
    kwargs = {"example_input": _batches()[0][0]} if example else {}
    chain, params = sw.functionalize(model, units=units, **kwargs)  # type: ignore[arg-type]
    step = sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "dp", 3)

    def run() -> dict[str, torch.Tensor]:
        state = step.init(params, sw.Mesh(dp=2))
        for b in _batches():
            state, _ = step(state, b)
        return {n: t for layer in step.full_params(state).values() for n, t in layer.items()}

    return sw.launch(run, 2)[0]


def _assert_trains_as_uncompiled(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()  # the uncompiled model's names (no "_orig_mod.")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)  # ZeRO sums gradients over dp


def test_blocks_compiled_in_place_are_split_and_trained_as_the_uncompiled_model() -> None:
    """torchtitan's pattern; in float32 the compiled block's rounding made the bitwise check refuse it."""
    torch.manual_seed(0)
    model = Net()
    expected = _torch_loop(model)
    for b in model.blocks:
        b.compile()
    for units, example in ((Block, True), (Block, False), (None, True)):
        _assert_trains_as_uncompiled(_trained(model, units, example), expected)
    assert all(compiled_in_place(b) for b in model.blocks)  # the user's model is left compiled


def test_a_compiled_model_is_split_as_the_module_it_wraps() -> None:
    torch.manual_seed(0)
    model = Net()
    expected = _torch_loop(model)
    compiled = torch.compile(model)
    for units, example in ((Block, True), (Block, False), (None, True)):
        _assert_trains_as_uncompiled(_trained(compiled, units, example), expected)
    chain, _ = sw.functionalize(compiled, units=Block)
    assert chain.names == sw.functionalize(model, units=Block)[0].names
