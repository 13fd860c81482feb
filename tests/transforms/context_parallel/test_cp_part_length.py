"""Numbers read from the length of the rank's part of the sequence, refused where they become values.

A layer reading ``h.shape[1]`` under context_parallel gets the part's length, t / n: used as a number it trained
another model without an error (TinyGPT-like, cp 2, float64: ``aux * h.shape[1]`` 2.4e-2, ``torch.arange(
x.size(1))`` in a layer 1.2e-3 relative loss error). The watched first call now marks such numbers
(``part_length.py``) and refuses every torch call that uses one as a value, naming the module, the read and
the fix; a read used as a size (a view, a new tensor, a slice over the whole dim) passes.
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
import pickle
import random
from collections.abc import Callable
from math import sqrt as bound_sqrt  # names bound before any watch, as a model's module may bind them

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from numpy import arange as bound_arange
from torch import nn

import shardwise as sw

from .test_cp_token_mixing import Block, TinyGPT, _step

Op = Callable[[torch.Tensor], torch.Tensor]

# (id, op, what the refusal says)
AS_VALUES: list[tuple[str, Op, str]] = [
    ("scaled_by_the_length", lambda x: x * x.shape[1] / 8, r"reads x\.shape\[1\] \(4\).* passes it to Tensor\.mul"),
    ("divided_by_size", lambda x: x / x.size(1), r"reads x\.size\(1\) \(4\).* passes it to Tensor\.div"),
    ("times_its_reciprocal", lambda x: x * (1 / x.shape[1]), r"reads x\.shape\[1\] \(4\).* Tensor\.mul"),
    ("by_numel", lambda x: x * (x.numel() / 1000), r"reads x\.numel\(\) \(128\)"),
    ("filled_with_it", lambda x: x * torch.full((1, x.shape[1], 1), x.shape[1], dtype=x.dtype) / 100,
     r"fills a tensor with it \(torch\.full\)"),
    ("linspace", lambda x: x * torch.linspace(0, 1, x.shape[1], dtype=x.dtype)[None, :, None],
     r"passes it to torch\.linspace as a value"),
    ("sqrt_scale", lambda x: x / math.sqrt(x.shape[1]), r"passes it to math\.sqrt"),  # (named where it is taken)
    ("table_resized_to_it", lambda x: x * F.interpolate(torch.linspace(0, 1, 32, dtype=x.dtype)[None, None],
                                                          size=x.shape[1], mode="linear").mT,
     r"passes it to torch\.nn\.functional\.interpolate as a value"),
    # (Python's bit operators and divmod keep the mark; numpy asks an int subclass first)
    ("divmod", lambda x: x * divmod(x.shape[1], 3)[1], r"passes it to Tensor\.mul as a value"),
    ("lshift", lambda x: x * (x.shape[1] << 1) / 8, r"passes it to Tensor\.mul as a value"),
    ("rshift", lambda x: x * (x.shape[1] >> 1) / 8, r"passes it to Tensor\.mul as a value"),
    ("bit_and", lambda x: x * (x.shape[1] & 6) / 8, r"passes it to Tensor\.mul as a value"),
    ("bit_or", lambda x: x * (x.shape[1] | 1) / 8, r"passes it to Tensor\.mul as a value"),
    ("bit_xor", lambda x: x * (x.shape[1] ^ 1) / 8, r"passes it to Tensor\.mul as a value"),
    ("numpy_sqrt", lambda x: x / np.sqrt(x.shape[1]), r"passes it to numpy\.sqrt"),
    ("numpy_log2", lambda x: x * np.log2(x.shape[1]), r"passes it to numpy\.log2"),
    ("numpy_function", lambda x: x * np.clip(x.shape[1], 0, 8), r"passes it to numpy\.clip"),
]
# (Each scales the features by position: a term added alike to every feature of a position would be removed by
# the next LayerNorm, and equal to one device.)
# Positions counted from it: refused where they are used (the first step's watch: the Plan's fake tensors hold
# no values to tell a table of zeros, whose first rows are any rows, by).
COUNTED: list[tuple[str, Op, str]] = [
    ("positions_by_arange", lambda x: x * torch.arange(x.size(1), dtype=x.dtype)[None, :, None] / 100,
     r"computes \w+ with positions counted 0 \.\. t - 1 .*\(torch\.arange\(x\.size\(1\) \(4\)\)\)"),
    ("arange_as_ids_into_a_table", lambda x: x + F.embedding(torch.arange(x.size(1)), torch.linspace(
        0, 1, 32 * 16, dtype=x.dtype).view(32, 16) ** 2), r"computes embedding with positions counted"),
    ("first_rows_of_a_table", lambda x: x * torch.linspace(0, 1, 32, dtype=x.dtype)[: x.shape[1], None],
     r"computes \w+ with positions counted .*the first rows of a \[32\] tensor up to x\.shape\[1\]"),
]


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in AS_VALUES])
def test_a_number_read_from_the_parts_length_used_as_a_value_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=f"Mixer in layer 'blocks.1' .*{what}.*Pass the whole sequence's length in"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in
                                          [AS_VALUES[0], *COUNTED]])
def test_it_is_refused_at_the_first_step(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(sw.collectives.RankFailed, match=f"Mixer in layer 'blocks.1' .*{what}"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def _sizes(x: torch.Tensor) -> torch.Tensor:
    """The length read only to size and reshape: a view, new tensors, slices over the whole dim, a constant
    buffer's first rows."""
    b, t, d = x.shape
    zeros = torch.zeros(1, 32, dtype=x.dtype)
    return (x.view(b, t, 2, d // 2).reshape(b, t, d) + x.new_zeros(b, t, d) + x[:, :t] + x[:, -x.shape[1]:]
            + torch.ones(b, t, 1, dtype=x.dtype).expand(b, t, d) + zeros[:, :t, None])


def test_a_length_read_to_size_and_reshape_is_split() -> None:
    step, params, batches = _step(_sizes)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)


