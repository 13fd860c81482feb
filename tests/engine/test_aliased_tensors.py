"""A trainable parameter sharing memory with another tensor of the module (tied the old way, through
``.data``) is refused by functionalize, naming both (engine/model/aliased_tensors.py): torch trains the one
memory, the step would train copies apart."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw


class Tied(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32, bias=False)
        self.how = how
        if how == "data":
            self.out.weight.data = self.emb.weight.data
        elif how == "transposed":
            self.mid2 = nn.Linear(16, 16)
            self.mid2.weight.data = self.mid.weight.data.t()
        elif how == "buffer":
            self.register_buffer("alias", self.mid.weight.data)
        elif how == "tie":
            self.out.weight = self.emb.weight
        elif how == "frozen":  # nothing trains either: they may share memory
            self.mid.weight.requires_grad_(False)
            self.register_buffer("alias", self.mid.weight.data)
        elif how == "disjoint":  # two weights cut from one flat memory, apart
            flat = torch.randn(2 * 16 * 16)
            self.mid.weight.data, self.out2 = flat[:256].view(16, 16), nn.Linear(16, 16, bias=False)
            self.out2.weight.data = flat[256:].view(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mid(self.emb(x)))
        if self.how == "transposed":
            h = torch.tanh(self.mid2(h))
        if self.how in ("buffer", "frozen"):
            h = h + 0.1 * h @ self.alias
        if self.how == "disjoint":
            h = self.out2(h)
        return self.out(h)


@pytest.mark.parametrize("how, first, second", [
    ("data", "parameter 'emb.weight'", "parameter 'out.weight'"),
    ("transposed", "parameter 'mid.weight'", "parameter 'mid2.weight'"),
    ("buffer", "parameter 'mid.weight'", "buffer 'alias'"),
])
def test_a_trainable_parameter_sharing_memory_is_refused_naming_both(how: str, first: str, second: str) -> None:
    with pytest.raises(sw.FunctionalizeError, match=rf"{first} and {second} of Tied share memory.*Tie them as one "
                       r"Parameter"):
        sw.functionalize(Tied(how), units=["emb", "mid", "out"] if how == "data" else None)


@pytest.mark.parametrize("how", ["tie", "frozen", "disjoint"])
def test_a_real_tie_frozen_aliases_and_disjoint_views_of_one_memory_are_taken(how: str) -> None:
    torch.manual_seed(0)
    model = Tied(how)
    chain, params = sw.functionalize(model)
    x = torch.randint(32, (2, 5))
    assert torch.equal(chain(params, x), model(x))
