"""Starting a step from a model's weights on disk, each rank reading only what it keeps.

``init_from_pretrained(step, directory, mesh)`` reads the safetensors files
``model.save_pretrained(directory)`` wrote; ``init_from_dcp(step, path, mesh)`` a
torch.distributed.checkpoint directory of a module's state_dict. Both are ``step.init``
with a source: its one-layer-at-a-time path asks for each layer's parameters, and each is
read only where this rank keeps it (``regions.wanted_boxes``: its tensor-parallel slice,
and at ZeRO-3 its flat shard of that). A safetensors file is read run by run, so a rank reads
about its share of the bytes; a DCP checkpoint is read chunk by chunk (its records are
``torch.save`` archives whose data cannot be found without reading them), so a rank reads
every chunk that holds any of its elements: its share when the save was sharded alike.

Keys are the module's ``state_dict`` keys; a tied weight may be stored under any of its
names (``save_pretrained`` keeps one). Every parameter must be there with the model's
shape, every persistent buffer with the value the chain holds, and nothing else: a missing,
mis-shaped or unexpected tensor is refused, naming its key. Values are cast to the step's
master dtype, as ``step.init`` casts real parameters.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from ...collectives.mesh import Mesh
from ..layout.state import TrainState
from ..layout.state_layout import StateLayout
from .cut import Box
from .errors import CheckpointError
from .names import StateDictNames, module_params, state_dict_names
from .regions import Placed, ReadInto, assemble, wanted_boxes, whole
from .safetensors_files import SafetensorsFiles
from .state_dict import read_dcp_metadata


class Store(Protocol):
    where: str

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def read(self, key: str, wants: list[Box]) -> torch.Tensor: ...


class Source:
    """What ``step.init(..., source=)`` reads meta parameters from: a store, by parameter."""

    device = torch.device("cpu")

    def __init__(self, store: Store, keys: Mapping[tuple[str, str], str]) -> None:
        self.store, self.keys = store, dict(keys)

    def describe(self) -> str:
        return self.store.where

    def tensors(
        self, layer: str, names: list[str], layout: StateLayout, mesh: Mesh | None
    ) -> dict[str, torch.Tensor]:
        """The parameters ``names`` of ``layer``, each read only where this rank keeps it."""
        at_rest = layout.sharding is not None and layout.sharding.holds_shards
        return {
            n: self.store.read(
                self.keys[(layer, n)], wanted_boxes(layout, mesh, layer, n, shard=at_rest)
            )
            for n in names
        }


class _Safetensors(SafetensorsFiles):
    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (e.shape, e.dtype) for k, e in self.entries.items()}


class DcpFiles:
    """A DCP directory's tensors under ``prefix`` (the prefix removed), read chunk by chunk."""

    def __init__(self, path: str | os.PathLike[str], prefix: str = "") -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path, self.where = Path(path), f"DCP checkpoint {path}"
        self.metadata = read_dcp_metadata(path)
        self.specs = {
            fqn[len(prefix) :]: (fqn, spec)
            for fqn, spec in self.metadata.state_dict_metadata.items()
            if fqn.startswith(prefix) and isinstance(spec, TensorStorageMetadata)
        }

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(spec.size), spec.properties.dtype) for k, (_, spec) in self.specs.items()}

    def read(self, key: str, wants: list[Box]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        fqn, spec = self.specs[key]
        stored = []
        for chunk in spec.chunks:
            info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            stored.append(
                ((tuple(chunk.offsets), tuple(chunk.sizes)), _chunk_reader(self.path, fqn, info))
            )
        return assemble(self.where, key, tuple(spec.size), spec.properties.dtype, wants, stored)


def _chunk_reader(path: Path, fqn: str, info: Any) -> ReadInto:
    def read(pieces: list[Placed]) -> None:
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{path}: {fqn} is stored with transforms {info.transform_descriptors}, "
                "which this reader does not undo"
            )
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            box = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign record: name it
            raise CheckpointError(
                f"{path}: the chunk of {fqn} in {info.relative_path} does not load: {err}"
            ) from None
        for (at, size), view in pieces:
            view.copy_(box[tuple(slice(o, o + s) for o, s in zip(at, size, strict=True))])

    return read


def init_from_pretrained(
    step: Any, directory: str | os.PathLike[str], mesh: Mesh | None = None, *, seed: int = 0
) -> TrainState:
    """``step.init`` from the safetensors files ``model.save_pretrained(directory)`` wrote (one file
    or shards with ``model.safetensors.index.json``); each rank reads only what it keeps."""
    return _init(step, _Safetensors(directory), mesh, seed)


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


def _init(step: Any, store: Store, mesh: Mesh | None, seed: int) -> TrainState:
    names = state_dict_names(step.base_chain)
    shapes = store.shapes()
    keys = _stored_keys(store.where, names, shapes)
    expected = module_params(step.base_chain)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for layer in step.base_chain.layers:
        params[layer.name] = {}
        for n in layer.owned_param_names:
            key = keys[(layer.name, n)]
            shape, dtype = shapes[key]
            want = expected.get((layer.name, n))
            if want is not None and tuple(want.shape) != shape:
                raise CheckpointError(
                    f"{store.where}: {key!r} has shape {list(shape)}, "
                    f"the model's params[{layer.name!r}][{n!r}] "
                    f"{list(want.shape)}; load weights saved from a model of this configuration"
                )
            params[layer.name][n] = torch.empty(
                shape, dtype=dtype if want is None else want.dtype, device="meta"
            )
    _check_buffers(step, store, names)
    return step.init(params, mesh, seed=seed, source=Source(store, keys))


def _stored_keys(
    where: str, names: StateDictNames, shapes: Mapping[str, Any]
) -> dict[tuple[str, str], str]:
    """The stored key of each parameter (its own name, or an alias of a tied weight), once every
    parameter and buffer is there and nothing else is."""
    aliases: dict[str, list[str]] = {}
    for alias, key in names.aliases.items():
        aliases.setdefault(key, []).append(alias)
    keys, missing = {}, []
    for param, key in names.param_key.items():
        found = [k for k in (key, *aliases.get(key, [])) if k in shapes]
        if found:
            keys[param] = found[0]
        else:
            missing.append(key)
    missing += [k for k in names.buffers if k not in shapes]
    unexpected = sorted(set(shapes) - set(names.keys))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the step's module: missing {sorted(missing)[:8]}, "
            f"unexpected {unexpected[:8]}; "
            "load the weights of the model this step was built from"
        )
    return keys


def _check_buffers(step: Any, store: Store, names: StateDictNames) -> None:
    """Buffers are part of the chain (made when it was functionalized): a stored one must agree."""
    for key, (layer, name) in names.buffers.items():
        held = step.base_chain[layer].buffers[name]
        stored = store.read(key, whole(tuple(held.shape)))
        if not torch.equal(stored.to(held.dtype), held.cpu()):
            raise CheckpointError(
                f"{store.where}: buffer {key!r} differs from the chain's; buffers are part of the "
                "chain: load the weights into the module and functionalize it again"
            )