def _table_read_at_counted_positions(x: torch.Tensor) -> torch.Tensor:
    """A rotary-like table read at ``arange(t)`` by indexing (old-style ``cos_cached[position_ids]``) and returned as
    the layer's output part, with no computation on it in between but the residual add's."""
    table = torch.linspace(0, 1, 32 * 16, dtype=x.dtype).view(32, 16) ** 2
    return table[torch.arange(x.shape[1])].expand_as(x).clone()


def test_a_table_indexed_by_counted_positions_is_refused() -> None:
    step, params, batches = _step(_table_read_at_counted_positions)
    with pytest.raises(sw.collectives.RankFailed, match=r"computes __getitem__ with positions counted"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def test_torch_hands_shape_reads_to_the_watch() -> None:
    """The watch relies on torch routing ``Tensor.shape``, ``size``, ``len`` and ``numel`` through a
    TorchFunctionMode (public behaviour, but nothing else checks it): if torch stops, this fails first."""
    from shardwise.transforms.context_parallel.part_length import PartLength
    from shardwise.transforms.context_parallel.unsplit import watched

    x = torch.zeros(2, 4, 3)
    with watched("layer", "cp", 1, x):
        reads = [x.shape[1], x.size(1), x.size()[1], x.numel(), x.shape[0], x.transpose(0, 1).shape[0]]
    assert [type(r) for r in reads] == [PartLength] * 4 + [int, PartLength]
    assert [int(r) for r in reads] == [4, 4, 4, 24, 2, 4]


# New tensors sized by the part's length hold the part's positions along those dims: a sum or running sum of
# them along it is the part's (each was silently wrong before they were tagged: cp 2, float64, relative loss
# errors 8e-5 .. 7e-4).
SIZED_BY_IT: list[tuple[str, Op, str]] = [
    ("ones_cumsum", lambda x: x * torch.ones(x.shape[1], dtype=x.dtype).cumsum(0)[None, :, None] / 100,
     r"takes cumsum of a \[4\] tensor along the sequence"),
    ("ones_sum", lambda x: x * torch.ones(2, x.shape[1], dtype=x.dtype).sum(-1)[:, None, None] / 8,
     r"takes sum of a \[2, 4\] tensor along the sequence"),
    ("new_ones_shape_sum", lambda x: x * x.new_ones(x.shape).sum(1, keepdim=True) / 8,
     r"takes sum of a \[2, 4, 16\] tensor along the sequence"),
    ("zeros_plus_one_cumsum", lambda x: x * (torch.zeros(1, x.shape[1], 1, dtype=x.dtype) + 1).cumsum(1) / 100,
     r"takes cumsum of a \[1, 4, 1\] tensor"),
    ("empty_filled_cumsum", lambda x: x * torch.empty(1, x.shape[1], 1, dtype=x.dtype).fill_(1.0).cumsum(1) / 100,
     r"takes cumsum of a \[1, 4, 1\] tensor"),
    ("tril_of_ones", lambda x: x * torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=x.dtype)).sum(-1)[
        None, :, None] / 8, r"masks a \[4, 4\] tensor by the positions. places in the part \(tril\)"),
    ("ones_cumsum_as_position_ids", lambda x: x * F.embedding(
        torch.ones(x.shape[0], x.shape[1], dtype=torch.long).cumsum(-1) - 1,
        torch.linspace(0, 1, 32 * 16, dtype=x.dtype).view(32, 16) ** 2), r"takes cumsum of a \[2, 4\] tensor"),
    # Made like a tensor that holds positions: its shape, so its dims hold them too (6.7e-4 and 2.9e-4 before)
    ("ones_like_cumsum", lambda x: x * torch.ones_like(x).cumsum(1) / 8,
     r"takes cumsum of a \[2, 4, 16\] tensor along the sequence"),
    ("full_like_sum", lambda x: x * torch.full_like(x[..., :1], 2.0).sum(1, keepdim=True) / 8,
     r"takes sum of a \[2, 4, 1\] tensor along the sequence"),
    # Grown to the part's length, or strided to its shape (1.9e-4 each, the sum 8.0e-5, before)
    ("expand_as_cumsum", lambda x: x * (1 + torch.ones(1, 1, 1, dtype=x.dtype).expand_as(x).cumsum(1) / 8),
     r"takes cumsum of a \[2, 4, 16\] tensor along the sequence"),
    ("expand_as_sum", lambda x: x * torch.ones(1, 1, 1, dtype=x.dtype).expand_as(x).sum(1, keepdim=True) / 8,
     r"takes sum of a \[2, 4, 16\] tensor along the sequence"),
    ("expand_by_the_read_sizes", lambda x: x * (1 + torch.ones(1, 1, 1, dtype=x.dtype).expand(
        x.shape[0], x.shape[1], x.shape[2]).cumsum(1) / 8), r"takes cumsum of a \[2, 4, 16\] tensor"),
    ("broadcast_to_the_shape", lambda x: x * (1 + torch.ones(1, dtype=x.dtype).broadcast_to(x.shape).cumsum(1) / 8),
     r"takes cumsum of a \[2, 4, 16\] tensor"),
    ("repeated_a_dim_of_one", lambda x: x * (1 + torch.ones(1, 1, 1, dtype=x.dtype).repeat(1, x.shape[1], 1).cumsum(
        1) / 8), r"takes cumsum of a \[1, 4, 1\] tensor"),
    ("empty_strided_filled", lambda x: x * (1 + torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).fill_(
        1).cumsum(1) / 8), r"takes cumsum of a \[2, 4, 16\] tensor"),
]


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in SIZED_BY_IT])
def test_a_new_tensor_sized_by_the_parts_length_reduced_along_it_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(sw.collectives.RankFailed, match=f"Mixer in layer 'blocks.1' {what}"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def test_a_new_tensor_sized_by_it_used_elementwise_is_split() -> None:
    step, params, batches = _step(lambda x: x * x.new_ones(x.shape) + 0.01 * torch.ones(x.shape[1], 1, dtype=x.dtype)
                                  * x + torch.zeros(x.shape[0], x.shape[1], 1, dtype=x.dtype).fill_(0.5) * x
                                  + torch.ones_like(x) * x + torch.zeros_like(x).fill_(0.5) * x
                                  + torch.full_like(x, 0.1) + x * torch.ones(1, 1, 1, dtype=x.dtype).expand_as(x)
                                  + x * torch.ones(1, dtype=x.dtype).expand(x.shape[0], x.shape[1], 1))
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)


