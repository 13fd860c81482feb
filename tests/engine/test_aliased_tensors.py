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


@pytest.mark.parametrize("hook", ["grad", "post_accumulate"])
def test_a_gradient_hook_on_a_parameter_is_refused_and_the_forward_mask_trains_as_torch(hook: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4)).double()
    new_rows = torch.zeros(16, 1, dtype=torch.bool)
    new_rows[12:] = True  # train only the rows of the tokens added last
    weight = model[0].weight
    if hook == "grad":
        weight.register_hook(lambda g: g * new_rows)
    else:
        weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(new_rows))
    with pytest.raises(sw.FunctionalizeError, match=r"parameter '0.weight' of Sequential carries a gradient hook.*"
                       r"would never run.*torch.where\(mask, w, w.detach\(\)\)"):
        sw.functionalize(model)

    class MaskedEmbedding(nn.Embedding):
        def forward(self, ids: Tensor) -> Tensor:
            return nn.functional.embedding(ids, torch.where(new_rows, self.weight, self.weight.detach()))

    torch.manual_seed(0)
    masked = nn.Sequential(MaskedEmbedding(16, 8), nn.Linear(8, 4)).double()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4)).double()
    reference[0].weight.register_hook(lambda g: g * new_rows)
    chain, params = sw.functionalize(masked)
    step = sw.train_step(chain, lambda out, y: nn.functional.mse_loss(out, y), sw.optim.sgd(0.1, momentum=0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    state, g = step.init(params), torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randint(16, (6, 5), generator=g), torch.randn(6, 5, 4, generator=g, dtype=torch.float64)
        state, _ = step(state, (x, y))
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    trained = step.full_params(state)["0"]["weight"]
    assert torch.allclose(trained, reference[0].weight, rtol=1e-12, atol=0)
    assert torch.equal(trained[:12], params["0"]["weight"][:12])  # the old rows did not move


def test_interleaved_views_of_one_memory_that_share_no_element_are_taken() -> None:
    """q and k cut by columns from one fused weight (a checkpoint converted without a clone), even and odd
    elements of one flat tensor: their spans overlap, their elements do not."""
    torch.manual_seed(0)
    fused = torch.randn(8, 16)
    q, k = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    q.weight.data, k.weight.data = fused[:, :8], fused[:, 8:]
    flat = torch.randn(32)
    even, odd = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    even.weight.data, odd.weight.data = flat[0::2].view(4, 4), flat[1::2].view(4, 4)
    model = nn.Sequential(q, k, nn.Linear(8, 4, bias=False), even, odd)
    chain, params = sw.functionalize(model)
    x = torch.randn(3, 8)
    assert torch.equal(chain(params, x), model(x))
