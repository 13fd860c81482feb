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
naming its key (unless the call names it ``new`` or ``unused``: a fine-tune's new head,
``new_and_unused.py``), and so is an integer tensor for a floating-point parameter. Values are cast to
the step's master dtype, as ``step.init`` casts real parameters. Buffers and frozen
(``requires_grad=False``) parameters live in the chain, not in the state: their stored values
are copied into the chain's tensors, in their dtype (``buffers.py``), as ``load_state_dict``
fills a module's, so the frozen embedding of a model built on the meta device comes from the
file too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
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
from .new_and_unused import matched, patterns_of, suggested
from .regions import Placed, placed_boxes
from .safetensors_files import SafetensorsFiles
from .save_load import same_save, together
from .tied_copies import refuse_differing_copies


class Store(Protocol):
    where: str

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def read_into(self, key: str, placed: list[Placed]) -> None: ...


class Source:
    """What ``step.init(..., source=)`` reads meta parameters from: a store, by parameter. A parameter
    it does not read (a new head: ``new_and_unused.py``) is made as ``step.init`` makes one, and
    placed into the rank's tensor by ``place``."""

    device = torch.device("cpu")

    def __init__(self, store: Store, keys: Mapping[tuple[str, str], str], new: Sequence[str] = ()) -> None:
        self.store, self.keys, self.new = store, dict(keys), sorted(new)

    def describe(self) -> str:
        return self.store.where + (f", the model's initializer making {self.new}" if self.new else "")

    def reads(self, layer: str, name: str) -> bool:
        return (layer, name) in self.keys

    def read_into(
        self, layer: str, name: str, into: torch.Tensor, layout: StateLayout, mesh: Mesh | None, *, shard: bool
    ) -> None:
        """Parameter ``(layer, name)`` read into ``into``, this rank's tensor of it: its
        tensor-parallel slice, or, when ``shard``, its unit's flat shard (see
        ``regions.placed_boxes``); only the elements it keeps are read."""
        placed = placed_boxes(layout, {} if mesh is None else mesh.coords, layer, name, into, shard=shard)
        self.store.read_into(self.keys[(layer, name)], placed)

    def place(
        self, value: torch.Tensor, layer: str, name: str, into: torch.Tensor, layout: StateLayout,
        mesh: Mesh | None, *, shard: bool,
    ) -> None:
        """The elements of ``value`` (parameter ``(layer, name)``'s global tensor) this rank keeps,
        copied into ``into`` as ``read_into`` reads stored ones."""
        for (offsets, sizes), view in placed_boxes(layout, {} if mesh is None else mesh.coords, layer, name, into,
                                                   shard=shard):
            view.copy_(value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))])


class _Safetensors(SafetensorsFiles):
    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (e.shape, e.dtype) for k, e in self.entries.items()}


def init_from_pretrained(
    step: Any, directory: str | os.PathLike[str], mesh: Mesh | None = None, *, seed: int = 0,
    new: str | Sequence[str] = (), unused: str | Sequence[str] = (),
) -> TrainState:
    """``step.init`` from the safetensors files ``model.save_pretrained(directory)`` wrote (one file
    or shards with ``model.safetensors.index.json``), keyed as ``from_pretrained`` reads them
    (``hf_layout``); each rank reads only what it keeps. ``new``: the model's keys (or fnmatch patterns)
    the files lack, or hold with another shape, that its initializer makes, as ``from_pretrained`` makes
    a new head; ``unused``: stored keys the model lacks, left unread (docs/guide.md, section 9)."""
    call = "init_from_pretrained"
    return _init(step, _Safetensors(directory), mesh, seed, patterns_of(call, "new", new),
                 patterns_of(call, "unused", unused), from_pretrained=True)


def init_from_dcp(
    step: Any,
    path: str | os.PathLike[str],
    mesh: Mesh | None = None,
    *,
    prefix: str = "",
    seed: int = 0,
    new: str | Sequence[str] = (),
    unused: str | Sequence[str] = (),
) -> TrainState:
    """``step.init`` from a DCP checkpoint of a module's state_dict (``prefix="model."`` for
    ``dcp.save({"model": sd})``); each rank reads only the chunks that hold what it keeps.
    ``new`` and ``unused`` as for ``init_from_pretrained``."""
    call = "init_from_dcp"
    return _init(step, DcpFiles(path, prefix), mesh, seed, patterns_of(call, "new", new),
                 patterns_of(call, "unused", unused))