def test_len_of_a_tensor_whose_dim_0_holds_positions_is_refused() -> None:
    """CPython makes what ``Tensor.__len__`` returns a plain int: ``len(x[0])`` could not be marked (it trained
    another model: 8e-5 relative loss error)."""
    step, params, batches = _step(lambda x: x * len(x[0]) / 8)
    with pytest.raises(sw.collectives.RankFailed, match=r"reads len\(\) of a \[4, 16\] tensor whose dim 0 holds "
                                                          r"the part's positions.*Read it as x\.size\(0\)"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


class _TablePart(nn.Module):
    """A learned position table not listed in ``positions=`` (its name is no position table's), read at its first
    rows: ``nn.Parameter(torch.zeros(1, T, d))`` (nanoGPT / ViT style) or a buffer of zeros."""

    def __init__(self, d: int, trained: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        if trained:
            self.bias_table = nn.Parameter(torch.zeros(1, 32, d))
        else:
            self.register_buffer("bias_table", torch.zeros(1, 32, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + x * self.bias_table[:, : x.shape[1]]


def _table_step(trained: bool) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()
    model.blocks[1].mlp = _TablePart(16, trained).double()
    ids = torch.randint(0, 32, (2, 2, 9), generator=torch.Generator().manual_seed(1))
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
    return step, params, [(x[:, :-1], x[:, 1:]) for x in ids]


def test_a_zero_initialized_trained_position_table_is_refused() -> None:
    """Zeros at the first call, a trained table after the first update: its first rows are not this rank's (it was
    accepted as 'constant along the dim' and diverged at step 1's grad norm, 2.7e-6 relative)."""
    step, params, batches = _table_step(trained=True)
    with pytest.raises(sw.collectives.RankFailed, match=r"computes \w+ with positions counted .*the first rows of a "
                                                          r"\[1, 32, 16\] tensor"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def test_a_buffer_of_zeros_read_at_its_first_rows_is_split() -> None:
    step, params, batches = _table_step(trained=False)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)


# Conversions the watch did not see: each trained another model without an error (TinyGPT, cp 2, float64, relative
# loss error at the second step: int(t) 8.0e-5, np.asarray(t) 8.0e-5, torch.ones(b * t).cumsum(0) 4.2e-4). CPython
# copies what ``__int__`` returns into a plain int, so the mark cannot survive int(): it is refused where the
# model's code or numpy's takes it (``float()`` of a float computed from the length too; numpy reads a scalar or a
# list's items through them). ``np.float64(t)`` was refused already (PartLength's ``__float__``): kept as a guard.
# numpy's functions given one (``np.asarray(t)``, ``np.prod([t, 2])``) are refused before, where they take it
# (host_calls.py).
CONVERTED: list[tuple[str, Op, str]] = [
    ("int_of_the_length", lambda x: x * int(x.shape[1]) / 8, r"reads x\.shape\[1\] \(4\).* turns it into a plain int"),
    ("int_of_a_float_of_it", lambda x: x * int(x.shape[1] * 0.5) / 8,
     r"reads x\.shape\[1\] \(4\).* turns a float computed from it into a plain int"),
    ("float_of_its_reciprocal", lambda x: x * float(1 / x.shape[1]), r"turns it into a Python float \(float\)"),
    ("numpy_asarray", lambda x: x * np.asarray(x.shape[1]).item() / 8, r"passes it to numpy\.asarray"),
    ("numpy_float64", lambda x: x * np.float64(x.shape[1]) / 8, r"turns it into a Python float"),
    ("numpy_prod_of_a_list", lambda x: x * int(np.prod([x.shape[1], 2])) / 16, r"passes it to numpy\.prod"),
]


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in CONVERTED])
def test_a_number_read_from_the_parts_length_converted_by_the_model_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=f"Mixer in layer 'blocks.1' .*{what}.*Pass the whole sequence's length in"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


def test_int_of_the_length_is_refused_as_a_size_too_with_the_fix() -> None:
    """``int(t)`` cannot be told a size from a value where it is taken: refused, saying the read needs no int()."""
    step, params, batches = _step(lambda x: x.view(x.shape[0], int(x.shape[1]), -1))
    with pytest.raises(ValueError, match=r"a size needs no int\(\): pass the read as it is"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


def test_torch_and_shardwise_taking_int_of_the_length_is_not_refused() -> None:
    """The watch's own reads and torch's (``int(t)`` inside their code) are not the model's conversions."""
    from shardwise.transforms.context_parallel.part_length import PartLength, watching

    def refuse(origin: str, what: str) -> None:
        raise AssertionError(what)

    before = watching(refuse)
    try:
        t = PartLength(4, "t", 4)
        assert torch.ones(2, 3).new_zeros(t).shape == (4,)  # (the factory reads its size in C)
        assert _int_here(t) == 4 and math.prod([t, 2]) == 8
        with pytest.raises(AssertionError, match="plain int"):
            int(t)
    finally:
        watching(before)


def _int_here(t: int) -> int:
    globals_ = {"__name__": "torch.fake_internal", "t": t}
    return int(eval("int(t)", globals_))  # (a frame whose module is torch's)


# Rows folded with the part's length by a product with plain ints, in the order written, hold its positions:
# ``torch.ones(b * t)`` is (batch, sequence), ``torch.ones(t * 2)`` two entries inside each position.
FOLDED_BY_IT: list[tuple[str, Op, str]] = [
    ("ones_b_times_t_cumsum", lambda x: x * torch.ones(x.shape[0] * x.shape[1], dtype=x.dtype).cumsum(0).view(
        x.shape[0], x.shape[1], 1) / 100, r"takes cumsum of a \[8\] tensor along the sequence"),
    ("ones_t_times_2_viewed_cumsum", lambda x: x * torch.ones(x.shape[1] * 2, dtype=x.dtype).view(
        x.shape[1], 2).cumsum(0)[None, :, :1] / 100, r"takes cumsum of a \[4, 2\] tensor along the sequence"),
]


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in FOLDED_BY_IT])
def test_a_new_tensor_of_rows_folded_with_the_parts_length_reduced_along_them_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(sw.collectives.RankFailed, match=f"Mixer in layer 'blocks.1' {what}"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def _mixtral_rows(x: torch.Tensor) -> torch.Tensor:
    """Mixtral's ``zeros(b * t, d)``, a target its experts' token rows are put back into by ``index_add_``."""
    b, t, d = x.shape
    rows = x.reshape(-1, d)
    picked = torch.where(rows[:, 0] > 0)[0]
    out = torch.zeros(b * t, d, dtype=x.dtype)
    out.index_add_(0, picked, rows[picked] * 2)
    return out.reshape(b, t, d)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
@pytest.mark.parametrize("op", [
    pytest.param(_mixtral_rows, id="mixtral_index_add_target"),
    pytest.param(lambda x: x * torch.ones(x.shape[0] * x.shape[1], dtype=x.dtype).view(x.shape[0], x.shape[1], 1),
                 id="ones_b_times_t_elementwise"),
    pytest.param(lambda x: x + torch.zeros(x.shape[1] * 2, 8, dtype=x.dtype).view(x.shape[1], 16)[None],
                 id="zeros_t_times_2_viewed"),
])
def test_a_new_tensor_of_rows_folded_with_it_used_row_by_row_is_split(op: Op, attention: str) -> None:
    step, params, batches = _step(op)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp", attention=attention), step, sw.Mesh(cp=2), batches,
                                 params, rtol=1e-12)


# A comparison of the part's length steers the layer: each marked number knows what one device has in its place
# (``whole``: the whole sequence's length, and what is computed from it), so a comparison that one device would
# answer otherwise is refused (``x * 2 if t > 6``: 2.9e-4 relative loss error at the second step before).
BRANCHES: list[tuple[str, Op, str]] = [
    ("greater_than", lambda x: x * (2.0 if x.shape[1] > 6 else 1.0), r"compares it \(> 6\): False here, True for"),
    ("equal_to", lambda x: x * 2 if x.size(1) == 8 else x, r"compares it \(== 8\): False here, True for"),
    ("reflected", lambda x: x * 2 if 6 < x.shape[1] else x,  # noqa: SIM300 (the reflected comparison)
     r"compares it \(> 6\): False here, True for"),
    ("computed_from_it", lambda x: x * 2 if x.shape[1] // 2 >= 3 else x, r"compares it \(>= 3\)"),
    ("min_of_it", lambda x: x * min(x.shape[1], 6) / 8, r"compares it \(< 6\)|compares it \(> 6\)"),
]


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in BRANCHES])
def test_a_comparison_one_device_would_answer_otherwise_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=f"Mixer in layer 'blocks.1' reads x.(shape|size).*{what}"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


