"""Buckets (engine/layout/buckets.py): the rank-major layout one reduce-scatter and one all-gather
move, against each unit's own flat buffer cut into shards."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from shardwise.engine.layout.buckets import Bucket
from shardwise.engine.layout.sharding import UnitLayout

shapes = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(lambda s: torch.Size(s)),
                  min_size=1, max_size=4)


def _units(unit_shapes: list[list[torch.Size]], shards: int) -> tuple[UnitLayout, ...]:
    return tuple(
        UnitLayout(f"u{k}", tuple(f"p{i}" for i in range(len(ss))), tuple(ss), torch.float32, shards)
        for k, ss in enumerate(unit_shapes)
    )


def _params(units: tuple[UnitLayout, ...]) -> dict[str, dict[str, torch.Tensor]]:
    at = iter(range(1, 1 << 30))
    return {u.unit: {n: torch.tensor([float(next(at)) for _ in range(math.prod(s))]).view(s)
                     for n, s in zip(u.names, u.shapes, strict=True)} for u in units}


def _gathered(bucket: Bucket, params: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """What an all-gather of every rank's shards brings: row r is shard r of each unit, in order."""
    rows = [torch.cat([u.flatten(params[u.unit])[r * u.shard_numel:(r + 1) * u.shard_numel] for u in bucket.units])
            for r in range(bucket.shards)]
    return torch.stack(rows).view(-1)


@given(st.lists(shapes, min_size=1, max_size=3), st.integers(1, 4))
def test_unflatten_gives_every_parameter_back(unit_shapes: list[list[torch.Size]], shards: int) -> None:
    units = _units(unit_shapes, shards)
    bucket = Bucket(units)
    params = _params(units)
    got = bucket.unflatten(_gathered(bucket, params))
    assert set(got) == set(params)
    for unit, tensors in params.items():
        assert set(got[unit]) == set(tensors)
        for name, t in tensors.items():
            assert got[unit][name].shape == t.shape and torch.equal(got[unit][name], t), (unit, name)


@given(shapes, st.integers(1, 4))
def test_a_bucket_of_one_unit_gives_views_of_the_gathered_buffer(unit_shapes: list[torch.Size], shards: int) -> None:
    """Its rows follow each other, so a parameter split over two ranks' shards still lies in one
    piece of the buffer: no copy (what the Plan counts: the gathered buffer alone)."""
    units = _units([unit_shapes], shards)
    bucket = Bucket(units)
    gathered = _gathered(bucket, _params(units))
    got = bucket.unflatten(gathered)
    base = gathered.untyped_storage().data_ptr()
    for name, t in got["u0"].items():
        assert t.untyped_storage().data_ptr() == base, name


def test_in_a_bucket_of_two_units_a_parameter_split_over_two_rows_is_copied_and_equal() -> None:
    units = _units([[torch.Size([3, 2])], [torch.Size([4])]], 2)  # u0: 6 values, 3 a shard; u1: 2 a shard
    bucket = Bucket(units)
    params = _params(units)
    gathered = _gathered(bucket, params)  # row 0: u0[0:3], u1[0:2]; row 1: u0[3:6], u1[2:4]
    got = bucket.unflatten(gathered)
    assert torch.equal(got["u0"]["p0"], params["u0"]["p0"]) and torch.equal(got["u1"]["p0"], params["u1"]["p0"])
    assert got["u0"]["p0"].untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr()
