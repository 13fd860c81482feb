"""A step's parameters as the original module's ``state_dict``, and back; DCP checkpoints of one.

``full_state_dict(step, state)`` gathers the full parameters (a collective) and names
them as the module ``functionalize`` was given named them (``checkpoint_names``):
every key of ``module.state_dict()``, a tied weight's names all holding the one
tensor (as ``state_dict`` gives them), persistent buffers included, so
``module.load_state_dict(sd, strict=True)`` and a transformers model's
``save_pretrained(dir, state_dict=sd)`` take it. ``init_from_state_dict(step,
state_dict, mesh)`` is ``step.init`` from such a dict. ``read_dcp_state_dict(path)``
reads a torch.distributed.checkpoint directory of a module's state_dict into whole
tensors without unpickling anything but DCP's own metadata classes.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ..layout.state import TrainState
from ..layout.state_layout import gathered_layer
from .arguments import check_state, check_step
from .buffers import restore_from
from .file_format import COMMITTED, DCP_META, META, CheckpointError, check_committed, check_unreplaced, marker_of
from .names import module_params, state_dict_names
from .regions import Placed
from .save_load import _consumed, _layout_of, resolve
from .tied_copies import differing_copies_message


def full_state_dict(step: Any, state: TrainState, *, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The module's ``state_dict()`` from a state of ``step`` (every rank calls it: it gathers).

    Every rank gets the whole model, unless ``rank`` names one (a global rank of the state's mesh):
    then only it does, and every other rank returns ``{}``; all go a layer at a time, so no rank
    holds more than its state and one layer gathered besides what it returns (torch's
    ``get_model_state_dict(..., full_state_dict=True, cpu_offload=True)``, for ``torch.save`` of a
    model larger than one rank; ``sw.checkpoint.save_pretrained`` writes safetensors without any
    rank holding the whole).

    >>> import torch, shardwise as sw
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    >>> chain, params = sw.functionalize(model)
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    >>> state, _ = step(step.init(params), (torch.randn(4, 3), torch.randn(4, 1)))
    >>> sd = sw.checkpoint.full_state_dict(step, state)
    >>> sorted(sd), model.load_state_dict(sd, strict=True)
    (['0.bias', '0.weight', '2.bias', '2.weight'], <All keys matched successfully>)
    """
    check_step("full_state_dict(step, state)", step)
    check_state("full_state_dict(step, state)", state)
    problem = _consumed(step, state)  # its tensors would be a later state's, under this one's step count
    if problem is not None:
        raise ValueError(f"full_state_dict: {problem}")
    chain = step.base_chain
    names = state_dict_names(chain)
    if rank is not None:
        return _to_one_rank(step, state, rank, names)
    full = step.full_params(state)
    out: dict[str, torch.Tensor] = {}
    for key, (kind, layer, name) in names.keys.items():
        out[key] = full[layer][name] if kind == "param" else chain[layer].buffers[name]
    return out


def _to_one_rank(step: Any, state: TrainState, rank: int, names: Any) -> dict[str, torch.Tensor]:
    """``full_state_dict`` on global rank ``rank`` alone, gathered a layer at a time; ``{}`` elsewhere."""
    mesh = state.mesh
    world = 1 if mesh is None else mesh.size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"full_state_dict(step, state, rank={rank!r}): rank is the global rank that receives the "
                         f"state_dict, an int in [0, {world}) on {mesh!r}; or None for every rank")
    layout = _layout_of(state, step, "full_state_dict")
    receives = mesh is None or mesh.rank == rank
    keys_of: dict[str, list[tuple[str, str, str]]] = {}
    for key, (kind, layer, name) in names.keys.items():
        keys_of.setdefault(layer, []).append((key, kind, name))
    chain, out = step.base_chain, {}
    for layer in layout.layers:
        gathered = gathered_layer(layout, state.params, mesh, layer)
        if receives:
            for key, kind, name in keys_of.get(layer, []):
                out[key] = gathered[name] if kind == "param" else chain[layer].buffers[name]
        del gathered  # before the next layer's gather: a rank that receives nothing holds one at a time
    for layer, keys in keys_of.items():  # layers the layout lists no parameter of: buffers only
        if receives and layer not in layout.layers:
            out.update((key, chain[layer].buffers[name]) for key, _, name in keys)
    return {key: out[key] for key in names.keys} if receives else {}


