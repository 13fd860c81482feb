"""A parameter that the code around the units reads only on some batches (a projector for rows holding a
special token), split by recording the calls on an example that does not read it: the layer running that code
holds a zero stand-in for it. The stand-ins are guarded at every call, not only on the example (they were
read as zeros, and the parameter's gradient dropped, without an error)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.lin(x))


class Special(nn.Module):
    """Rows holding token 0 go through ``special`` before the units (``where="embed"``), or get ``gate``, which
    the code before the units reads on every batch, added after them (``where="head"``: the head replays that
    code, so it holds ``gate`` tied, whatever the example). The data-dependent ``if`` keeps torch.fx out:
    functionalize records the calls on its example."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.emb, self.special = nn.Embedding(32, 16), nn.Linear(16, 16)
        self.gate = nn.Parameter(torch.randn(16) * 0.5)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids) * self.gate.sigmoid()
        special = bool((ids == 0).any())
        rows = (ids == 0).any(-1)[:, None, None].to(h.dtype)
        if self.where == "embed" and special:
            h = h + rows * self.special(h)
        for block in self.blocks:
            h = block(h)
        if self.where == "head" and special:
            h = h + rows * self.gate
        return self.head(h)


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for special in (False, True, True):
        t = torch.randint(1, 32, (4, 9), generator=g)
        if special:
            t[1, 3] = 0
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_stand_in_read_on_a_batch_unlike_the_example_is_refused_naming_the_parameter() -> None:
    torch.manual_seed(0)
    batches, name = _batches(), "special.weight"
    chain, params = sw.functionalize(Special("embed").double(), units=Block, example_input=batches[0][0])
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    state, _ = step(step.init(params), batches[0])  # the example's kind of batch trains
    with pytest.raises(sw.FunctionalizeError, match=rf"reads parameter '{name}' .*zero stand-in.*example_input"):
        step(state, batches[1])
    zero3 = sw.shard_params(step, "dp", stage=3)
    with pytest.raises(sw.collectives.RankFailed, match=rf"reads parameter '{name}'"):
        sw.launch(lambda: zero3(zero3.init(params, sw.Mesh(dp=2)), batches[1]), world=2)


@pytest.mark.parametrize("where, example", [("embed", 1), ("head", 0), ("head", 1)])
def test_recorded_on_an_example_that_takes_the_branch_it_trains_as_torch(where: str, example: int) -> None:
    torch.manual_seed(0)
    model = Special(where).double()
    reference = copy.deepcopy(model)
    batches = _batches()
    chain, params = sw.functionalize(model, units=Block, example_input=batches[example][0])
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    state = step.init(params)
    for x, y in batches:
        state, metrics = step(state, (x, y))
        optimizer.zero_grad()
        loss = _loss(reference(x), y)
        loss.backward()
        optimizer.step()
        assert float(metrics["loss"]) == pytest.approx(loss.item(), rel=1e-12)
