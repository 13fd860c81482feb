"""ZeRO's flat sharding, used by shard_params alone and inside a pipeline.

A *unit* is a Chain layer's owned parameters on one rank (on a pipeline rank
that only holds a copy of a weight tied across stages, just that copy). A unit's owned parameters
are flattened in name order into one 1-D buffer,
zero-padded to a multiple of N, and cut into N equal contiguous shards: rank
``i`` of the axis holds ``flat[i * shard : (i + 1) * shard]``. One all-gather
rebuilds the unit; one reduce-scatter shards its gradient. Padding starts at
zero and stays zero (its gradient is zero, so SGD, momentum and AdamW with
decoupled decay keep it at zero); it is cut off before anything is returned.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..torch_api import view_base

# (parameter name or None for padding, start, stop) in that parameter's flattened values
Segment = tuple[str | None, int, int]


def segments(unit: UnitLayout, lo: int, hi: int) -> list[Segment]:
    """The pieces of the unit's flat range ``[lo, hi)``, in order: slices of its parameters and the padding."""
    out: list[Segment] = []
    offset = 0
    for name, numel in zip(unit.names, unit.numels, strict=True):
        start, stop = max(offset, lo), min(offset + numel, hi)
        if start < stop:
            out.append((name, start - offset, stop - offset))
        offset += numel
    start = max(offset, lo)
    if start < hi:
        out.append((None, 0, hi - start))
    return out


def shard_from(unit: UnitLayout, tensors: Mapping[str, torch.Tensor], index: int) -> torch.Tensor:
    """Shard ``index`` of the unit cut from its full parameters: one copy of the shard's values,
    not a flat buffer of the whole unit first."""
    lo = index * unit.shard_numel
    pieces = pieces_of(segments(unit, lo, lo + unit.shard_numel), tensors, unit.dtype)
    if not pieces:
        return torch.empty(0, dtype=unit.dtype)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()


def pieces_of(found: Sequence[Segment], tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
              device: torch.device | None = None) -> list[torch.Tensor]:
    """The 1-D slices ``found`` names (zeros for padding, and for a parameter absent from ``tensors``:
    on the tensors' device, else on ``device``, else on the default one)."""
    like = next(iter(tensors.values()), None)
    out: list[torch.Tensor] = []
    for name, start, stop in found:
        t = tensors.get(name) if name is not None else None
        if t is None:
            device = like.device if like is not None else device
            out.append(torch.zeros(stop - start, dtype=dtype if like is None else like.dtype, device=device))
        else:
            out.append(t.reshape(-1)[start:stop])
    return out


