"""A loop's head number, and new tensors sized by the rank's head count, used as values: refused; as indices: exact.

An attention whose projections are split without a Region (Colwise q, k, v and a Rowwise o: nothing runs it whole
to compare) that computes per-head values from ``range(q.size(1))``'s numbers or from a tensor sized by
``q.size(1)`` gets the first heads' values on every rank. Each refused form below trained another model without an
error before (float64, tp 2, relative loss error after one step; see ``SILENT``). ``range()`` over the rank's head
count now gives head numbers (``HeadIndex``: right as an index, refused as a value at the end of the first call), a
list repeated by it (``[1.0] * h``) and a new tensor sized by it are followed, and a sum or running sum along the
heads they count is a tensor of head numbers. The loops and sizes that name the rank's heads in their places equal
one device.
"""

from __future__ import annotations

import collections.abc
import math
import operator
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

from .conftest import ProjectedAttention, two_blocks_problem

D, HEADS, HEAD_DIM = 16, 4, 4
Op = Callable[[torch.Tensor], torch.Tensor]


def _per_head(values: Any, q: torch.Tensor) -> torch.Tensor:
    return q * torch.as_tensor(values, dtype=q.dtype).reshape(1, -1, 1, 1)


def _slopes_filled_in_a_loop(q: torch.Tensor) -> torch.Tensor:
    slopes = [0.0] * q.size(1)
    for h in range(q.size(1)):
        slopes[h] = 2 ** -(h + 1)  # (a Python float on the left, 2.0 ** -h, is float's own: unseen, see below)
    return _per_head(slopes, q)


def _scaled_in_a_loop_by_math(q: torch.Tensor) -> torch.Tensor:
    return torch.stack([q[:, h] * 0.0 for h in range(q.size(1))], 1) + _per_head(
        [math.pow(2.0, -h) for h in range(q.size(1))], q)


# Projections split without a Region: no probe compares the module with its whole run.
_PLAN = {"*.attn.[qkv]": sw.tp.Colwise(), "*.attn.o": sw.tp.Rowwise()}

# (name, op, what the refusal says; the relative loss error it trained with before, without an error)
SILENT: list[tuple[str, Op, str, float]] = [
    ("values_from_range", lambda q: _per_head([h + 1.0 for h in range(q.size(1))], q),
     r"passes a head number of range\(\) over size\(1\) \(2\) of the per-head view of '0\.attn\.q', this rank's "
     r"head number, to as_tensor as a value", 5.7e-3),
    ("slopes_filled_in_a_loop", _slopes_filled_in_a_loop, r"passes a head number of range\(\) .* to as_tensor", 2.4e-4),
    ("math_of_the_loops_number", _scaled_in_a_loop_by_math, r"passes a head number of range\(\) .* to math\.pow",
     8.3e-4),
    ("list_repeated_then_counted", lambda q: _per_head(torch.tensor([1.0] * q.size(1)).cumsum(0), q),
     r"computes mul of cumsum along dim 0 of a tensor of a list repeated by size\(1\) \(2\) of the per-head view of "
     r"'0\.attn\.q', across the heads it counts, this rank's head numbers", 5.7e-3),
    ("ones_counted", lambda q: _per_head(torch.ones(q.size(1)).cumsum(0), q),
     r"computes mul of cumsum along dim 0 of a new tensor sized by size\(1\) \(2\) .*\(ones\), across the heads it "
     r"counts", 5.7e-3),
    ("new_ones_counted_along_the_heads", lambda q: q * q.new_ones(1, q.size(1), 1, 1).cumsum(1),
     r"computes mul of cumsum along dim 1 of a new tensor sized by size\(1\) \(2\) .*\(new_ones\)", 5.7e-3),
    ("tensor_of_the_range", lambda q: _per_head(torch.tensor(range(q.size(1))) + 1.0, q),
     r"computes mul of torch\.tensor of a head number of range\(\) over size\(1\) \(2\)", 5.7e-3),
    ("numpy_array_of_the_range", lambda q: _per_head(np.array(range(q.size(1))) + 1.0, q),
     r"passes a head number of range\(\) over size\(1\) \(2\) .* to numpy\.array", 5.7e-3),
    ("ones_summed_as_a_scale", lambda q: q * torch.ones(q.size(1), dtype=q.dtype).sum() / 2,
     r"computes mul of sum along dim 0 of a new tensor sized by size\(1\) \(2\)", 2.0e-2),
]


