"""Starting a step from a model's weights on disk, each rank reading only what it keeps.

``init_from_pretrained(step, directory, mesh)`` reads the safetensors files
``model.save_pretrained(directory)`` wrote; ``init_from_dcp(step, path, mesh)`` a
torch.distributed.checkpoint directory of a module's state_dict. Both are ``step.init``
with a source: for each layer the rank holds, its tensors are made empty as the rank keeps
them (at ZeRO-3 its unit's flat shard, padding zero; else each parameter's tensor-parallel
slice, in the master dtype), and only their elements are read into them
(``regions.placed_boxes``), so no tensor of a parameter's global shape is built. A
safetensors file is read run by run (``safetensors_files``); a DCP record by the byte ranges
of the elements kept, once its zip directory has said where its data starts (``dcp_files``).
So a rank reads about its share of the bytes, whatever mesh saved them.

Keys are the module's ``state_dict`` keys; a tied weight may be stored under any of its
names (``save_pretrained`` keeps one), or under several holding equal values (a torch
``state_dict`` holds every name): copies that differ are refused (``tied_copies``). For a
transformers model, safetensors files are read as ``from_pretrained`` reads them (``hf_layout``:
the base_model_prefix, ignored legacy keys, the checkpoint conversion mapping's fused experts,
still only the elements a rank keeps). Every parameter and persistent buffer must be there with
the model's shape, and nothing else: a missing, mis-shaped or unexpected tensor is refused,
naming its key, and so is an integer tensor for a floating-point parameter. Values are cast to
the step's master dtype, as ``step.init`` casts real parameters. Buffers and frozen
(``requires_grad=False``) parameters live in the chain, not in the state: their stored values
are copied into the chain's tensors, in their dtype (``buffers.py``), as ``load_state_dict``
fills a module's, so the frozen embedding of a model built on the meta device comes from the
file too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from ...collectives.mesh import Mesh
from ..layout.state import TrainState
from ..layout.state_layout import StateLayout
from .buffers import restore_from
from .dcp_files import DcpFiles
from .errors import CheckpointError
from .hf_layout import layout_of
from .model_made import Aliased, left_to_the_model, make_left_to_the_model, tied_frozen_names, without
from .names import StateDictNames, module_params, state_dict_names
from .regions import Placed, placed_boxes
from .safetensors_files import SafetensorsFiles
from .save_load import same_save, together
from .tied_copies import refuse_differing_copies


class Store(Protocol):
    where: str

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def read_into(self, key: str, placed: list[Placed]) -> None: ...


class Source:
    """What ``step.init(..., source=)`` reads meta parameters from: a store, by parameter."""

    device = torch.device("cpu")

    def __init__(self, store: Store, keys: Mapping[tuple[str, str], str]) -> None:
        self.store, self.keys = store, dict(keys)

    def describe(self) -> str:
        return self.store.where

    def read_into(
        self, layer: str, name: str, into: torch.Tensor, layout: StateLayout, mesh: Mesh | None, *, shard: bool
    ) -> None:
        """Parameter ``(layer, name)`` read into ``into``, this rank's tensor of it: its
        tensor-parallel slice, or, when ``shard``, its unit's flat shard (see
        ``regions.placed_boxes``); only the elements it keeps are read."""
        placed = placed_boxes(layout, {} if mesh is None else mesh.coords, layer, name, into, shard=shard)
        self.store.read_into(self.keys[(layer, name)], placed)


class _Safetensors(SafetensorsFiles):
    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (e.shape, e.dtype) for k, e in self.entries.items()}


def init_from_pretrained(
    step: Any, directory: str | os.PathLike[str], mesh: Mesh | None = None, *, seed: int = 0
) -> TrainState:
    """``step.init`` from the safetensors files ``model.save_pretrained(directory)`` wrote (one file
    or shards with ``model.safetensors.index.json``), keyed as ``from_pretrained`` reads them
    (``hf_layout``); each rank reads only what it keeps."""
    return _init(step, _Safetensors(directory), mesh, seed, from_pretrained=True)


def init_from_dcp(
    step: Any,
    path: str | os.PathLike[str],
    mesh: Mesh | None = None,
    *,
    prefix: str = "",
    seed: int = 0,
) -> TrainState:
    """``step.init`` from a DCP checkpoint of a module's state_dict (``prefix="model."`` for
    ``dcp.save({"model": sd})``); each rank reads only the chunks that hold what it keeps."""
    return _init(step, DcpFiles(path, prefix), mesh, seed)


def _init(step: Any, store: Store, mesh: Mesh | None, seed: int, *, from_pretrained: bool = False) -> TrainState:
    names = state_dict_names(step.base_chain)
    files = store  # (the files themselves: what a replacement is checked on, whatever reads them below)
    if from_pretrained:  # the keys save_pretrained wrote, read as from_pretrained reads them
        store = layout_of(store, step.base_chain, names)
    aliases = tied_frozen_names(step.base_chain, names, store.shapes())
    if aliases:  # a frozen tied weight stored under one of its names (model_made.py)
        store = Aliased(store, aliases)
    shapes = store.shapes()
    # what from_pretrained leaves to the model's initializer (model_made.py)
    made = left_to_the_model(step.base_chain, names, shapes) if from_pretrained else set()
    loaded = without(names, made) if made else names
    copies = _stored_copies(store.where, loaded, shapes)
    keys = {param: stored[0] for param, stored in copies.items()}
    expected = module_params(step.base_chain)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for layer in step.base_chain.layers:
        params[layer.name] = {}
        for n in layer.owned_param_names:
            key = keys[(layer.name, n)]
            shape, dtype = shapes[key]
            want = expected.get((layer.name, n))
            if want is not None and tuple(want.shape) != shape:
                made_of = getattr(store, "made_of", None)  # (hf_layout: a tensor joined from the files' own)
                raise CheckpointError(
                    f"{store.where}: {key!r} has shape {list(shape)}{'' if made_of is None else made_of(key)}, "
                    f"the model's params[{layer.name!r}][{n!r}] "
                    f"{list(want.shape)}; load weights saved from a model of this configuration"
                )
            if want is not None and want.is_floating_point() and not (dtype.is_floating_point or dtype.is_complex):
                raise CheckpointError(
                    f"{store.where}: {key!r} is stored as {dtype}, the model's params[{layer.name!r}][{n!r}] is "
                    f"{want.dtype}: integer codes (a quantized save, whose scales live elsewhere) are not the "
                    "weights; load a save of the floating-point weights"
                )
            params[layer.name][n] = torch.empty(
                shape, dtype=dtype if want is None else want.dtype, device="meta"
            )
    refuse_differing_copies(store.where, {names.param_key[p]: c for p, c in copies.items() if len(c) > 1},
                            shapes, store.read_into, mesh, Source.device)
    restore_from(store.where, step.base_chain, loaded, shapes, store.read_into)  # buffers.py
    make_left_to_the_model(step.base_chain, names, made, seed)
    state = step.init(params, mesh, seed=seed, source=Source(store, keys))
    unreplaced = getattr(files, "check_unreplaced", None)
    if unreplaced is not None:  # every rank hears of a replacement one of them read (none goes on alone)
        together(mesh, Source.device, files.where, lambda: unreplaced() or True)
        if isinstance(files, DcpFiles) and files.marker is not None:
            same_save(mesh, files.marker, Path(files.path), Source.device)
    return state


def _stored_copies(
    where: str, names: StateDictNames, shapes: Mapping[str, Any]
) -> dict[tuple[str, str], list[str]]:
    """The stored keys of each parameter (its own name first, then the aliases of a tied weight;
    only those stored), once every parameter and buffer is there and nothing else is."""
    aliases: dict[str, list[str]] = {}
    for alias, key in names.aliases.items():
        aliases.setdefault(key, []).append(alias)
    keys, missing = {}, []
    for param, key in names.param_key.items():
        found = [k for k in (key, *aliases.get(key, [])) if k in shapes]
        if found:
            keys[param] = found
        else:
            missing.append(key)
    missing += [k for k in names.buffers if k not in shapes]
    unexpected = sorted(set(shapes) - set(names.keys))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the step's module: missing {sorted(missing)[:8]}, "
            f"unexpected {unexpected[:8]}; {_likely_cause(missing, unexpected)}"
        )
    return keys


def _likely_cause(missing: list[str], unexpected: list[str]) -> str:
    """What to do about a mismatch: where every unexpected key is a missing one with a prefix added
    or dropped (a save of a wrapped or of an inner module), that prefix; else load the right weights."""
    if missing and len(missing) == len(unexpected):
        for longer, shorter, how in ((unexpected, missing, "with"), (missing, unexpected, "without")):
            head = min(longer)[: max(len(min(longer)) - len(min(shorter)), 0)]
            if head and sorted(k[len(head):] for k in longer if k.startswith(head)) == sorted(shorter):
                return (
                    f"the unexpected keys are the missing ones {how} the prefix {head!r} (a save of "
                    f"{'a module wrapping' if how == 'with' else 'a part of'} the one this step was built from?): "
                    "save the state_dict of the module the step was built from, or rename the keys"
                )
    return "load the weights of the model this step was built from"
