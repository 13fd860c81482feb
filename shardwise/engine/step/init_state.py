"""How ``Step.init`` builds a rank's parameters: one layer at a time, only what the rank holds.

For each layer the rank holds (its pipeline stages', and copies of tied weights it uses), the
layer's full values are made or read (a meta parameter from the chain's initializer, seeded per
parameter path; a real one as given), cut to the rank's tensor-parallel slices, copied into the
master dtype and cut to the rank's ZeRO shard; then the full values are dropped before the next
layer. So init's peak is the rank's shards plus one full layer, not the model. At ZeRO stages 1-2,
where a rank holds the full parameters, they are laid out as views of one flat buffer per unit, and
the shard the optimizer updates is a view of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..layout.sharding import FlatSharding
from ..layout.state_layout import StateLayout, local_params
from ..run.rng import preserved, ranks_share_generators, seeded

Params = Mapping[str, Mapping[str, torch.Tensor]]


def meta_names(params: Params) -> list[tuple[str, str]]:
    return [(layer, n) for layer, d in params.items() for n, t in d.items() if t.is_meta]


@contextlib.contextmanager
def init_seeding(seed: int, device: torch.device) -> Iterator[None]:
    """The default generators seeded for one tensor's initializer, and left as they were (thread
    ranks share them, so this takes their turn as a compute does)."""
    shared = ranks_share_generators()
    with preserved(device, shared, True), seeded(seed, device, shared):
        yield


# Reads parameter (layer, name) into a tensor of the rank: its flat shard when the flag says so.
ReadInto = Callable[[str, str, torch.Tensor, bool], None]


def held_params(
    shapes: Params,
    layout: StateLayout,
    index: int,
    dp_index: int,
    make: Callable[[str, list[str]], dict[str, torch.Tensor]],
    to_local: Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    read: ReadInto | None = None,
    device: torch.device | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what the TrainState holds, what the optimizer updates), built one layer at a time.

    ``shapes`` are the parameters as meta tensors; ``make(layer, names)`` gives the full values
    of those parameters of ``layer`` (made or read); ``to_local(layer, values)`` cuts them to
    this rank's tensor-parallel slices in the master dtype, as copies the state owns.

    With ``read`` (a weights file), nothing of a parameter's global shape is made: the rank's
    tensors are made empty on ``device`` as it keeps them (where ZeRO holds shards at rest its unit's flat shard,
    padding zero; else each tensor-parallel slice in the master dtype) and
    ``read(layer, name, into, shard)`` fills each parameter's part of them.
    """
    wanted = local_params(shapes, layout.placement, index)  # the layers (and tied copies) held
    sharding: FlatSharding | None = layout.sharding
    held: dict[str, Any] = {}
    update: dict[str, Any] = {}
    for layer, names in wanted.items():
        unit = None if sharding is None else sharding.units.get(layer)
        if read is None:
            master = to_local(layer, make(layer, list(names)))
        else:
            like = to_local(layer, {n: shapes[layer][n] for n in names})  # meta: what the rank keeps
            if unit is not None and sharding is not None and sharding.holds_shards:
                flat = torch.empty(unit.shard_numel, dtype=like[unit.names[0]].dtype, device=device)
                flat[max(min(unit.numel - dp_index * unit.shard_numel, unit.shard_numel), 0) :].zero_()
                for name in unit.names:
                    read(layer, name, flat, True)
                held[layer] = update[layer] = flat
                continue
            master = {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in like.items()}
            for name, into in master.items():
                read(layer, name, into, False)
        if sharding is None:
            held[layer] = master
            continue
        if unit is not None and not sharding.holds_shards:
            # Stages 1-2: the full parameters are views of the unit's flat buffer, so this rank's
            # shard is a view of their own values (UnitLayout.laid_out), not a copy held beside them,
            # and an in-place update of the shard updates them. The optimizer's init is given that
            # view too (the built-in ones make their state with zeros_like; one that kept the tensor
            # itself would see an in-place step write it, as it would the parameters on one device).
            flat = unit.flatten(master)
            del master
            held[layer], update[layer] = unit.unflatten(flat), unit.shard_in(flat, dp_index)
            continue
        shard = None if unit is None else unit.shard_of(unit.flatten(master), dp_index)
        if shard is not None:
            update[layer] = shard
        if not sharding.holds_shards:
            held[layer] = master
        elif shard is not None:
            held[layer] = shard
        del master  # the full layer goes before the next one is made
    return (held, held) if sharding is None else (held, update)
