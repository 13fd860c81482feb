"""A batched matrix product of per-head views keeps the heads (head_views.py): the scores ``q @ k.transpose(-1, -2)``,
``einsum("bhtd,bhsd->bhts", q, k)`` and ``probs @ v`` hold the rank's heads along the same dim.

Before they were followed, a loop over the heads of the scores (eager attention computed one head at a time) was
refused as "a tensor of other values for head 1 than for head 0, not read from the heads", though it equals one
device; and an op across the heads of the scores or probabilities (their mean over the heads, an attention map
averaged over heads, used as a value) trained another model without an error (1.1e-3 by matmul, 4.3e-3 by einsum,
relative in the loss after one step of the tests' tiny attention at tp 2, float64). Projections split without a
Region (Colwise q, k, v; Rowwise o).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw

from .conftest import ProjectedAttention, two_blocks_problem

D, HEAD_DIM = 16, 4
Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _causal(scores: torch.Tensor) -> torch.Tensor:
    t = scores.shape[-1]
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def _loop_over_the_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) / 2
    out = torch.empty_like(q)
    for h in range(q.size(1)):
        out[:, h] = _causal(scores[:, h]) @ v[:, h]
    return out


def _loop_over_the_probabilities(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    probs = _causal(torch.matmul(q, k.transpose(2, 3)))
    return torch.stack([probs[:, h] @ v[:, h] for h in range(q.size(1))], 1)


def _loop_over_einsum_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    probs = _causal(torch.einsum("bhtd,bhsd->bhts", q, k))
    return torch.stack([torch.einsum("bts,bsd->btd", probs[:, h], v[:, h]) for h in range(probs.size(1))], 1)


def _batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(_causal(q @ k.transpose(-1, -2)).flatten(0, 1), v.flatten(0, 1)).view_as(q)


@pytest.mark.parametrize("op", [_loop_over_the_scores, _loop_over_the_probabilities, _loop_over_einsum_scores,
                                _batched], ids=lambda op: op.__name__.strip("_"))
def test_the_heads_of_a_batched_product_computed_one_at_a_time_equal_one_device(op: Op) -> None:
    step, params, batches = two_blocks_problem(lambda: ProjectedAttention(op, D, HEAD_DIM), D)
    sw.testing.assert_equivalent(
        sw.tensor_parallel(step, "tp", {"*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}),
        step, sw.Mesh(tp=2), batches, params, rtol=1e-9)


def _averaged_over_the_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    probs = _causal(q @ k.transpose(-1, -2))
    return probs @ v + 0.1 * (probs.mean(1, keepdim=True) @ v)


def _einsum_averaged_over_the_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    probs = _causal(torch.einsum("bhtd,bhsd->bhts", q, k))
    return probs @ v + 0.1 * (probs.sum(1, keepdim=True) / 4 @ v)


@pytest.mark.parametrize(("op", "what"), [(_averaged_over_the_heads, "mean over dim -3"),
                                          (_einsum_averaged_over_the_heads, "sum over dim -3")],
                         ids=["mean_of_matmul_probabilities", "sum_of_einsum_probabilities"])
def test_an_op_across_the_heads_of_the_scores_is_refused(op: Op, what: str) -> None:
    step, params, batches = two_blocks_problem(lambda: ProjectedAttention(op, D, HEAD_DIM), D)
    with pytest.raises(ValueError, match=rf"Colwise\(\) on '0\.attn\.[qk]' gives each rank whole heads.* computes "
                                         rf"{what}, which holds its heads of its per-head view: over this rank's heads "
                                         "alone"):
        sw.tensor_parallel(step, "tp", {"*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}).plan(
            sw.Mesh(tp=2), params, batches[0])
