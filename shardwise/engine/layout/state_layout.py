"""Where every parameter lives on a mesh: the placement of layers and the per-leaf shard specs.

A :class:`Placement` says which pipeline index holds which layers (without a
pipeline: every layer on every rank, one stage per layer). A :class:`LeafSpec`
says, for one parameter, its global shape and dtype, which pipeline indices hold
a copy (a weight tied across stages has several), and under ZeRO where it sits in
its unit's flat buffer and how that buffer is cut over the data-parallel axis.
:class:`StateLayout` holds both, plus this rank's flat units: it is the static
part of a TrainState, and everything that reads a state's layout (``full_params``,
checkpoints, tensor parallel) reads these instead of a transform's private
types. Under tensor parallelism a :class:`TensorSplit` says which dim of a leaf
the tensor-parallel axis cuts; every other layout (ZeRO units, pipeline copies)
is of the slices a rank computes with.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ...collectives.ops import all_gather, broadcast
from ..model.chain import Chain
from .devices import device_of
from .precision import metric_dtype
from .sharding import FlatSharding

Tied = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Placement:
    """Layers per stage and the pipeline index of each stage (``axis`` None: no pipeline).

    ``tied`` lists every weight whose users sit on more than one pipeline index:
    (owner layer, local name, the indices that use it). Each of those indices holds a
    copy; their gradients are exchanged and summed in index order, so every copy
    takes the same update (Megatron keeps its tied embeddings this way).

    ``backward_from`` is the first stage that runs a backward: the stages before it use no
    trainable parameter (a frozen embedding in front) and their input, the batch, needs no
    gradient, so nothing flows back to them. They run no backward, and the stage at
    ``backward_from`` sends no gradient down (its input carries none).
    """

    axis: str | None
    stages: tuple[tuple[str, ...], ...]
    stage_rank: tuple[int, ...]
    tied: Tied = ()
    backward_from: int = 0

    def __post_init__(self) -> None:
        if len(self.stages) != len(self.stage_rank):
            raise ValueError(f"Placement: {len(self.stages)} stages but {len(self.stage_rank)} stage ranks")

    @classmethod
    def single(cls, chain: Chain) -> Placement:
        """Every layer on every rank, each its own stage (the unit of forward, backward, gathers)."""
        return cls(None, tuple((n,) for n in chain.names), (0,) * len(chain))

    @classmethod
    def pipelined(
        cls, chain: Chain, axis: str, stages: Sequence[Sequence[str]], stage_rank: Sequence[int]
    ) -> Placement:
        stages_t = tuple(tuple(s) for s in stages)
        ranks = tuple(stage_rank)
        return cls(axis, stages_t, ranks, tied_across(chain, stages_t, ranks), first_trained(chain, stages_t))

    @property
    def last(self) -> int:
        return len(self.stages) - 1

    def index_of(self, mesh: Mesh | None, rank: int | None = None) -> int:
        """The pipeline index of ``rank`` (default: the calling rank); 0 without a pipeline."""
        if self.axis is None or mesh is None:
            return 0
        return mesh.axis_index(self.axis) if rank is None else mesh.coords_of(rank)[self.axis]

    def layers_of(self, index: int) -> tuple[str, ...]:
        """The layers pipeline index ``index`` holds (its stages', in order)."""
        return tuple(n for s, layers in enumerate(self.stages) if self.stage_rank[s] == index for n in layers)

    def replicas_of(self, index: int) -> list[tuple[str, str]]:
        """Tied weights ``index`` holds a copy of without owning their layer."""
        mine = set(self.layers_of(index))
        return [(owner, name) for owner, name, users in self.tied if index in users and owner not in mine]

    def stage_of(self, layer: str) -> int:
        for s, layers in enumerate(self.stages):
            if layer in layers:
                return s
        raise KeyError(f"no stage holds layer {layer!r}")


def first_trained(chain: Chain, stages: tuple[tuple[str, ...], ...]) -> int:
    """The first stage whose layers use a trainable parameter (owned or tied), or the last stage: a
    gradient flows back to a stage only from there on (the batch needs none)."""
    return next(
        (s for s, layers in enumerate(stages) if any(chain[n].param_names for n in layers)), len(stages) - 1
    )


def tied_across(chain: Chain, stages: tuple[tuple[str, ...], ...], stage_rank: tuple[int, ...]) -> Tied:
    """Every tied weight whose users sit on more than one pipeline index, with those indices."""
    rank_of_layer = {n: stage_rank[s] for s, layers in enumerate(stages) for n in layers}
    users: dict[tuple[str, str], set[int]] = {}
    for layer in chain.layers:
        for owner, name in layer.ties.values():
            users.setdefault((owner, name), {rank_of_layer[owner]}).add(rank_of_layer[layer.name])
    return tuple((o, n, tuple(sorted(r))) for (o, n), r in sorted(users.items()) if len(r) > 1)


@dataclass(frozen=True)
class TensorSplit:
    """How tensor parallelism cuts one parameter: ``dim`` into ``parts`` equal slices over ``axis``.

    With ``blocks`` > 1 the dim is ``blocks`` equal blocks (a fused q, k, v projection), each cut
    into ``parts``: a rank holds its slice of every block, concatenated.
    """

    axis: str
    dim: int
    parts: int
    blocks: int = 1

    def __post_init__(self) -> None:
        if self.parts < 1 or self.blocks < 1:
            raise ValueError(f"TensorSplit: parts={self.parts} and blocks={self.blocks} must be positive")

    def check(self, shape: Sequence[int], where: str) -> None:
        """Refuse a global ``shape`` this split does not divide, naming the parameter."""
        if self.dim >= len(shape):
            raise ValueError(
                f"{where} has shape {list(shape)}, which has no dim {self.dim} to split over {self.axis!r}"
            )
        if shape[self.dim] % (self.parts * self.blocks):
            fused = f" ({self.blocks} fused blocks, each split {self.parts} ways)" if self.blocks > 1 else ""
            raise ValueError(
                f"{where} has shape {list(shape)}: dim {self.dim} ({shape[self.dim]}) does not split into "
                f"{self.parts * self.blocks} equal parts{fused} over axis {self.axis!r}; use a tensor-parallel "
                f"size that divides it, or leave this parameter replicated"
            )

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] //= self.parts
        return tuple(out)

    def global_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] *= self.parts
        return tuple(out)

    def local(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """Axis index ``index``'s slice of the whole parameter ``full`` (a copy)."""
        if full.is_meta:  # shapes only (a Plan of a meta-built model): no chunks to cut and join
            return torch.empty(self.local_shape(full.shape), dtype=full.dtype, device="meta")
        blocks = full.chunk(self.blocks, self.dim) if self.blocks > 1 else (full,)
        return torch.cat([b.chunk(self.parts, self.dim)[index] for b in blocks], self.dim).clone()

    def to_global(
        self, offsets: Sequence[int], box: torch.Tensor, index: int, shape: Sequence[int]
    ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """A box of axis index ``index``'s slice (at ``offsets`` in the slice) as boxes of the whole
        parameter of ``shape``: (their offsets in it, their values), one per fused block it spans."""
        d, width, start = self.dim, box.shape[self.dim], offsets[self.dim]
        block = shape[d] // self.blocks  # one fused block of the whole; the slice holds 1/parts of each
        mine = block // self.parts
        out = []
        at = start
        while at < start + width:
            b = at // mine
            stop = min(start + width, (b + 1) * mine)
            moved = list(offsets)
            moved[d] = b * block + index * mine + (at - b * mine)
            out.append((tuple(moved), box.narrow(d, at - start, stop - at)))
            at = stop
        return out

    def join(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole parameter from every index's slice, in axis order."""
        per_rank = [p.chunk(self.blocks, self.dim) for p in pieces]
        return torch.cat([per_rank[r][b] for b in range(self.blocks) for r in range(len(pieces))], self.dim)


@dataclass(frozen=True)
class LeafCopy:
    """One pipeline index's copy of a parameter; under ZeRO, where it sits in that index's unit."""

    index: int
    unit: str | None = None  # the unit (flat buffer) holding it, under ZeRO
    offset: int = 0  # its first element in the unit's flat buffer
    unit_numel: int = 0  # the unit's padded length: ``shards`` equal shards of it


@dataclass(frozen=True)
class LeafSpec:
    """One parameter of the model: its global shape and dtype (as stored: the master dtype),
    the pipeline indices holding a copy (the owner's first), and the data-parallel sharding."""

    layer: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    copies: tuple[LeafCopy, ...]
    pipeline_axis: str | None = None
    dp_axis: str | None = None  # ZeRO: the axis the flat units are cut over
    zero_stage: int | None = None
    shards: int = 1
    split: TensorSplit | None = None  # tensor parallel: how the tensor-parallel axis cuts it
    replicate_axis: str | None = None  # HSDP: the axis whose every index holds the same flat shards
    # ZeRO: whether the state holds the shard at rest (FlatSharding.holds_shards), not the whole parameter
    held_as_shard: bool = False

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape one rank's layers compute with: ``shape`` cut by the tensor-parallel split."""
        return self.shape if self.split is None else self.split.local_shape(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        where = (
            f"pipeline indices {[c.index for c in self.copies]} of {self.pipeline_axis!r}"
            if self.pipeline_axis
            else "every rank"
        )
        zero = ""
        if self.dp_axis:
            sharded = "kept as" if self.held_as_shard else "whole at rest, updated in"  # ZeRO-1/2 shard the state
            zero = f", ZeRO-{self.zero_stage}: {sharded} a flat shard over {self.dp_axis!r} of {self.shards}"
            if self.replicate_axis:
                zero += f", replicated over {self.replicate_axis!r}"
        split = self.split
        cut = "" if split is None else f", dim {split.dim} split over {split.axis!r} in {split.parts}" + (
            f" (each of {split.blocks} fused blocks)" if split.blocks > 1 else ""
        )
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.layer}.{self.name}: {list(self.shape)} {dtype} on {where}{zero}{cut}"


def leaf_specs(
    params: Mapping[str, Mapping[str, torch.Tensor]],
    placement: Placement,
    shardings: Mapping[int, FlatSharding | None],
    splits: Mapping[tuple[str, str], TensorSplit] | None = None,
) -> dict[tuple[str, str], LeafSpec]:
    """The spec of every parameter, from the (master-dtype, possibly meta) params as a rank computes
    with them (cut by ``splits`` under tensor parallelism), the placement and each pipeline index's
    flat units. The spec's shape is the whole parameter's."""
    splits = splits or {}
    holders: dict[tuple[str, str], list[int]] = {}
    for index in sorted(set(placement.stage_rank)):
        for layer in placement.layers_of(index):
            for name in params.get(layer, {}):
                holders.setdefault((layer, name), []).append(index)
        for key in placement.replicas_of(index):
            holders.setdefault(key, []).append(index)
    specs: dict[tuple[str, str], LeafSpec] = {}
    for (layer, name), found in holders.items():
        t = params[layer][name]
        owner = placement.stage_rank[placement.stage_of(layer)]
        indices = sorted(found, key=lambda i: (i != owner, i))  # the owner's copy first
        copies = []
        shard_info: tuple[str | None, int | None, int] = (None, None, 1)
        replicate, held_as_shard = None, False
        for index in indices:
            sharding = shardings.get(index)
            if sharding is None or layer not in sharding.units:
                copies.append(LeafCopy(index))
                continue
            unit = sharding.units[layer]
            offset = 0
            for n, numel in zip(unit.names, unit.numels, strict=True):
                if n == name:
                    break
                offset += numel
            copies.append(LeafCopy(index, layer, offset, unit.padded_numel))
            shard_info = (sharding.axis, sharding.stage, unit.shards)
            replicate, held_as_shard = sharding.replicate, sharding.holds_shards
        split = splits.get((layer, name))
        shape = tuple(t.shape) if split is None else split.global_shape(t.shape)
        specs[(layer, name)] = LeafSpec(
            layer, name, shape, t.dtype, tuple(copies), placement.axis, *shard_info, split=split,
            replicate_axis=replicate, held_as_shard=held_as_shard,
        )
    return specs


class BoundedCache(dict[Any, Any]):
    """A dict that forgets its least recently used entry past ``size`` entries: a layout memoises
    per input layout (batch shapes), and a run whose sequence lengths vary must not grow it without
    end, nor lose what every step reads (its actions) to the shapes it saw once."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __getitem__(self, key: Any) -> Any:
        value = super().pop(key)  # KeyError as a dict raises it
        super().__setitem__(key, value)  # now the most recently used
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default  # noqa: SIM401 (self.get would recurse)

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self:
            super().pop(key)
        elif len(self) >= self.size:
            super().pop(next(iter(self)))
        super().__setitem__(key, value)

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return BoundedCache, (self.size,)  # a cache travels empty


class ModelTag:
    """Which model a layout was made for: a weak reference to the step's chain (its ``base_chain``),
    whose buffers and frozen parameters a checkpoint writes beside the state's parameters. Weak, so a
    state does not keep a model alive; a pickled layout carries an empty tag (the model is not known
    there, and nothing is checked), a deep copy of one in this process the same model's."""

    def __init__(self, chain: Chain | None = None) -> None:
        self.ref = None if chain is None else weakref.ref(chain)  # (read inline on the step's hot path)

    @property
    def chain(self) -> Chain | None:
        """The chain, while it lives; else None."""
        return None if self.ref is None else self.ref()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return ModelTag, ()  # a tag travels empty: a weak reference does not pickle

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelTag:
        return self  # the same model: a copy of a layout is still that model's


@dataclass(frozen=True)
class StateLayout:
    """The static part of a TrainState: how the parameters are laid out on the mesh.

    ``sharding`` is this rank's flat units (None without ZeRO); ``leaves`` the spec of
    every parameter of the model; ``layers`` the keys of the full params pytree, in
    order; ``stack`` the transforms that made the state (their text forms).
    """

    placement: Placement
    sharding: FlatSharding | None
    leaves: dict[tuple[str, str], LeafSpec]
    layers: tuple[str, ...]
    stack: tuple[str, ...]
    schedule: Any = None  # the pipeline's Schedule, when there is one
    # The optimizer's state: per path of a subtree shaped like the parameters (``"momentum"``,
    # ``"exp_avg"``), each parameter's spec as that state holds it (its dtype; split, copied and
    # sharded as the parameter is); and every other state tensor (step counts) by path, as
    # (shape, dtype), whole on every rank.
    opt_leaves: dict[str, dict[tuple[str, str], LeafSpec]] = field(default_factory=dict)
    opt_scalars: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    # The dtypes of the model's floating tensors that do not train (buffers, frozen parameters):
    # what the metrics' dtype falls back to when no parameter trains (precision.metric_dtype).
    frozen_dtypes: frozenset[torch.dtype] = frozenset()
    # Derived data, memoised per input layout / pipeline index: never part of equality.
    cache: dict[Any, Any] = field(default_factory=lambda: BoundedCache(64), compare=False, repr=False)
    # The model the layout was made for (the step's base chain), never part of equality: a checkpoint
    # refuses to write another model's frozen tensors beside this state's parameters (model_of_state).
    model: ModelTag = field(default_factory=ModelTag, compare=False, repr=False)

    def index_of(self, mesh: Mesh | None) -> int:
        return self.placement.index_of(mesh)

    @functools.cached_property
    def metric_dtype(self) -> torch.dtype:
        """The dtype the metrics' exchange uses: the whole model's (every rank the same), read once."""
        return metric_dtype((spec.dtype for spec in self.leaves.values()), self.frozen_dtypes)

    def describe(self) -> str:
        """One line per parameter, and per optimizer-state leaf."""
        lines = [spec.describe() for spec in self.leaves.values()]
        for path, specs in self.opt_leaves.items():
            lines += [f"optimizer {path}: {spec.describe()}" for spec in specs.values()]
        lines += [f"optimizer {path}: {list(shape)} {str(dtype).removeprefix('torch.')} on every rank"
                  for path, (shape, dtype) in self.opt_scalars.items()]
        return "\n".join(lines)


def local_params(
    params: Mapping[str, Mapping[str, torch.Tensor]], placement: Placement, index: int
) -> dict[str, dict[str, torch.Tensor]]:
    """The parameters pipeline index ``index`` holds: its layers', and copies of tied weights."""
    mine = set(placement.layers_of(index))
    local = {k: dict(v) for k, v in params.items() if k in mine}
    for owner, name in placement.replicas_of(index):
        local.setdefault(owner, {})[name] = params[owner][name]
    return local


def unit_names(sharding: FlatSharding | None) -> list[str] | None:
    """The ZeRO units of a rank, in order (None without ZeRO)."""
    return None if sharding is None else list(sharding.units)


def meta_shards(sharding: FlatSharding) -> dict[str, torch.Tensor]:
    """This rank's shard of every unit as meta tensors: what ZeRO's optimizer updates, no data."""
    return {u: torch.empty(lay.shard_numel, dtype=lay.dtype, device="meta") for u, lay in sharding.units.items()}


def full_params(layout: StateLayout, held: Any, mesh: Mesh | None) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank gets the complete parameters: :func:`gathered_layer` for every layer, each unit's
    parameters copied out of its gathered buffer where ZeRO holds shards at rest. Collectives: every
    rank calls this together."""
    sharding = layout.sharding
    full: dict[str, dict[str, torch.Tensor]] = {}
    for layer in layout.layers:
        gathered = gathered_layer(layout, held, mesh, layer)
        sharded = sharding is not None and sharding.holds_shards and layer in sharding.units
        full[layer] = {n: t.clone() for n, t in gathered.items()} if sharded else gathered
    return full


def gathered_layer(layout: StateLayout, held: Any, mesh: Mesh | None, layer: str) -> dict[str, torch.Tensor]:
    """``layer``'s whole parameters, gathered from wherever the state keeps them, a layer at a time (an export
    or a one-rank state_dict never holds more than one layer gathered beside the state): where ZeRO holds
    shards at rest (FlatSharding.holds_shards) its unit all-gathered over the data-parallel axis (views of the
    gathered buffer), under a pipeline each parameter broadcast from the index that owns it, tensor-parallel
    slices joined. Collectives: every rank calls it for every layer, in the same order."""
    sharding = layout.sharding
    local: Mapping[str, torch.Tensor]
    if sharding is not None and sharding.holds_shards:
        lay = sharding.units.get(layer)
        local = {} if lay is None else lay.unflatten(all_gather(held[layer], sharding.axis, tiled=True, mesh=mesh))
    else:
        local = held.get(layer, {})
    return {spec.name: _whole_leaf(layout, spec, local.get(spec.name), held, mesh)
            for (owner, _), spec in layout.leaves.items() if owner == layer}


def _whole_leaf(layout: StateLayout, spec: LeafSpec, mine: torch.Tensor | None, held: Any, mesh: Mesh | None
                ) -> torch.Tensor:
    """One parameter whole: broadcast from the pipeline index that owns it (a rank holding no parameter
    at all receives on the CPU), its tensor-parallel slices joined."""
    if layout.placement.axis is not None:
        assert mesh is not None
        # a rank that does not hold the leaf sends nothing (root is the owner) but passes a tensor of its shape
        x = mine if mine is not None else torch.zeros(spec.local_shape, dtype=spec.dtype, device=device_of(held))
        mine = broadcast(x, layout.placement.axis, root=spec.copies[0].index, mesh=mesh)
    assert mine is not None
    split = spec.split
    if split is not None:  # tensor parallel: every index's slice, joined
        assert mesh is not None
        pieces = all_gather(mine.contiguous(), split.axis, mesh=mesh)
        mine = split.join(list(pieces.unbind(0)))
    return mine
