"""The rank's head count given to math's or numpy's functions (which read it in C): refused, naming the call.

An attention whose projections are split without a Region (Colwise q, k, v and a Rowwise o: nothing runs it whole
to compare) that computes a scale or per-head values from ``q.size(1)``, the rank's H/tp heads, by math or numpy
trained another model without an error (float64, tp 2, relative loss error after one step of SGD with momentum:
``math.sqrt(q.size(1))`` 1.2e-2, ``np.linspace(0.5, 1, q.size(1))`` 2.4e-3, ALiBi slopes from ``math.log2`` of
it 2.1e-3; ``enumerate(.., start=q.size(1))`` 9.9e-3). Those calls are stand-ins
while a module's first call is watched (head_host_calls.py); the same calls of whole numbers, and a loop over the
rank's heads by ``range(q.size(1))``, pass.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from math import log2 as bound_log2  # a name bound before any watch, as a model's module may bind it
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

from .conftest import ProjectedAttention, two_blocks_problem

D, HEADS, HEAD_DIM = 16, 4, 4
Op = Callable[[Any, torch.Tensor], torch.Tensor]


def _per_head(values: Any, q: torch.Tensor) -> torch.Tensor:
    return q * torch.as_tensor(np.asarray(values, dtype=np.float64)).reshape(1, -1, 1, 1)


def _alibi_slopes(n: Any) -> list[float]:
    """ALiBi's slopes for ``n`` heads (a power of 2), as its reference code computes them."""
    start = 2 ** (-(2 ** -(bound_log2(n) - 3)))
    return [start * start**i for i in range(n)]


# Projections split without a Region: no probe compares the module with its whole run.
_PLAN = {"*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}

REFUSED: list[tuple[str, Op, str]] = [
    ("math_sqrt", lambda m, q: q * math.sqrt(q.size(1)), r"math\.sqrt"),
    ("numpy_linspace", lambda m, q: _per_head(np.linspace(0.5, 1, q.size(1)), q), r"numpy\.linspace"),
    ("alibi_slopes_by_a_bound_log2", lambda m, q: _per_head(_alibi_slopes(q.size(1)), q), r"math\.log2"),
    # numbers counted on from it (9.9e-3 before)
    ("enumerate_started_at_it", lambda m, q: q * sum(i for i, _ in enumerate([0], start=q.size(1))) / 4,
     r"enumerate\(\)"),
]


def _step(op: Op) -> tuple[sw.Step, Any, list[Any]]:
    """``op(module, q)`` on the per-head queries of an attention split without a Region."""
    def make() -> nn.Module:
        attention = ProjectedAttention(lambda q, k, v: F.scaled_dot_product_attention(
            op(attention, q), k, v, is_causal=True), D, HEAD_DIM)
        return attention

    return two_blocks_problem(make, D)


@pytest.mark.parametrize(("op", "call"), [pytest.param(op, call, id=name) for name, op, call in REFUSED])
def test_the_ranks_head_count_given_to_math_or_numpy_is_refused(op: Op, call: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=r"tensor_parallel: the model's code at test_tp_head_host_calls\.py:\d+ in "
                                         rf"\S+ passes size\(1\) \(2\) of the per-head view of '0\.attn\.q' to {call}, "
                                         r".*Each rank holds 1/tp of the heads and counts only its own"):
        sw.tensor_parallel(step, "tp", _PLAN).plan(sw.Mesh(tp=2), params, batches[0])


def test_operator_index_of_the_count_keeps_its_mark() -> None:
    """``operator.index(q.size(1))`` returned a plain ``int`` (9.9e-3 apart in the loss as a scale, no error): it
    returns the marked count itself now, judged where torch takes it as the read is."""
    step, params, batches = _step(lambda m, q: q * operator.index(q.size(1)) / 4)
    with pytest.raises(ValueError, match=r"passes size\(1\) \(2\) of the per-head view of '0\.attn\.q' to mul as a "
                                         "value"):
        sw.tensor_parallel(step, "tp", _PLAN).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_refusal_at_the_first_step_and_the_originals_back_after() -> None:
    originals = (math.sqrt, np.linspace, bound_log2)
    step, params, batches = _step(REFUSED[0][1])
    with pytest.raises(sw.collectives.RankFailed, match=r"passes size\(1\) \(2\) .* to math\.sqrt"):
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _PLAN), step, sw.Mesh(tp=2), batches, params,
                                     rtol=1e-9)
    assert (math.sqrt, np.linspace, globals()["bound_log2"]) == originals


def _whole_numbers_and_a_loop(m: Any, q: torch.Tensor) -> torch.Tensor:
    """math and numpy of whole numbers (the head dim, the whole head count), and a loop over the rank's heads."""
    q = q * math.sqrt(HEAD_DIM) / math.sqrt(q.size(-1)) * float(np.linspace(0.5, 1, HEADS).mean()) / 0.75
    return torch.stack([q[:, h] * 2.0 for h in range(q.size(1))], dim=1) * bound_log2(2)


def test_math_and_numpy_of_whole_numbers_and_a_loop_over_the_heads_equal_one_device() -> None:
    step, params, batches = _step(_whole_numbers_and_a_loop)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _PLAN), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)