def _same_branch(x: torch.Tensor) -> torch.Tensor:
    """Comparisons one device answers alike: a bound the sequence is within, two reads of one length."""
    t = x.shape[1]
    assert t <= 64 and t == x.size(1) and t != 0
    return x[:, : min(t, 100)] * 2 if t < 100 else x


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_a_comparison_one_device_answers_alike_is_split(attention: str) -> None:
    step, params, batches = _step(_same_branch)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp", attention=attention), step, sw.Mesh(cp=2), batches,
                                 params, rtol=1e-12)


# Calls that read the length's value in C, asking it nothing (host_calls.py): each trained another model without an
# error (TinyGPT, cp 2, float64, relative loss error at the second step: len(range(t)) 8.0e-5; list(range(t)),
# np.arange(t) as positions and math.sqrt(1 / t) 1.3e-4 each; math.isqrt(t) gave the same number for 4 and 8 here).
TAKEN_IN_C: list[tuple[str, Op, str]] = [
    ("len_of_range", lambda x: x * len(range(x.shape[1])) / 8, r"passes it to range\(\)"),
    ("positions_from_range", lambda x: x * torch.tensor(list(range(x.shape[1])), dtype=x.dtype)[None, :, None] / 100,
     r"passes it to range\(\)"),
    ("numpy_arange", lambda x: x * torch.from_numpy(np.arange(x.shape[1])).to(x.dtype)[None, :, None] / 100,
     r"passes it to numpy\.arange"),
    ("math_sqrt_of_its_reciprocal", lambda x: x * math.sqrt(1 / x.shape[1]), r"passes it to math\.sqrt"),
    ("math_isqrt", lambda x: x * math.isqrt(x.shape[1]) / 2, r"passes it to math\.isqrt"),
    # numpy's functions that read a size or a count in C, asking it nothing (each trained another model: relative
    # loss error 3.0e-6, 5.8e-4 and 5.8e-4 at the first step)
    ("numpy_linspace", lambda x: x * torch.from_numpy(np.linspace(0, 1, x.shape[1])).to(x.dtype)[None, :, None],
     r"passes it to numpy\.linspace"),
    ("numpy_ones_counted", lambda x: x * torch.from_numpy(np.ones(x.shape[1]).cumsum()).to(x.dtype)[None, :, None] / 10,
     r"passes it to numpy\.ones"),
    ("numpy_zeros_of_a_shape", lambda x: x * torch.from_numpy(
        (np.zeros((x.shape[0], x.shape[1])) + 1).cumsum(1)).to(x.dtype)[..., None] / 10, r"passes it to numpy\.zeros"),
    # A count of items Python makes in C: itertools' islice and repeat, and a list or tuple repeated (relative loss
    # error 5.6e-4, and 5.8e-4 for each of the three others)
    ("itertools_islice", lambda x: x * torch.tensor(
        list(itertools.islice(itertools.count(), x.shape[1])), dtype=x.dtype)[None, :, None] / 10,
     r"passes it to itertools\.islice\(\)"),
    ("itertools_repeat_accumulated", lambda x: x * torch.tensor(
        list(itertools.accumulate(itertools.repeat(1.0, x.shape[1]))), dtype=x.dtype)[None, :, None] / 10,
     r"passes it to itertools\.repeat\(\)"),
    ("list_repeated", lambda x: x * torch.tensor([1.0] * x.shape[1], dtype=x.dtype).cumsum(0)[None, :, None] / 10,
     r"repeats a list that many times"),
    ("tuple_repeated", lambda x: x * torch.tensor(x.shape[1] * (1.0,), dtype=x.dtype).cumsum(0)[None, :, None] / 10,
     r"repeats a tuple that many times"),
    # The same calls by the names this module bound before the watch (each trained as silently: 1.3e-4)
    ("math_sqrt_bound_before", lambda x: x * bound_sqrt(1 / x.shape[1]), r"passes it to math\.sqrt"),
    ("numpy_arange_bound_before",
     lambda x: x * torch.from_numpy(bound_arange(x.shape[1])).to(x.dtype)[None, :, None] / 100,
     r"passes it to numpy\.arange"),
    # Counted on from it (8.0e-5); its bits read by int's own method (1.2e-4, reachable by operator.index(t) too)
    ("enumerate_started_at_it", lambda x: x * sum(i for i, _ in enumerate([0], start=x.shape[1])) / 8,
     r"passes it to enumerate\(\)"),
    ("bit_length", lambda x: x * operator.index(x.shape[1]).bit_length() / 8, r"reads its bits \(bit_length\(\)\)"),
]


