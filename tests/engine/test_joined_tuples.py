"""Joined forwards and backwards (run_shape.joined_forwards / joined_backwards) on layers that pass
tuples, ignore part of their input, or take an input no gradient flows to (a first layer without
parameters): torch's own training of the same module, one device, traced (each compute alone),
ZeRO-1/3 on thread ranks and a 1F1B pipeline. Float64, 1e-12 of torch's values (the reductions
over ranks round differently; one device without a reduction is exact)."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import nn

import shardwise as sw


class _Affine(nn.Module):  # no parameters: its output needs no gradient
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + 1.0


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x.sum(-1, keepdim=True)


class _Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, a = pair
        return torch.tanh(self.lin(h)) * a, h


class _Halve(nn.Module):  # no parameters, a tuple in and out
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return pair[0], pair[1] * 0.5


class _Head(nn.Module):  # ignores the second element
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(pair[0])


def test_tuples_and_inputs_without_gradients_train_as_torch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Affine(), _Split(), _Mix(), _Halve(), _Head()).double()
    chain, params = sw.functionalize(model)
    params = optree.tree_map(torch.clone, params)  # the module trains below, in place
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    want = optree.tree_leaves(sw.functionalize(model)[1])

    def run(s: sw.Step, mesh: sw.Mesh | None) -> list[torch.Tensor]:
        state = s.init(params, mesh)
        for batch in batches:
            state, _ = s(state, batch)
        return [t.clone() for t in optree.tree_leaves(s.full_params(state))]

    cases: list[tuple[str, Any, sw.Mesh | None, int]] = [
        ("one device", step, None, 1), ("traced", step.with_trace(), None, 1),
        ("zero1", sw.shard_params(step, "dp", 1), sw.Mesh(dp=2), 2),
        ("zero3", sw.shard_params(step, "dp", 3), sw.Mesh(dp=2), 2),
        ("1f1b", sw.pipeline(step, "pp", "1f1b", 2), sw.Mesh(pp=2), 2),
    ]
    for name, s, mesh, world in cases:
        got = [run(s, mesh)] if mesh is None else sw.launch(lambda s=s, mesh=mesh: run(s, mesh), world)
        for per_rank in got:
            for a, b in zip(per_rank, want, strict=True):
                assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name