def _step(op: Op) -> tuple[sw.Step, Any, list[Any]]:
    """``op`` on the per-head queries of an attention split without a Region."""
    return two_blocks_problem(lambda: ProjectedAttention(
        lambda q, k, v: F.scaled_dot_product_attention(op(q), k, v, is_causal=True), D, HEAD_DIM), D)


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what, _ in SILENT])
def test_a_loops_head_number_or_a_count_of_the_ranks_heads_as_a_value_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=rf"tensor_parallel: the model's code at test_tp_head_loop_numbers\.py:\d+ "
                                         rf"in \S+ {what}.*Each rank holds 1/tp of the heads"):
        sw.tensor_parallel(step, "tp", _PLAN).plan(sw.Mesh(tp=2), params, batches[0])


def _filled_then_averaged(q: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(q.size(1), dtype=q.dtype)
    for h in range(q.size(1)):
        buf[h] = q[:, h].detach().abs().mean()
    return q * buf.mean()


# More forms (name, op, what the refusal says, tp; relative loss error before, without an error: review's probes)
SILENT_TOO: list[tuple[str, Op, str, int, float]] = [
    ("enumerate_of_the_range", lambda q: _per_head([i + 1.0 for i, _ in enumerate(range(q.size(1)))], q),
     r"passes a head number of enumerate\(\) over a head number of range\(\) .* to as_tensor", 2, 3.1e-3),
    ("whole_table_by_head_number", lambda q: q * torch.stack(
        [torch.linspace(0.5, 1.0, 4, dtype=q.dtype)[h] for h in range(q.size(1))])[None, :, None, None],
     r"indexes a tensor of shape \[4\] that holds no heads of its own by a head number of range\(\)", 2, 1.6e-4),
    ("whole_table_by_an_arange", lambda q: q * torch.linspace(0.5, 1.0, 4, dtype=q.dtype)[
        torch.arange(q.size(1))][None, :, None, None],
     r"indexes a tensor of shape \[4\] that holds no heads of its own by torch\.arange over size\(1\)", 2, 1.6e-4),
    ("ones_counted_one_head_per_rank", lambda q: _per_head(torch.ones(q.size(1)).cumsum(0), q),
     r"cumsum along dim 0 of a new tensor sized by size\(1\) \(1\)", 4, 1.4e-2),
    ("ones_summed_one_head_per_rank", lambda q: q * torch.ones(q.size(1), dtype=q.dtype).sum() / 2,
     r"sum along dim 0 of a new tensor sized by size\(1\) \(1\)", 4, 1.5e-2),
    ("expanded_then_counted", lambda q: _per_head(torch.ones(1).expand(q.size(1)).cumsum(0), q),
     r"cumsum along dim 0 of a new tensor sized by size\(1\) \(2\) .*\(expand\)", 2, 3.1e-3),
    ("softmax_along_the_sized_dim", lambda q: q * torch.zeros(q.size(1), dtype=q.dtype).softmax(0)[
        None, :, None, None] * 4, r"softmax over dim -1 of a new tensor sized by", 2, 1.0e-2),
    ("filled_head_by_head_then_averaged", _filled_then_averaged, r"mean over every dim of a new tensor sized by", 2,
     1.8e-4),
    ("len_of_a_list_repeated_by_the_count", lambda q: q * len([1.0] * q.size(1)) / 2,
     r"passes len\(\) of a list repeated by size\(1\) \(2\) .* to mul as a value", 2, 1.0e-2),
    ("len_of_the_heads_unbound", lambda q: q * len(q.unbind(1)) / 4,
     r"passes len\(\) of the heads of the per-head view of '0\.attn\.q' unbound \(2\) to mul as a value", 2, 3.1e-2),
]


SILENT_TOO.append(
    ("len_of_the_range", lambda q: q * len(range(q.size(1))) / 4,
     r"passes len\(\) of a head number of range\(\) over size\(1\) \(2\) .* to mul as a value", 2, 9.9e-3))
SILENT_TOO.append(
    ("python_sum_of_the_heads_unbound", lambda q: q * sum(q.unbind(1)).unsqueeze(1) / 4,
     r"sums the heads of the per-head view of '0\.attn\.q' unbound \(2\) with Python's sum\(\): over this rank's "
     r"heads alone", 2, 3.3e-3))


@pytest.mark.parametrize(("op", "what", "tp"), [pytest.param(op, what, tp, id=name)
                                                for name, op, what, tp, _ in SILENT_TOO])
def test_more_counts_and_head_numbers_as_values_are_refused(op: Op, what: str, tp: int) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=rf"tensor_parallel: the model's code at test_tp_head_loop_numbers\.py:\d+ "
                                         rf"in \S+ .*{what}.*Each rank holds 1/tp of the heads"):
        sw.tensor_parallel(step, "tp", _PLAN).plan(sw.Mesh(tp=tp), params, batches[0])