def init_from_state_dict(step: Any, state_dict: dict[str, torch.Tensor], mesh: Mesh | None = None) -> TrainState:
    """``step.init`` from a module's ``state_dict`` (every key of it; a tied weight's other names must
    equal its first). As ``nn.Module.load_state_dict``, every parameter must have the module's shape,
    and its values are cast to the module's dtype; buffers and frozen parameters, which the chain
    carries, are copied into the chain's tensors."""
    names = state_dict_names(step.base_chain)
    missing = sorted(set(names.keys) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(names.keys))
    if missing or unexpected:
        raise CheckpointError(
            f"init_from_state_dict: the state_dict does not match the step's module: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    params: dict[str, dict[str, torch.Tensor]] = {layer.name: {} for layer in step.base_chain.layers}
    expected = module_params(step.base_chain)
    for (layer, name), key in names.param_key.items():
        given, want = state_dict[key], expected.get((layer, name))
        if want is not None:  # as nn.Module.load_state_dict: the module's shape, values cast to its dtype
            if tuple(given.shape) != tuple(want.shape):
                raise CheckpointError(
                    f"init_from_state_dict: {key!r} has shape {list(given.shape)}, the model's "
                    f"params[{layer!r}][{name!r}] {list(want.shape)}; load the state_dict of a model of this "
                    "configuration"
                )
            if want.is_floating_point() and not (given.is_floating_point() or given.is_complex()):
                raise CheckpointError(
                    f"init_from_state_dict: {key!r} is {given.dtype}, the model's params[{layer!r}][{name!r}] "
                    f"{want.dtype}: integer codes (a quantized model's) are not the weights"
                )
            given = given.to(want.dtype)
        params[layer][name] = given
    for alias, key in names.aliases.items():
        if not torch.equal(state_dict[alias], state_dict[key]):
            raise CheckpointError(differing_copies_message(
                "init_from_state_dict", key, key, alias, "their values differ"))
    stored = {key: (tuple(t.shape), t.dtype) for key, t in state_dict.items()}

    def read_into(key: str, placed: list[Placed]) -> None:
        for (_, _), view in placed:  # whole boxes (buffers.py reads a buffer whole)
            view.copy_(state_dict[key])

    restore_from("init_from_state_dict: the state_dict", step.base_chain, names, stored, read_into)
    for layer in params:
        params[layer] = {n: params[layer][n] for n in step.base_chain[layer].owned_param_names}
    return step.init(params, mesh)


# -- reading a DCP checkpoint (without running code from it) ------------------------------------
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("collections", "OrderedDict"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # StorageMeta.checkpoint_id
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata dataclasses, torch sizes, dtypes, layouts and memory formats only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{DCP_META} refers to {module}.{name}, which is not DCP metadata")


def read_dcp_metadata(path: str | os.PathLike[str]) -> Any:
    """DCP's ``Metadata`` of the checkpoint directory ``path``, unpickling only its own classes.

    A shardwise checkpoint (its files in DCP's layout, read by the readers here too) is first checked as
    ``load`` checks it: committed, and every file it lists as its save wrote it. Without that a damaged
    or interrupted save was read as far as it went (a key with a flipped byte came back under another
    name) or failed with the unpickler's or torch's own error."""
    directory = Path(path)
    if directory.is_dir() and _of_a_shardwise_save(directory):
        check_committed(directory)
    file = directory / DCP_META
    if not file.is_file():
        raise CheckpointError(f"{path} is not a torch.distributed.checkpoint directory: {DCP_META} is missing")
    with open(file, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except Exception as err:  # a damaged pickle fails in any of the unpickler's ways (MemoryError too)
            raise CheckpointError(f"{file}: not DCP metadata ({type(err).__name__}: {err})") from None
    if not all(hasattr(metadata, field) for field in ("state_dict_metadata", "storage_data")):
        raise CheckpointError(f"{file}: not DCP metadata (a {type(metadata).__name__}, not its Metadata)")
    return metadata


def _of_a_shardwise_save(directory: Path) -> bool:
    """Whether a shardwise save wrote ``directory`` (its metadata, marker or a rank's index; a torch DCP
    save writes ``.metadata`` and ``*.distcp`` only)."""
    return (directory / META).exists() or (directory / COMMITTED).exists() or any(
        p.name.startswith("rank") and p.name.endswith(".json") for p in directory.iterdir())


def read_dcp_state_dict(path: str | os.PathLike[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """The whole tensors of a DCP checkpoint (FileSystemWriter, torch_save records) whose keys start
    with ``prefix`` (``"model."`` for ``dcp.save({"model": sd})``), the prefix removed.

    ``init_from_state_dict(step, read_dcp_state_dict(path), mesh)`` starts a step from it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = resolve(path)  # a shardwise checkpoint an interrupted save left beside its path, as load finds it
    marker = marker_of(Path(path))  # a shardwise save's: what every read must still be of at the end
    metadata = read_dcp_metadata(path)
    out: dict[str, torch.Tensor] = {}
    for fqn, spec in metadata.state_dict_metadata.items():
        if not fqn.startswith(prefix) or not isinstance(spec, TensorStorageMetadata):
            continue
        t = torch.empty(tuple(spec.size), dtype=spec.properties.dtype)
        covered = 0
        for chunk in spec.chunks:
            info = metadata.storage_data[_index(fqn, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{path}: {fqn} is stored with transforms {info.transform_descriptors}, "
                    "which this reader does not undo"
                )
            try:
                with open(Path(path) / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    data = f.read(info.length)
                box = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as err:  # a missing file, or a damaged record: torch.load fails in many ways
                raise CheckpointError(
                    f"{path}: the chunk of {fqn} in {info.relative_path} is not a torch.save record of one "
                    f"tensor ({type(err).__name__}: {err})"
                ) from None
            if not isinstance(box, torch.Tensor) or tuple(box.shape) != tuple(chunk.sizes):
                raise CheckpointError(
                    f"{path}: the chunk of {fqn} in {info.relative_path} holds "
                    f"{list(box.shape) if isinstance(box, torch.Tensor) else type(box).__name__}, the metadata says "
                    f"{list(chunk.sizes)}; the metadata is of another save"
                )
            t[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))].copy_(box)
            covered += box.numel()
        if covered != t.numel():
            raise CheckpointError(f"{path}: its chunks of {fqn} hold {covered} of {t.numel()} elements")
        out[fqn[len(prefix):]] = t
    if marker is not None:
        check_unreplaced(Path(path), marker)  # no crc32 here: a chunk read after a replacement is the next save's
    return out


def _index(fqn: str, offsets: torch.Size) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(fqn, offsets)