@dataclass(frozen=True)
class UnitLayout:
    """Where each parameter of one unit lives in the unit's flat buffer."""

    unit: str
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    shards: int

    def __post_init__(self) -> None:
        if self.shards <= 0:
            raise ValueError(f"unit {self.unit!r}: the number of shards must be positive, got {self.shards}")

    @classmethod
    def of(cls, unit: str, params: Mapping[str, torch.Tensor], shards: int) -> UnitLayout:
        names = tuple(sorted(params))
        dtypes = {params[n].dtype for n in names}
        if len(dtypes) > 1:
            listing = ", ".join(f"{n}: {params[n].dtype}" for n in names)
            raise ValueError(
                f"shard_params: layer {unit!r} mixes parameter dtypes ({listing}); one flat buffer per "
                "layer needs one dtype: cast the parameters to one dtype first"
            )
        dtype = dtypes.pop() if dtypes else torch.float32
        return cls(unit, names, tuple(params[n].shape for n in names), dtype, shards)

    # Cached: the executor reads these for every unit at every step (the layout never changes).
    @functools.cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def numel(self) -> int:
        """Elements of the unit's parameters, without padding."""
        return sum(self.numels)

    @functools.cached_property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shards)  # ceil

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shards

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def padded_nbytes(self) -> int:
        return self.padded_numel * self.element_size

    @property
    def shard_nbytes(self) -> int:
        return self.shard_numel * self.element_size

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The padded flat buffer of ``tensors`` (params or their gradients)."""
        if self.names and all(tensors[n].is_meta for n in self.names):
            # torch.cat's meta kernel is torch's Python reference, whose import brings torch._dynamo and
            # sympy (about 1.2 s of CPU in each rank): a meta buffer needs only its size and dtype.
            return torch.empty(self.padded_numel, dtype=tensors[self.names[0]].dtype, device="meta")
        pieces = [tensors[n].reshape(-1) for n in self.names]
        if self.padding or not pieces:
            like = pieces[0] if pieces else torch.empty(0, dtype=self.dtype)
            pieces.append(like.new_zeros(self.padding))
        return torch.cat(pieces)

    def laid_out(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The unit's padded flat buffer that ``tensors`` are the views of (as :meth:`unflatten`
        makes them: each parameter after the one before, the padding last), or None where they are
        not. A shard cut from it (:meth:`shard_in`) is then a view of the parameters' own values."""
        base = None
        offset = 0
        for name, numel, shape in zip(self.names, self.numels, self.shapes, strict=True):
            t = tensors.get(name)
            if t is None:
                return None
            base = view_base(t) if base is None else base
            if (base is None or view_base(t) is not base or t.shape != shape or not t.is_contiguous()
                    or t.storage_offset() != base.storage_offset() + offset):
                return None
            offset += numel
        if (base is None or base.dtype != self.dtype or base.dim() != 1 or base.numel() != self.padded_numel
                or not base.is_contiguous()):
            return None
        return base

    def shard_in(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Shard ``index`` of a full flat buffer, a view of it."""
        return flat[index * self.shard_numel : (index + 1) * self.shard_numel]

    def laid_out_empty(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Uninitialized parameters of the unit laid out in a new flat buffer (:meth:`laid_out`), its
        padding zero."""
        flat = torch.empty(self.padded_numel, dtype=self.dtype, device=device)
        flat[self.numel:].zero_()
        return self.unflatten(flat)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the parameters in a full (gathered) flat buffer; the padding is dropped."""
        if flat.numel() != self.padded_numel:
            raise ValueError(
                f"unit {self.unit!r}: flat buffer has {flat.numel()} elements, expected {self.padded_numel}"
            )
        views = torch.split(flat[: self.numel], list(self.numels))
        return {n: v.view(s) for n, v, s in zip(self.names, views, self.shapes, strict=True)}

    def ranges_in_shard(self, names: frozenset[str], index: int) -> list[tuple[int, int]]:
        """Where the parameters ``names`` lie in shard ``index``: (start, stop) offsets into the shard."""
        lo, hi = index * self.shard_numel, (index + 1) * self.shard_numel
        out, offset = [], 0
        for name, numel in zip(self.names, self.numels, strict=True):
            start, stop = max(offset, lo), min(offset + numel, hi)
            if name in names and start < stop:
                out.append((start - lo, stop - lo))
            offset += numel
        return out

    def shard_of(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Shard ``index`` of a full flat buffer (a copy, so the full buffer can be freed)."""
        return flat[index * self.shard_numel : (index + 1) * self.shard_numel].clone()


@dataclass(frozen=True)
class FlatSharding:
    """One rank's units sharded over mesh ``axis`` at ZeRO ``stage`` (1: optimizer state,
    2: + gradients, 3: + parameters at rest); under HSDP the same shards held by every index of
    mesh axis ``replicate``.

    ``shards_at_rest`` (stages 1-2 only): the state holds this rank's master shards, as at stage 3,
    not whole parameters. Chosen under a precision policy that computes in a narrower dtype than it
    stores (``plan.lower.zero_holds_shards``): the step then gathers every unit in the compute dtype
    before its first forward and keeps it to its last backward, and float32 lives only in the
    shards (as DeepSpeed's bf16 ZeRO-1/2 and Megatron's distributed optimizer hold it)."""

    axis: str
    stage: int
    units: dict[str, UnitLayout]
    replicate: str | None = None
    shards_at_rest: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"FlatSharding(stage={self.stage!r}): ZeRO stages are 1, 2 or 3")
        if self.stage == 3 and self.shards_at_rest:
            raise ValueError("FlatSharding(stage=3, shards_at_rest=True): stage 3 always holds shards at rest; "
                             "shards_at_rest chooses that layout for stages 1 and 2")

    @classmethod
    def of(
        cls, axis: str, stage: int, params: Mapping[str, Mapping[str, torch.Tensor]], shards: int,
        replicate: str | None = None, shards_at_rest: bool = False,
    ) -> FlatSharding:
        """One flat layout per layer that holds parameters, in the params' order."""
        units = {u: UnitLayout.of(u, t, shards) for u, t in params.items() if t}
        return cls(axis, stage, units, replicate, shards_at_rest)

    @property
    def holds_shards(self) -> bool:
        """Whether the parameters at rest are this rank's shards (stage 3, and stages 1-2 with
        ``shards_at_rest``) or whole (stages 1-2): then the step's layers read the units it gathers
        (``gather``/``wait_gather``), and no all-gather of the updated shards ends the step."""
        return self.stage == 3 or self.shards_at_rest

    def shards_of(self, params: Mapping[str, Mapping[str, torch.Tensor]], index: int) -> dict[str, torch.Tensor]:
        """This rank's shard of every unit, cut from full parameters."""
        return {u: shard_from(lay, params[u], index) for u, lay in self.units.items()}

    def shards_in(self, params: Mapping[str, Mapping[str, torch.Tensor]], index: int) -> dict[str, torch.Tensor]:
        """This rank's shard of every unit: a view of the parameters' values where they are laid out
        in the unit's flat buffer (``UnitLayout.laid_out``: what ``init`` makes at stages 1-2), so an
        in-place update of the shard is an update of them; elsewhere cut from them (a copy)."""
        out = {}
        for u, lay in self.units.items():
            flat = lay.laid_out(params[u])
            out[u] = shard_from(lay, params[u], index) if flat is None else lay.shard_in(flat, index)
        return out

    def held(self, params: Mapping[str, Mapping[str, torch.Tensor]], index: int) -> Any:
        """What a TrainState holds at rest: the shards (``holds_shards``) or the full parameters."""
        return self.shards_of(params, index) if self.holds_shards else {k: dict(v) for k, v in params.items()}

    def my_shards(self, held: Any, index: int, views: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shards from what the TrainState holds (where it holds whole parameters, cut from
        them; with ``views``, views of their values where they are laid out for it)."""
        if self.holds_shards:
            return dict(held)
        return self.shards_in(held, index) if views else self.shards_of(held, index)

    def shard_nbytes(self) -> int:
        return sum(lay.shard_nbytes for lay in self.units.values())