def test_the_heads_read_one_at_a_time_gathered_in_another_order_are_refused() -> None:
    """``torch.stack([q[:, h] for h in reversed(range(q.size(1)))], 1)`` puts the rank's last head first, where one
    device puts its last of all (1.8e-2 before, no error)."""
    step, params, batches = _step(lambda q: torch.stack([q[:, h] for h in reversed(range(q.size(1)))], 1))
    with pytest.raises(ValueError, match=r"tensor parallel gives each rank its own heads, 2 of them here, 1/tp of all, "
                                         r"and the module that takes them \('0\.attn'\) picks heads by their number: "
                                         r"it gathers a value read from each "
                                         r"of this rank's 2 heads \(stack at test_tp_head_loop_numbers\.py:\d+ in "
                                         r"<lambda>\) in the order of heads \[1, 0\]"):
        sw.tensor_parallel(step, "tp", _PLAN).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_refusal_at_the_first_step() -> None:
    step, params, batches = _step(SILENT[0][1])
    with pytest.raises(sw.collectives.RankFailed, match=r"passes a head number of range\(\) .* to as_tensor"):
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _PLAN), step, sw.Mesh(tp=2), batches, params,
                                     rtol=1e-9)


def _written_head_by_head(q: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(q)
    for h in range(q.size(1)):
        out[:, h] = q[:, h] * 2.0
    fresh = q.new_zeros(q.shape)
    for h in range(q.size(1)):
        fresh.select(1, h).copy_(q[:, h])
    return out + fresh


def _index_tensors_of_head_numbers(q: torch.Tensor) -> torch.Tensor:
    picked = torch.cat([q.index_select(1, torch.tensor([h])) for h in range(q.size(1))], 1) + q[:, range(q.size(1))]
    first = torch.ones(q.size(1), dtype=torch.long).cumsum(0) - 1  # the rank's heads in their places
    return picked + q[:, first]


def _sized_by_the_count_elementwise(q: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(q.size(1), dtype=q.dtype)
    for h in range(q.size(1)):
        mask[h] = 1.0
    outs: list[Any] = [None] * q.size(1)
    for h in reversed(range(q.size(1))):
        outs[h] = q[:, h] * 0.5
    ones = torch.tensor([1.0] * q.size(1), dtype=q.dtype)
    return q * mask[None, :, None, None] + torch.stack(outs, 1) * ones.view(1, -1, 1, 1) * q.new_ones(
        1, q.size(1), 1, 3).mean(-1, keepdim=True)


@pytest.mark.parametrize("op", [_written_head_by_head, _index_tensors_of_head_numbers, _sized_by_the_count_elementwise],
                         ids=lambda op: op.__name__.strip("_"))
def test_head_numbers_and_sizes_that_name_the_ranks_heads_in_their_places_equal_one_device(op: Op) -> None:
    step, params, batches = _step(op)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", _PLAN), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


def _range_as_python_takes_it(q: torch.Tensor) -> torch.Tensor:
    heads = range(q.size(1))
    assert isinstance(heads, range) and isinstance(heads, collections.abc.Sequence)
    scale = {range(q.size(1)): 2.0}[heads]  # (hashable, as a range)
    out = torch.empty_like(q)
    for h in random.Random(0).sample(heads, q.size(1)):  # (a sequence)
        out[:, h] = q[:, h] * scale
    parts = list(q.unbind(1))
    return out + torch.stack([parts[operator.index(h)] for h in heads], 1) + q * torch.ones(
        q.size(1), 3, dtype=q.dtype).sum(axis=1)[None, :, None, None]


def _reversed_then_flipped_back(q: torch.Tensor) -> torch.Tensor:
    return torch.stack([q[:, h] for h in reversed(range(q.size(1)))], 1).flip(1)


@pytest.mark.parametrize("region", [False, True], ids=["no_region", "region"])
def test_range_of_head_numbers_reads_as_a_range_where_python_asks(region: bool) -> None:
    """``isinstance(.., range)``, a dict key, ``random.sample``, ``operator.index(h)`` of a list, ``sum(axis=1)`` of a
    tensor sized by the count along another dim: as on one device (refused or crashed in review's probes)."""
    step, params, batches = _step(_range_as_python_takes_it)
    plan = {"*.attn": sw.tp.Region(heads=()), **_PLAN} if region else _PLAN
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)


def test_heads_gathered_out_of_order_and_put_back_pass_inside_a_region() -> None:
    """A Region's probe runs the module whole and compares (a reorder put back equals it); without a Region the
    gathered order is refused at the stack, before the flip that puts it back (a known cost of judging there)."""
    step, params, batches = _step(_reversed_then_flipped_back)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", {"*.attn": sw.tp.Region(heads=()), **_PLAN}), step,
                                 sw.Mesh(tp=2), batches, params, rtol=1e-9)
    with pytest.raises(ValueError, match=r"it gathers a value read from each of this rank's 2 heads"):
        sw.tensor_parallel(step, "tp", _PLAN).plan(sw.Mesh(tp=2), params, batches[0])


def test_range_over_the_ranks_head_count_reads_as_a_range_of_head_numbers() -> None:
    from shardwise.transforms.tensor_parallel.head_numbers import HeadCount, HeadIndex, HeadIndexValue, HeadRange

    numbers = HeadRange(range(1, 4), "a head number")
    assert list(numbers) == [1, 2, 3] and len(numbers) == 3 and numbers == range(1, 4) and 2 in numbers
    assert all(type(n) is HeadIndex for n in (*numbers, *reversed(numbers), numbers[0]))
    assert numbers[1:] == range(2, 4) and isinstance(numbers[1:], HeadRange)
    h = numbers[0]
    assert type(h + 1) is HeadIndex and type(h + 1.0) is HeadIndexValue and type(2 ** -h) is HeadIndexValue
    assert type(2.0 ** -h) is float  # float's own method takes an int first: what the docstrings list as unseen
    assert type(HeadCount(4, "count") - h) is HeadIndex  # (a head number counted from the end: still a number)
    assert type(HeadCount(4, "count") // HeadCount(2, "count")) is int  # (a ratio of two counts: the whole's)
