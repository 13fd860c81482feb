"""Buckets: several ZeRO units' gradients, or updated shards, travelling as one collective.

A bucket is laid out rank-major: row ``r`` of its flat buffer holds shard ``r`` of each of its
units, in order. One tiled reduce-scatter of the bucket then leaves every rank of the axis its
own shard of every unit (what the unit's reduce-scatter alone would give it), and one tiled
all-gather of a rank's shards, concatenated, brings back every unit's full buffer as columns of
the rows. A bucket of one unit is the unit's own flat buffer.

Both directions copy each value once: the reduce input is slices of the gradients, per row
(concatenated once where the transport needs one buffer; through shared memory copied straight
into the slots they are sent from), and the gathered parameters are views of the
all-gather's output wherever a parameter's values lie together (within one row, or anywhere in a
bucket of one unit, whose rows follow each other); a parameter split over two ranks' shards of a
bucket of several units is the one copy.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .sharding import Segment, UnitLayout, pieces_of, segments


@dataclass(frozen=True)
class Bucket:
    """Units reduced (and, at stages 1-2, gathered) together, in this order."""

    units: tuple[UnitLayout, ...]

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError("a bucket holds at least one unit")
        if len({u.shards for u in self.units}) != 1:
            raise ValueError(f"bucket {self.names}: its units are cut into different numbers of shards")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.unit for u in self.units)

    @property
    def shards(self) -> int:
        return self.units[0].shards

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each unit's shard starts in a row."""
        out, at = [], 0
        for u in self.units:
            out.append(at)
            at += u.shard_numel
        return tuple(out)

    @property
    def shard_numel(self) -> int:
        return sum(u.shard_numel for u in self.units)

    @functools.cached_property
    def _reduce_segments(self) -> tuple[tuple[tuple[int, tuple[Segment, ...]], ...], ...]:
        """Per row of the rank-major buffer: (unit position, its segments) of its values, in order."""
        return tuple(
            tuple(
                (k, tuple(segments(u, r * u.shard_numel, (r + 1) * u.shard_numel))) for k, u in enumerate(self.units)
            )
            for r in range(self.shards)
        )

    def reduce_rows(
        self, grads: Sequence[Mapping[str, torch.Tensor]], device: torch.device | None = None
    ) -> list[list[torch.Tensor]]:
        """The rows of the bucket's rank-major buffer of ``grads`` (one mapping per unit, in order; a
        missing gradient counts as zeros, on ``device`` where a unit has none) as 1-D pieces: slices
        of the gradients, nothing copied."""
        return [
            [piece for k, found in row for piece in pieces_of(found, grads[k], self.units[k].dtype, device)]
            for row in self._reduce_segments
        ]

    def split_shards(self, reduced: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each unit's shard in a reduced bucket (views of it)."""
        return {u.unit: reduced[o : o + u.shard_numel] for u, o in zip(self.units, self.offsets, strict=True)}

    def gather_pieces(self, shards: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shards of the bucket's units, in order: what the all-gather sends, end to end."""
        return [shards[u.unit] for u in self.units]

    @functools.cached_property
    def _row_segments(self) -> tuple[tuple[tuple[str, Segment], ...], ...]:
        """Per row of a gathered bucket (one rank's shards): (unit, segment) of its values, in order."""
        return tuple(
            tuple((u.unit, s) for u in self.units for s in segments(u, r * u.shard_numel, (r + 1) * u.shard_numel))
            for r in range(self.shards)
        )

    def rows_into(
        self, params: Mapping[str, Mapping[str, torch.Tensor]], like: torch.Tensor
    ) -> list[list[torch.Tensor]] | None:
        """Where each row of the gathered bucket goes when written into ``params`` (the units' full
        parameters) instead of a buffer: per row, flat slices of the parameters it holds values of,
        and of one scratch tensor for the padding. None when a parameter is missing or is not a
        contiguous tensor of ``like``'s dtype and device (the gather is then copied in)."""
        for u in self.units:
            held = params.get(u.unit)
            if held is None:
                return None
            for name in u.names:
                t = held.get(name)
                if t is None or not t.is_contiguous() or t.dtype != like.dtype or t.device != like.device:
                    return None
        padding = sum(b - a for row in self._row_segments for _, (param, a, b) in row if param is None)
        scratch = torch.empty(padding, dtype=like.dtype, device=like.device) if padding else None
        rows: list[list[torch.Tensor]] = []
        used = 0
        for row in self._row_segments:
            pieces = []
            for unit, (param, a, b) in row:
                if param is None:
                    assert scratch is not None
                    pieces.append(scratch[used: used + b - a])
                    used += b - a
                else:
                    pieces.append(params[unit][param].view(-1)[a:b])
            rows.append(pieces)
        return rows

    @functools.cached_property
    def _places(self) -> tuple[tuple[str, tuple[tuple[str, tuple[tuple[int, int], ...], torch.Size], ...]], ...]:
        """Per unit, per parameter: where its values lie in a gathered bucket's flat buffer, as
        (start, stop) ranges, one per row it spans (a row is one rank's shards of every unit),
        ranges that touch merged (a bucket of one unit: always one range)."""
        row = self.shard_numel
        out = []
        for u, o in zip(self.units, self.offsets, strict=True):
            s = u.shard_numel
            params = []
            offset = 0
            for name, numel, shape in zip(u.names, u.numels, u.shapes, strict=True):
                ranges: list[tuple[int, int]] = [(o, o)] if numel == 0 else []
                for r in range(offset // s, (offset + numel - 1) // s + 1) if numel else ():
                    a = r * row + o + max(offset - r * s, 0)
                    b = r * row + o + min(offset + numel - r * s, s)
                    if ranges and ranges[-1][1] == a:
                        ranges[-1] = (ranges[-1][0], b)
                    else:
                        ranges.append((a, b))
                params.append((name, tuple(ranges), shape))
                offset += numel
            out.append((u.unit, tuple(params)))
        return tuple(out)

    def unflatten(self, gathered: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """Every unit's parameters from a gathered bucket (all ranks' rows): views of it where a
        parameter's values lie together (within one row, or across the rows of a bucket of one
        unit), else one copy of its pieces; padding dropped."""
        flat = gathered.view(self.shards * self.shard_numel)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for unit, params in self._places:
            got: dict[str, torch.Tensor] = {}
            for name, ranges, shape in params:
                if len(ranges) == 1:
                    a, b = ranges[0]
                    got[name] = flat[a:b].view(shape)
                else:
                    got[name] = torch.cat([flat[a:b] for a, b in ranges]).view(shape)
            out[unit] = got
        return out


@functools.lru_cache(maxsize=512)
def bucket_of(units: tuple[UnitLayout, ...]) -> Bucket:
    """The bucket of ``units``, made once (its layout is worked out on first use, then reused every step)."""
    return Bucket(units)


def bucket_units(
    order: Sequence[str], sizes: Mapping[str, tuple[int, str]], limit: int | None
) -> list[tuple[str, ...]]:
    """Consecutive units of ``order`` grouped into buckets of at most ``limit`` bytes each (a unit
    larger than that alone), a bucket holding one dtype; ``sizes``: unit -> (bytes, dtype).
    ``limit`` None: every unit alone."""
    out: list[list[str]] = []
    total = 0
    for unit in order:
        nbytes, dtype = sizes[unit]
        if limit is not None and out and total + nbytes <= limit and sizes[out[-1][0]][1] == dtype:
            out[-1].append(unit)
            total += nbytes
        else:
            out.append([unit])
            total = nbytes
    return [tuple(b) for b in out]
