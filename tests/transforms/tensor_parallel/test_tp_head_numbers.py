"""A head picked by its number among all the heads: refused; a loop over a rank's heads: the one device's step.

Each rank holds 1/tp of the heads, numbered from 0 on each: ``q[:, 0]`` is head 0 on one device and the rank's
first head (head 2 of 4 on rank 1 at tp 2) under tensor parallel. A module that zeroes or reads a fixed head
(``q[:, 0] = 0``, ``q + q[:, :1]``, ``q[:, -1]``, ``q.select(1, 0)``) trained another model without an error
(losses 0.15% to 1.1% apart). The head watch (head_views.py, split_watch.py) counts the heads a per-head tensor
gives one at a time and, at the end of the layer's first call, refuses unless each of the rank's heads was taken
equally often, as a loop over all of them takes them (writes counted apart, the same way: test_tp_head_writes.py);
a write into some heads in a Colwise Linear subclass's own forward is refused at once (weight_reads.py).

Compared at rtol 1e-9 (float64, tp 2, 2 steps of SGD with momentum): tensor parallelism only reorders sums.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

from .conftest import two_blocks_problem

D, HEADS, HEAD_DIM = 16, 4, 4


class _Attention(nn.Module):
    """An attention over plain q, k, v Linears whose forward takes heads one at a time as ``pick`` says."""

    def __init__(self, pick: str) -> None:
        super().__init__()
        self.pick, self.n_heads = pick, HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.pick == "write head 0":
            q = q.clone()
            q[:, 0] = 0
        elif self.pick == "read head 0 by a slice":
            q = q + q[:, :1]
        elif self.pick == "read the last head":
            q = q + q[:, -1].unsqueeze(1)
        elif self.pick == "select head 0":
            q = q * q.select(1, 0).unsqueeze(1).sigmoid()
        elif self.pick == "a loop, then head 0 again":
            q = torch.stack([q[:, h] * 2.0 for h in range(q.size(1))], dim=1) + q[:, 0:1]
        elif self.pick == "a loop by the region's count":  # Region(heads=("n_heads",)) makes it the rank's count
            q = torch.stack([q[:, h] * (h + 1.0) ** 0 for h in range(self.n_heads)], dim=1)
        elif self.pick == "a loop by the heads dim, each head read twice":
            q = torch.stack([q[:, h] + q[:, h:h + 1][:, 0].tanh() for h in range(q.size(1))], dim=1)
        else:
            assert self.pick == "write every head in a loop"
            q = q.clone()
            for h in range(q.size(1)):
                q[:, h] = q[:, h] * 2.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


_PLAN = {"*.attn": sw.tp.Region(heads=("n_heads",)), "*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}


def _step(pick: str) -> tuple[sw.Step, Any, list[Any]]:
    return two_blocks_problem(lambda: _Attention(pick), D)


@pytest.mark.parametrize("pick, taken", [
    ("write head 0", r"it wrote into heads one at a time, first \[0\] = \.\.\. at test_tp_head_numbers\.py:\d+ in "
                     r"forward, and of its 2 heads on this rank wrote into head 0 x1,"),
    ("read head 0 by a slice", r"it took heads one at a time, first \[slice\(None, 1, None\)\] at "
                               r"test_tp_head_numbers\.py:\d+ in forward, and of its 2 heads on this rank took head 0 "
                               r"x1, not each of them equally often"),
    ("read the last head", r"first \[-1\] at .* took head 1 x1,"),
    ("select head 0", r"first select\(\.\.\., 0\) at .* took head 0 x1,"),
    ("a loop, then head 0 again", r"first \[0\] at test_tp_head_numbers\.py:\d+ in <listcomp>, .* took head 0 x2, "
                                  r"head 1 x1,"),
])
def test_a_head_picked_by_its_number_is_refused(pick: str, taken: str) -> None:
    """Each trained another model silently before (the review's q[:, 0] = 0 and q + q[:, :1]: 0.17%, 0.15%)."""
    step, params, batches = _step(pick)
    with pytest.raises(ValueError, match=(
        r"Colwise\(\) on '0\.attn\.q' gives each rank its own heads, 2 of them here \(dim 1\), .*module that takes "
        rf"them \('0\.attn'\) picks heads by their number: .*{taken}.*Index the heads only in a loop that reads \(and "
        r"writes\) each of the rank's heads equally often .*or leave this module's projections out of the plan"
    )):
        sw.tensor_parallel(step, "tp", _PLAN).plan(sw.Mesh(tp=2), params, batches[0])


@pytest.mark.parametrize("pick", [
    "a loop by the region's count", "a loop by the heads dim, each head read twice", "write every head in a loop",
])
def test_a_loop_over_every_head_of_the_rank_is_the_single_device_step(pick: str) -> None:
    """A loop writing each head in turn too: writes are counted per head like reads (test_tp_head_writes.py)."""
    step, params, batches = _step(pick)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _PLAN), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