@pytest.mark.parametrize(("op", "what"), [pytest.param(op, what, id=name) for name, op, what in TAKEN_IN_C])
def test_a_call_that_reads_the_length_in_c_is_refused(op: Op, what: str) -> None:
    step, params, batches = _step(op)
    with pytest.raises(ValueError, match=f"Mixer in layer 'blocks.1' reads x\\.shape\\[1\\] \\(4\\).* {what}.*Pass "
                                         "the whole sequence's length in"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


def _copied_shapes(x: torch.Tensor) -> torch.Tensor:
    """Copies of the reads (copy, deepcopy, pickle) as sizes: as before the copies (a TypeError of PartLength's
    ``__new__`` before)."""
    shape = pickle.loads(pickle.dumps(x.shape))
    return x + x[:, : copy.copy(x.shape[1])] + x.new_zeros(copy.deepcopy(x.shape)) + x.new_zeros(shape)


def test_a_copy_of_a_read_is_the_same_marked_number() -> None:
    step, params, batches = _step(_copied_shapes)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)
    step, params, batches = _step(lambda x: x * copy.deepcopy(x.shape[1]) / 8)
    with pytest.raises(ValueError, match=r"reads x\.shape\[1\] \(4\).* passes it to Tensor\.mul as a value"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])


def test_operator_index_of_the_length_keeps_its_mark() -> None:
    """``operator.index(t)`` returned a plain ``int`` (positions ``torch.arange`` of it: 7.6e-4 apart in the loss, no
    error): it returns the marked length itself now, judged where it goes as the read is (as ``torch.arange(t)``)."""
    step, params, batches = _step(
        lambda x: x * torch.arange(operator.index(x.shape[1]), dtype=x.dtype)[None, :, None] / 8)
    with pytest.raises(sw.collectives.RankFailed, match=r"Mixer in layer 'blocks.1' computes mul with positions "
                                                          r"counted 0 \.\. t - 1 .*\(torch\.arange\(x\.shape\[1\] "
                                                          r"\(4\)\)\)"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def test_a_call_that_reads_the_length_in_c_is_refused_at_the_first_step() -> None:
    step, params, batches = _step(TAKEN_IN_C[0][1])
    with pytest.raises(sw.collectives.RankFailed, match=r"Mixer in layer 'blocks.1' .*passes it to range\(\)"):
        sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params,
                                     rtol=1e-12)


