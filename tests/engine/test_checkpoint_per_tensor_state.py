"""A user's optimizer that keeps a value of its own per tensor it updates (a torch-style step count) saves one per
ZeRO unit under shard_params and one per parameter elsewhere: a load across the two is refused, saying to load it
under the layout that saved it, for a model whose parameter names have dots too (it advised another optimizer)."""

from __future__ import annotations

import tempfile

import optree
import pytest
import torch

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT


class PerTensorCount:
    elementwise = True

    def init(self, params):  # type: ignore[no-untyped-def]
        return {"t": optree.tree_map(lambda p: torch.zeros((), dtype=torch.int64), params),
                "m": optree.tree_map(torch.zeros_like, params)}

    @torch.no_grad()
    def update(self, grads, state, params):  # type: ignore[no-untyped-def]
        t = optree.tree_map(lambda c: c + 1, state["t"])
        m = optree.tree_map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], grads)
        return optree.tree_map(lambda p, m, c: p - 0.1 * m / (1 - 0.9 ** int(c)), params, m, t), {"t": t, "m": m}


def test_a_per_tensor_value_saved_per_zero_unit_is_refused_elsewhere_naming_the_layout() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8), units=Block)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    step = sw.train_step(chain, loss, PerTensorCount())
    zero3 = sw.shard_params(step, "dp", stage=3)
    batch = (torch.randint(32, (4, 8)), torch.randint(32, (4, 8)))
    path = tempfile.mkdtemp() + "/ck"

    def save() -> None:
        state, _ = zero3(zero3.init(params, sw.Mesh(dp=2)), batch)
        sw.checkpoint.save(path, state, zero3)

    sw.launch(save, world=2)
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"keeps a value of its own per tensor it updates.*load it "
                       r"under the ZeRO stage \(or the absence of one\) that saved it"):
        sw.checkpoint.load(path, step, None)