class _FusedQKV(nn.Linear):
    """A fused q, k, v projection viewing its product per head in its own forward, then zeroing head 0."""

    def __init__(self, head_major: bool) -> None:
        super().__init__(D, 3 * D)
        self.head_major = head_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        b, t, _ = x.shape
        if self.head_major:  # q, k and v of each head side by side
            y = y.view(b, t, -1, 3, HEAD_DIM).clone()
            y[:, :, 0] = 0
            return y.transpose(2, 3)
        y = y.view(b, t, 3, -1, HEAD_DIM).clone()
        y[:, :, :, 0] = 0
        return y


class _FusedAttention(nn.Module):
    def __init__(self, head_major: bool) -> None:
        super().__init__()
        self.n_heads = HEADS
        self.qkv, self.o = _FusedQKV(head_major), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("head_major", [False, True])
def test_a_colwise_subclass_writing_a_fixed_head_is_refused(head_major: bool) -> None:
    """The review's fused subclass (1.1% apart) and head-major one (1.0%)."""
    step, params, batches = two_blocks_problem(lambda: _FusedAttention(head_major), D)
    plan = {"*.attn": sw.tp.Region(heads=("n_heads",)), "*.attn.qkv": sw.tp.Colwise(fused=1 if head_major else 3),
            "*.attn.o": sw.tp.Rowwise()}
    with pytest.raises(ValueError, match=(
        r"a Colwise Linear subclass \(_FusedQKV\) views its product per head in its own forward, this rank's 2 heads "
        rf"\(dim {2 if head_major else 3}\), .* picks heads by their number: a write into head 0 "
        r"\(test_tp_head_numbers\.py:\d+ in forward\)"
    )):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


class _WritingQKV(nn.Linear):
    """A fused q, k, v projection writing into a part of its product in its own forward, as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__(D, 3 * D)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        b, t, _ = x.shape
        if self.how == "zero_ of head 0":
            y = y.view(b, t, 3, -1, HEAD_DIM).clone()
            y[:, :, :, 0].zero_()
            return y
        if self.how == "features by their place":
            y = y.clone()
            y[..., :HEAD_DIM] = 0
            return y.view(b, t, 3, -1, HEAD_DIM)
        assert self.how == "every position's first token"  # a write along the sequence, each feature in place
        y = y.clone()
        y[:, 0] = 0
        return y.view(b, t, 3, -1, HEAD_DIM)


class _WritingAttention(_FusedAttention):
    def __init__(self, how: str) -> None:
        super().__init__(head_major=False)
        self.qkv = _WritingQKV(how)


_FUSED = {"*.attn": sw.tp.Region(heads=("n_heads",)), "*.attn.qkv": sw.tp.Colwise(fused=3), "*.attn.o": sw.tp.Rowwise()}


@pytest.mark.parametrize("how, op", [("zero_ of head 0", "zero_"), ("features by their place", "__setitem__")])
def test_a_colwise_subclass_writing_into_a_part_of_its_product_is_refused(how: str, op: str) -> None:
    """An in-place op on one head of its per-head view, a write into a range of its features: 0.71% and 0.26% off
    before, no error."""
    step, params, batches = two_blocks_problem(lambda: _WritingAttention(how), D)
    with pytest.raises(ValueError, match=(
        rf"a Colwise Linear subclass \(_WritingQKV\) writes into a part of its product in its own forward \({op} at "
        r"test_tp_head_numbers\.py:\d+ in forward\).*Write into the whole product"
    )):
        sw.tensor_parallel(step, "tp", _FUSED).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_colwise_subclass_writing_along_the_sequence_is_the_single_device_step() -> None:
    step, params, batches = two_blocks_problem(lambda: _WritingAttention("every position's first token"), D)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _FUSED), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)
