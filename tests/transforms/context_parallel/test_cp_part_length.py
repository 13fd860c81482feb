"""Numbers read from the length of the rank's part of the sequence, refused where they become values.

A layer reading ``h.shape[1]`` under context_parallel gets the part's length, t / n: used as a number it trained
another model without an error (TinyGPT-like, cp 2, float64: ``aux * h.shape[1]`` 2.4e-2, ``torch.arange(
x.size(1))`` in a layer 1.2e-3 relative loss error). The watched first call now marks such numbers
(``part_length.py``) and refuses every torch call that uses one as a value, naming the module, the read and
the fix; a read used as a size (a view, a new tensor, a slice over the whole dim) passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

from .test_cp_token_mixing import _step

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
    ("sqrt_scale", lambda x: x / math.sqrt(x.shape[1]), r"turns it into a Python float"),
    ("table_resized_to_it", lambda x: x * F.interpolate(torch.linspace(0, 1, 32, dtype=x.dtype)[None, None],
                                                          size=x.shape[1], mode="linear").mT,
     r"passes it to torch\.nn\.functional\.interpolate as a value"),
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