def _plain_numbers_and_sizes(x: torch.Tensor) -> torch.Tensor:
    """range() and math's functions of plain numbers, and of the length where they keep its mark as a size."""
    assert isinstance(range(2), range) and issubclass(type(range(2)), range)
    heads = [x * (h + 1) for h in range(2)]  # a loop over plain numbers
    t = math.ceil(x.shape[1] / 1)  # (ceil, floor, trunc and prod keep the mark: a size)
    rows = math.prod([x.shape[0], x.shape[1]])
    scale = math.sqrt(0.25) * bound_sqrt(1.0) * bound_arange(2).sum()  # (plain numbers, by bound names too)
    scale = scale * np.ones(2).sum() / np.linspace(0, 2, 3).sum()  # numpy's functions of plain numbers
    scale = scale * sum([0.5] * 2) * len(list(itertools.islice(itertools.repeat(1, 3), 2))) / 2  # and Python's
    scale = scale * sum(i for i, _ in enumerate([0], start=1)) * operator.index(2) / 2
    assert isinstance(itertools.islice([], 1), itertools.islice) and isinstance(itertools.repeat(1), itertools.repeat)
    assert isinstance(enumerate([]), enumerate)
    return (heads[0] + heads[1]) * scale + x[:, :t] + x.reshape(rows, -1).view_as(x) * np.arange(3).sum()


