"""A unit's stand-in reads as the unit's mode. A model split by recording its units' calls (fx cannot trace it)
runs the code around the units with stand-ins in their places; code after the units that reads a unit's mode, or
one of its submodules' (``self.blocks[0].training``), read True from each stand-in of an eval-mode model, took the
training branch, and functionalize refused the model as a split that changed its computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.lin(self.norm(x))


_SEEN: list[tuple[str, bool, bool]] = []  # what the code after the units read: (the unit's type, its mode, its norm's)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        if float(h.detach().sum()) > 1e9:  # data-dependent: fx cannot trace it, the units' calls are recorded
            h = h * 0
        for block in self.blocks:
            h = block(h)
        first = self.blocks[0]  # read after the units: a stand-in in the replays
        _SEEN.append((type(first).__name__, first.training, first.norm.training))
        return self.head(h) * ((2.0 if first.training else 1.0) + (0.5 if first.norm.training else 0.0))


MODES = {"train": lambda m: m, "eval": lambda m: m.eval(), "a_submodule_in_eval": lambda m: m.blocks[0].norm.eval()}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_code_after_the_units_reads_each_units_mode_and_trains_as_one_device(mode: str) -> None:
    torch.manual_seed(0)
    model = _Model().double()
    MODES[mode](model)
    want = (model.blocks[0].training, model.blocks[0].norm.training)
    x = torch.randn(8, 4, dtype=torch.float64)
    chain, params = sw.functionalize(model, units=_Block, example_input=x)
    _SEEN.clear()
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    batches = [(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)) for _ in range(2)]
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
    stand_ins = [(training, norm) for kind, training, norm in _SEEN if kind == "UnitStub"]
    assert stand_ins and set(stand_ins) == {want}, _SEEN


def test_a_views_mode_is_its_own_at_the_split_until_a_train_or_eval_reaches_its_stub() -> None:
    torch.manual_seed(0)
    model = _Model().double()
    model.blocks[1].norm.eval()
    chain, _ = sw.functionalize(model, units=_Block, example_input=torch.randn(8, 4, dtype=torch.float64))
    root = next(layer for layer in chain if layer.name == "head").fn.replicas.module
    stub = root.blocks[1]
    assert type(stub).__name__ == "UnitStub"
    assert (stub.training, stub.norm.training, stub.lin.training) == (True, False, True)  # as at the split
    root.train()  # as torch's train() sets every module's, the view's too
    assert (stub.training, stub.norm.training, stub.lin.training) == (True, True, True)
    root.eval()
    assert (stub.training, stub.norm.training, stub.lin.training) == (False, False, False)
