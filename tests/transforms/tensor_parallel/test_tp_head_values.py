"""Per-head values computed from head numbers: refused under tensor parallel; as sizes and indices: exact.

A rank holds 1/tp of the heads, numbered from 0 on each, and ``q.size(1)`` (or a count a Region divides) is its
own count. Used as a value they trained another model without an error (relative error of the loss after one
step, tp 2, before): an ALiBi-like slope ``2.0 ** -(torch.arange(q.size(1)) + 1)`` 2.4e-4, the loop's number
``out[:, h] = q[:, h] * (h + 1.0)`` 5.7e-3, a mask by head number combined with the heads' values 1.1e-4. They
are refused now (head_numbers.py, head_loop_values.py), naming the line (the count itself as a scalar, ``q / h``,
with its own fix: the whole count kept at init); the fix they name (a per-head table computed at init, split with
the heads by ``sw.tp.PerHead()``: a parameter, or for fixed slopes a buffer or a frozen parameter) equals one
device, and so do the uses as sizes and indices (an arange of every head as an index, the grouped-query ratio
``q.size(1) // k.size(1)``).

Compared at rtol 1e-9 (float64, 2 steps of SGD with momentum): tensor parallelism only reorders sums.
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
_SLOPES = [2.0 ** -(h + 1) for h in range(HEADS)]  # every head's, from the whole count


def _values(how: str, q: torch.Tensor, k: torch.Tensor, n_heads: int, slopes: Any) -> torch.Tensor:
    """``q`` (b, heads, t, head_dim) scaled or masked per head as ``how`` says."""
    heads = q.size(1)
    if how == "an alibi-like slope from an arange":
        return q * (2.0 ** -(torch.arange(heads, dtype=q.dtype) + 1)).view(1, heads, 1, 1)
    if how == "an alibi-like bias from an arange, into the scores":
        bias = -(2.0 ** -(torch.arange(heads, dtype=q.dtype) + 1)).view(1, heads, 1, 1) * torch.ones(q.size(2))
        return q + (bias.transpose(-1, -2) @ torch.ones(1, q.size(3), dtype=q.dtype))
    if how == "the loop's number as a value":
        out = torch.empty_like(q)
        for h in range(heads):
            out[:, h] = q[:, h] * (h + 1.0)
        return out
    if how == "a Python list of slopes in a loop":
        out = torch.empty_like(q)
        for h in range(heads):
            out[:, h] = q[:, h] * _SLOPES[h]
        return out
    if how == "a replicated table of slopes in a loop":
        out = torch.empty_like(q)
        table = torch.tensor(_SLOPES, dtype=q.dtype)
        for h in range(heads):
            out[:, h] = q[:, h] * table[h]
        return out
    if how == "a mask by head number combined with the values":
        return q.masked_fill((torch.arange(heads).view(1, -1, 1, 1) == 0) & (q > -10), 0.0)
    if how == "the count as a value":
        return q / q.size(1)
    if how == "the region's count as a value":
        return q / n_heads
    if how.startswith("slopes split with the heads"):
        return q * slopes.view(1, -1, 1, 1)
    if how == "the whole count kept at init":
        return q * slopes
    if how == "an arange of every head as an index":
        return q + q[:, torch.arange(heads)] * 0.5
    if how == "a loop alike for every head":
        out = torch.empty_like(q)
        for h in range(heads):
            out[:, h] = q[:, h] * 2.0 + k[:, h // (heads // k.size(1))]
        return out
    assert how == "the grouped-query ratio of two counts"
    return q + k.repeat_interleave(q.size(1) // k.size(1), dim=1) * (q.size(1) // k.size(1))


class _Attention(nn.Module):
    """Query heads and half as many key/value heads (grouped-query), and a per-head slope parameter."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.n_heads = how, HEADS
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v = nn.Linear(D, D // 2), nn.Linear(D, D // 2)
        if how == "slopes split with the heads":
            self.slopes = nn.Parameter(torch.tensor(_SLOPES))
        if how == "slopes split with the heads, a buffer":  # fixed, as ALiBi's are
            self.register_buffer("slopes", torch.tensor(_SLOPES))
        if how == "slopes split with the heads, a frozen parameter":
            self.slopes = nn.Parameter(torch.tensor(_SLOPES), requires_grad=False)
        if how == "the whole count kept at init":
            self.slopes = 1.0 / self.n_heads  # (the fix the refusal of a count as a value names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = _values(self.how, q, k, self.n_heads, getattr(self, "slopes", None))
        group = q.size(1) // k.size(1)
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


_PAIR = {"*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}
_REGION = {"*.attn": sw.tp.Region(heads=("n_heads",)), **_PAIR}
_PER_HEAD = {**_REGION, "*.attn.slopes": sw.tp.PerHead()}
_PLANS = pytest.mark.parametrize("plan", [_PAIR, _REGION], ids=["pair", "region"])


def _step(how: str) -> tuple[sw.Step, Any, list[Any]]:
    return two_blocks_problem(lambda: _Attention(how), D)


_AS_VALUES = (r"\. Each rank holds 1/tp of the heads, numbered from 0 on each.*sw\.tp\.PerHead\(\) in the plan, "
              r"inside a Region naming the head count: a buffer \(register_buffer\) or a frozen parameter for fixed "
              r"values such as ALiBi's slopes, a parameter for trained ones")
_AS_A_COUNT = (r"\. Each rank holds 1/tp of the heads and counts only its own, so a number computed from that count "
               r"\(a scale 1 / h, a fill value\) is the rank's H/tp where one device's is H, another model trained "
               r"without an error\. Compute it once at init from the whole count, before tensor parallel divides "
               r"anything \(self\.scale = 1 / config\.num_attention_heads in __init__\)")


@pytest.mark.parametrize("how, what", [
    ("an alibi-like slope from an arange", r"the model's code at test_tp_head_values\.py:\d+ in _values computes mul "
                                           r"of torch\.arange over size\(1\) \(2\) of the per-head view of "
                                           r"'0\.attn\.q', this rank's head numbers 0 \.\. H/tp - 1, with a tensor of "
                                           r"shape \[2, 2, 6, 4\]"),
    ("an alibi-like bias from an arange, into the scores", r"computes mul of torch\.arange over size\(1\) \(2\) .* "
                                                           r"with a tensor of shape \[6\]"),
    ("a mask by head number combined with the values", r"computes __and__ of torch\.arange over size\(1\) \(2\)"),
    ("the loop's number as a value", r"the module that takes the heads of '0\.attn\.[qk]' computes each of this "
                                     r"rank's 2 heads in a loop, but not alike: mul with 1\.0 for head 0 and with "
                                     r"2\.0 for head 1 \(test_tp_head_values\.py:\d+ in _values\)"),
    ("a Python list of slopes in a loop", r"not alike: mul with 0\.5 for head 0 and with 0\.25 for head 1"),
    ("a replicated table of slopes in a loop", r"not alike: mul with a tensor of other values for head 1 than for "
                                               r"head 0"),
])
@_PLANS
def test_a_per_head_value_from_head_numbers_is_refused(how: str, what: str, plan: dict[str, Any]) -> None:
    """Each trained another model silently before (2.4e-4, 5.7e-3, 1.1e-4 relative in the loss after one step)."""
    step, params, batches = _step(how)
    with pytest.raises(ValueError, match=rf"^tensor_parallel: .*{what}.*{_AS_VALUES}"):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


@_PLANS
def test_the_count_as_a_value_is_refused_naming_the_whole_count(plan: dict[str, Any]) -> None:
    """``q / q.size(1)``: a scalar, whose fix is the whole count kept at init, not a per-head table."""
    step, params, batches = _step("the count as a value")
    with pytest.raises(ValueError, match=(
        r"^tensor_parallel: the model's code at test_tp_head_values\.py:\d+ in _values passes size\(1\) \(2\) of "
        rf"the per-head view of '0\.attn\.q' to div as a value{_AS_A_COUNT}"
    )):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


def test_the_count_a_region_divides_is_refused_as_a_value() -> None:
    """``self.n_heads`` is the rank's count inside the Region that divides it (and the whole's outside one)."""
    step, params, batches = _step("the region's count as a value")
    with pytest.raises(ValueError, match=(
        r"^tensor_parallel: the model's code at test_tp_head_values\.py:\d+ in _values passes 0\.attn\.n_heads \(2: "
        rf"divided by the Region\) to div as a value{_AS_A_COUNT}"
    )):
        sw.tensor_parallel(step, "tp", _REGION).plan(sw.Mesh(tp=2), params, batches[0])
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _PAIR), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


@pytest.mark.parametrize("how", [
    "an arange of every head as an index", "a loop alike for every head", "the grouped-query ratio of two counts",
    "the whole count kept at init",
])
@_PLANS
def test_head_numbers_as_sizes_and_indices_equal_one_device(how: str, plan: dict[str, Any]) -> None:
    step, params, batches = _step(how)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


@pytest.mark.parametrize("sequence_parallel", [None, "*"], ids=["tp", "sequence parallel"])
@pytest.mark.parametrize("held", ["", ", a buffer", ", a frozen parameter"])
def test_slopes_split_with_the_heads_equal_one_device(held: str, sequence_parallel: str | None) -> None:
    """The fix the refusals name: the per-head table computed at init, given PerHead(): a parameter, or for
    fixed slopes a buffer or a frozen parameter (refused before: "matches no parameter", "never split")."""
    step, params, batches = _step(f"slopes split with the heads{held}")
    split = sw.tensor_parallel(step, "tp", _PER_HEAD, sequence_parallel=sequence_parallel)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)


@pytest.mark.parametrize("how", ["an alibi-like slope from an arange", "the loop's number as a value"])
def test_head_numbers_as_values_on_one_rank_are_the_whole(how: str) -> None:
    """At tp 1 a rank holds every head: its numbers are the whole's, and the step is the one device's."""
    step, params, batches = _step(how)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _REGION), step, sw.Mesh(tp=1), batches, params,
                                 rtol=1e-9)


@pytest.mark.parametrize("how, refused", [
    ("an alibi-like slope from an arange", True), ("the loop's number as a value", True),
    ("a mask by head number combined with the values", True), ("a loop alike for every head", False),
    ("slopes split with the heads", False),
])
def test_under_sequence_parallel_too(how: str, refused: bool) -> None:
    """Sequence parallel gathers the block's input before the attention: the heads and their numbers are the same."""
    step, params, batches = _step(how)
    split = sw.tensor_parallel(step, "tp", _PER_HEAD if "split" in how else _REGION, sequence_parallel="*")
    if refused:
        with pytest.raises(sw.collectives.RankFailed, match=rf"ValueError: tensor_parallel: .*{_AS_VALUES}"):
            sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)
    else:
        sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=1e-9)