def test_plain_numbers_and_sizes_pass_through_the_watched_calls() -> None:
    step, params, batches = _step(_plain_numbers_and_sizes)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-12)


def test_the_watched_calls_are_the_originals_again_after_a_watch_and_after_a_refusal() -> None:
    import builtins

    originals = (builtins.range, itertools.islice, itertools.repeat, builtins.enumerate, operator.index, math.sqrt,
                 math.isqrt, np.arange, np.linspace, np.ones, bound_sqrt, bound_arange)
    assert (bound_sqrt, bound_arange) == (math.sqrt, np.arange)

    def now() -> tuple[object, ...]:  # this module's own bindings read as a model's code reads them, by name
        return (builtins.range, itertools.islice, itertools.repeat, builtins.enumerate, operator.index, math.sqrt,
                math.isqrt, np.arange, np.linspace, np.ones, globals()["bound_sqrt"], globals()["bound_arange"])

    step, params, batches = _step(_plain_numbers_and_sizes)
    sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])
    assert now() == originals
    for name, op, _ in TAKEN_IN_C:
        if name in ("len_of_range", "math_sqrt_bound_before", "numpy_ones_counted", "itertools_islice",
                    "enumerate_started_at_it"):
            step, params, batches = _step(op)
            with pytest.raises(ValueError, match="passes it to"):
                sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batches[0])
            assert now() == originals