def _init(
    step: Any, store: Store, mesh: Mesh | None, seed: int, new: Sequence[str], unused: Sequence[str], *,
    from_pretrained: bool = False,
) -> TrainState:
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
    expected = module_params(step.base_chain)
    mis_shaped = {key for param, key in names.param_key.items() if key in shapes and param in expected
                  and shapes[key][0] != tuple(expected[param].shape)}
    copies, fresh = _stored_copies(store.where, loaded, shapes, new, unused, mis_shaped)
    if fresh:  # a buffer or frozen parameter named new is made as a left-out one is
        made |= fresh.keys() & names.buffers.keys()
        loaded = without(names, made)
    keys = {param: stored[0] for param, stored in copies.items()}
    _new_params(store.where, step, [k for p, k in names.param_key.items() if p not in keys])
    params: dict[str, dict[str, torch.Tensor]] = {}
    for layer in step.base_chain.layers:
        params[layer.name] = {}
        for n in layer.owned_param_names:
            if (layer.name, n) not in keys:  # new: made by step.init from the model's initializer
                params[layer.name][n] = expected[(layer.name, n)].detach()
                continue
            key = keys[(layer.name, n)]
            shape, dtype = shapes[key]
            want = expected.get((layer.name, n))
            if want is not None and tuple(want.shape) != shape:
                made_of = getattr(store, "made_of", None)  # (hf_layout: a tensor joined from the files' own)
                raise CheckpointError(
                    f"{store.where}: {key!r} has shape {list(shape)}{'' if made_of is None else made_of(key)}, "
                    f"the model's params[{layer.name!r}][{n!r}] "
                    f"{list(want.shape)}; load weights saved from a model of this configuration, or, where the model "
                    f"holds a new head of its own there (a classifier for other labels), pass new={[key]} to make it "
                    "by the model's initializer (as from_pretrained(..., ignore_mismatched_sizes=True))"
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
    state = step.init(params, mesh, seed=seed, source=Source(store, keys, list(fresh)))
    unreplaced = getattr(files, "check_unreplaced", None)
    if unreplaced is not None:  # every rank hears of a replacement one of them read (none goes on alone)
        together(mesh, Source.device, files.where, lambda: unreplaced() or True)
        if isinstance(files, DcpFiles) and files.marker is not None:
            same_save(mesh, files.marker, Path(files.path), Source.device)
    return state


def _new_params(where: str, step: Any, keys: list[str]) -> None:
    """Refuse parameters named new that this step's model cannot make: an eagerly built model's values are the
    params functionalize returned (its chain keeps none, nor a way to make them)."""
    if keys and getattr(step.base_chain, "init", None) is None:
        raise CheckpointError(
            f"{where}: new= names the parameters {keys[:8]}, which this step's model cannot make: it was built "
            "eagerly, and its values are the params functionalize returned. Build the model on the meta device "
            "(`with torch.device('meta'): model = ...`), whose initializer makes them (as from_pretrained "
            "initializes a new head), or load it eagerly with from_pretrained and start with step.init(params)"
        )


def _stored_copies(
    where: str, names: StateDictNames, shapes: Mapping[str, Any], new: Sequence[str], unused: Sequence[str],
    mis_shaped: set[str],
) -> tuple[dict[tuple[str, str], list[str]], dict[str, None]]:
    """The stored keys of each parameter read (its own name first, then the aliases of a tied weight;
    only those stored), and the keys ``new`` names (missing, or stored with another shape than the
    model's: ``mis_shaped``), once every other parameter and buffer is there and nothing else is but
    what ``unused`` names."""
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
    fresh = matched(where, "new", new, [*missing, *sorted(mis_shaped)], "missing (or mis-shaped)") if new else set()
    left = matched(where, "unused", unused, unexpected, "unexpected") if unused else set()
    keys = {param: found for param, found in keys.items() if names.param_key[param] not in fresh}
    missing = [k for k in missing if k not in fresh]
    unexpected = [k for k in unexpected if k not in left]
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the step's module: missing {sorted(missing)[:8]}, "
            f"unexpected {unexpected[:8]}; {_likely_cause(missing, unexpected, names, shapes)}"
        )
    return keys, dict.fromkeys(sorted(fresh))


def _likely_cause(missing: list[str], unexpected: list[str], names: StateDictNames, shapes: Mapping[str, Any]) -> str:
    """What to do about a mismatch: where every unexpected key is a missing one with a prefix added
    or dropped (a save of a wrapped or of an inner module), that prefix; where the files hold most of
    the model, the ``new=`` and ``unused=`` that start it as ``from_pretrained`` does; else load the
    right weights."""
    if missing and len(missing) == len(unexpected):
        for longer, shorter, how in ((unexpected, missing, "with"), (missing, unexpected, "without")):
            head = min(longer)[: max(len(min(longer)) - len(min(shorter)), 0)]
            if head and sorted(k[len(head):] for k in longer if k.startswith(head)) == sorted(shorter):
                return (
                    f"the unexpected keys are the missing ones {how} the prefix {head!r} (a save of "
                    f"{'a module wrapping' if how == 'with' else 'a part of'} the one this step was built from?): "
                    "save the state_dict of the module the step was built from, or rename the keys"
                )
    if len(missing) * 2 < len(names.keys):  # most of the model is there: a new head, or a head left behind?
        args = [f"{arg}={suggested(keys, others)}" for arg, keys, others in (
            ("new", missing, [k for k in names.keys if k not in missing]), ("unused", unexpected, names.keys)) if keys]
        return (
            "load the weights of the model this step was built from; or, to start it from another's (a backbone's "
            f"weights with a new head, as from_pretrained does: it initializes what the files lack and drops what "
            f"the model lacks), pass {' and '.join(args)}"
        )
    return "load the weights of the model this step was built from"