def test_a_modules_own_bindings_stand_in_while_watched_but_the_standard_librarys_do_not() -> None:
    """``from math import sqrt`` in a module that may be the model's is watched; ``random``'s ``_sqrt`` (Python's
    standard library, as torch's, numpy's and shardwise's own) is left the original."""
    from shardwise.transforms.context_parallel.host_calls import calls_watched

    original = math.sqrt
    with calls_watched():
        assert globals()["bound_sqrt"] is not original and globals()["bound_sqrt"] is math.sqrt
        assert random._sqrt is original
        assert globals()["bound_sqrt"](0.25) == 0.5  # a plain number passes
    assert globals()["bound_sqrt"] is original and math.sqrt is original


def test_another_threads_calls_pass_while_a_thread_watches() -> None:
    """The stand-ins stand for every thread while one watches: another thread's range() of a marked number (its own
    code, not a watched layer's) passes, and gets Python's range."""
    import threading

    from shardwise.transforms.context_parallel.host_calls import calls_watched
    from shardwise.transforms.context_parallel.part_length import PartLength, watching

    refused: list[str] = []
    got: list[object] = []
    before = watching(lambda origin, what: refused.append(what))
    try:
        with calls_watched():
            t = PartLength(4, "t", 4)
            worker = threading.Thread(target=lambda: got.append(range(t)))
            worker.start()
            worker.join(timeout=10)
            assert not refused and type(got[0]) is type(range(0)) and list(got[0]) == [0, 1, 2, 3]
            range(t)  # this thread watches: refused
            assert refused and "passes it to range()" in refused[0]
    finally:
        watching(before)
