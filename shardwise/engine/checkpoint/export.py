"""``save_pretrained``: a step's weights written as transformers' ``save_pretrained`` writes them, one layer at a time.

Every rank calls it together; global rank 0 writes. The layers are taken in order: under ZeRO-3 a
layer's unit is all-gathered over the data-parallel axis, under a pipeline each of its parameters
is broadcast from the pipeline index that owns it, under tensor parallelism each split parameter's
slices are gathered and joined (as ``full_params`` does, one layer instead of the whole model); the
writer converts the layer's tensors to the keys ``save_pretrained`` writes (``export_keys``) and
appends their bytes to the open file (``safetensors_writer``: every header is known up front), and
the layer is dropped before the next is gathered. So no rank holds more than its own state plus one
layer gathered, where ``full_state_dict`` holds the whole model on every rank.

Nothing is lost and nothing hangs: the files are written into ``directory/.shardwise-export.partial``
(no loader looks there), and moved into ``directory`` only once all are written and fsynced, the
index last, then the weight files of an earlier save that the new index does not name are removed.
After each layer the ranks agree on the writer's problem, if any (``save_load._agree``), so a writer
that fails (a full disk, a directory it may not write) stops every rank with its error, the staging
directory removed and ``directory`` as it was.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...collectives.mesh import Mesh
from ..layout.devices import device_of
from ..layout.state import TrainState
from ..layout.state_layout import gathered_layer
from .arguments import check_path, check_state, check_step
from .errors import CheckpointError
from .export_keys import Convert, ExportKeys, LayerExport, export_keys
from .file_format import fsync_dir
from .hf_layout import pretrained_model
from .names import state_dict_names
from .safetensors_files import INDEX, SINGLE
from .safetensors_writer import SHARD_NAME, StreamWriter, cut_into_files, parse_max_shard_size, write_index
from .save_load import _agree, _consumed, _layout_of

STAGING = ".shardwise-export.partial"
CALL = "save_pretrained(step, state, directory)"


def save_pretrained(step: Any, state: TrainState, directory: str | os.PathLike[str], *,
                    max_shard_size: int | str = "50GB", config: Any = None) -> Path:
    """Write the weights of ``state`` (made by ``step``) to ``directory`` as ``model.save_pretrained`` would
    (every rank calls it; global rank 0 writes), holding one layer gathered at a time. Returns the path.

    ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``
    past ``max_shard_size`` (bytes, or ``"5GB"``, ``"500MB"``; transformers 5's default, ``"50GB"``); a
    transformers model's keys are the ones its ``save_pretrained`` writes (a tied weight once, fused
    experts per expert), any other module's its ``state_dict`` keys (a tied weight once). ``config``
    (``model.config``: anything with ``save_pretrained(directory)``) is saved beside them, a copy with
    the model's class and dtype filled in as ``save_pretrained`` does, and the model's
    ``generation_config`` where it generates. The parameters are the state's (master dtype).

    >>> import tempfile, torch, shardwise as sw
    >>> from safetensors.torch import load_file
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    >>> chain, params = sw.functionalize(model)
    >>> step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    >>> directory, batch = tempfile.mkdtemp(), (torch.randn(4, 3), torch.randn(4, 1))
    >>> def train_and_export():
    ...     state, _ = step(step.init(params, sw.Mesh(dp=2)), batch)
    ...     sw.checkpoint.save_pretrained(step, state, directory)
    ...     return sw.checkpoint.full_state_dict(step, state)
    >>> full = sw.launch(train_and_export, world=2)[0]
    >>> written = load_file(f"{directory}/model.safetensors")
    >>> sorted(written), all(torch.equal(written[k], full[k]) for k in full)
    (['0.bias', '0.weight', '2.bias', '2.weight'], True)
    """
    check_step(CALL, step)
    check_state(CALL, state)
    check_path(CALL, directory)
    if not str(directory):
        raise ValueError(f"{CALL}: directory is empty; pass the directory to write the weights into "
                         '("." for this one)')
    if STAGING in Path(directory).absolute().parts:
        raise ValueError(f"{CALL}: directory {str(directory)!r} is inside an export's staging directory {STAGING!r}, "
                         "which the next export into its parent removes; pass another directory")
    limit = parse_max_shard_size(CALL, max_shard_size)
    if config is not None and not callable(getattr(config, "save_pretrained", None)):
        raise TypeError(f"save_pretrained: config is a {type(config).__name__}, which has no "
                        "save_pretrained(directory); pass the model's config (model.config) or leave it out")
    layout = _layout_of(state, step, "save_pretrained")
    problem = _consumed(step, state)
    if problem is not None:
        raise ValueError(f"save_pretrained: {problem}")
    mesh: Mesh | None = state.mesh
    writer = mesh is None or mesh.rank == 0
    device = device_of(state.params)
    target = Path(directory)
    names = state_dict_names(step.base_chain)
    keys = export_keys(CALL, step.base_chain, layout, names)
    files = cut_into_files(keys.planned, limit)

    staging = target / STAGING
    stream: StreamWriter | None = None
    created = not target.exists()

    def agreed(problem: str | None, replaced: str = "as they were") -> None:
        """Every rank raises the first rank's problem, if one has one; the writer first removes its
        unfinished files (and ``directory``, if it made it)."""
        failed = _agree(mesh, problem, device)
        if failed is None:
            return
        if stream is not None:
            stream.abort()
            shutil.rmtree(staging, ignore_errors=True)
            if created and target.is_dir() and not any(target.iterdir()):
                target.rmdir()
        rank, text = failed.split(": ", 1)
        who = f"{rank} (the writer)" if rank == "rank 0" else rank
        raise CheckpointError(
            f"save_pretrained to {target} failed on {who}: {text}; the files in {target} are {replaced}")

    problem = None
    if writer:
        try:
            stream = _prepare(target, staging, files)
        except Exception as err:  # the other ranks hear of it in the agreement below
            problem = _text(err)
    agreed(problem)
    try:
        for layer in keys.layers:
            # A failure inside a gather (a rank out of memory for the gathered layer) is the collective's:
            # the other ranks are in it, so it propagates with its cause, as in a step, and ends them as a
            # failed step's collective does. What comes after the gather (the conversion, the writes) is
            # agreed, so every rank stops with the writer's error.
            params = gathered_layer(layout, state.params, mesh, layer.layer)
            problem = None
            try:
                _write_layer(step, layer, params, keys.convert, stream)
            except Exception as err:
                problem = _text(err)
            del params  # before the next layer's gather
            agreed(problem)
    except BaseException:
        if stream is not None:  # (agreed() has cleaned up already where it raised)
            stream.abort()
            shutil.rmtree(staging, ignore_errors=True)
        raise
    problem = None
    if stream is not None:
        try:
            _commit(target, staging, stream, config, pretrained_model(step.base_chain),
                    _weights_dtype(keys))
        except Exception as err:
            problem = f"{_text(err)} (while moving the finished files into place)"
    agreed(problem, "the earlier export, this one, or no weights (never a mix of both): export again")
    return target


def _text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _prepare(target: Path, staging: Path, files: list[Any]) -> StreamWriter:
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"directory {target} is a file; pass a directory (made if it does not exist)")
    target.mkdir(parents=True, exist_ok=True)
    if staging.exists():  # an interrupted export's: never moved into place
        shutil.rmtree(staging)
    staging.mkdir()
    return StreamWriter(staging, files)


def _write_layer(step: Any, layer: LayerExport, params: dict[str, torch.Tensor], convert: Convert,
                 stream: StreamWriter | None) -> None:
    """Write what ``layer``'s gathered parameters (and its buffers) become in the files (the writer)."""
    if stream is None:
        return
    tensors: dict[str, torch.Tensor] = {}
    for key, (kind, owner, name) in layer.inputs:
        if kind == "param":
            tensors[key] = params[name]
        else:
            buffer = step.base_chain[owner].buffers[name]
            if buffer.is_meta:
                raise CheckpointError(f"the buffer {key!r} is on the meta device (never materialized): no values "
                                      "to write; start the step from weights (sw.checkpoint.init_from_pretrained)")
            tensors[key] = buffer
    converted = convert(tensors)
    planned_keys = [t.key for t in layer.outputs]
    if sorted(converted) != sorted(planned_keys):
        raise RuntimeError(
            f"layer {layer.layer!r} converted to {sorted(converted)[:6]}, where its shapes alone gave "
            f"{sorted(planned_keys)[:6]}: transformers' conversion depends on more than the shapes"
        )
    for planned in layer.outputs:
        stream.put(planned.key, converted[planned.key])


def _weights_dtype(keys: ExportKeys) -> torch.dtype | None:
    """The model's dtype as transformers reads it (its first floating-point tensor's), for the config."""
    return next((t.dtype for t in keys.planned if t.dtype.is_floating_point), None)


def _save_config(staging: Path, config: Any, model: nn.Module | None, dtype: torch.dtype | None) -> None:
    """``config.json`` as ``model.save_pretrained`` writes it, on a copy (the caller's config is left as it
    was): the model's class as its architecture and the weights' dtype filled in, for loaders and the
    Hub's pipelines that read them; and ``generation_config.json`` beside it where the model generates."""
    config = copy.deepcopy(config)
    if model is not None and hasattr(config, "architectures"):
        config.architectures = [type(model).__name__]
    if dtype is not None and hasattr(config, "dtype"):
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(staging)
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        generation.save_pretrained(staging)


def _commit(target: Path, staging: Path, stream: StreamWriter, config: Any, model: nn.Module | None,
            dtype: torch.dtype | None) -> None:
    """Move the finished files into ``target`` so that a crash at any point leaves what a loader reads
    whole, the earlier export or this one, or no weights at all, never a mix of both: the weights and
    the config, then the index (replaced at once), then the earlier export's files this one does not
    name. ``model.safetensors`` wins over an index for transformers' loader and ours, so a single file
    moved in beside an earlier index is read at once, and an earlier single file is read until it is
    removed after the new index is in. Only where this export's shards take the names of the earlier
    index's does that index go first: a crash before the new one is in leaves no index (loaders refuse
    the directory), not the old index over new shards."""
    index = stream.finish()
    if config is not None:
        _save_config(staging, config, model, dtype)
    written = {name for name, _ in stream.files}
    old_index = target / INDEX
    if index is not None and old_index.is_file() and written & _named_by(old_index):
        old_index.unlink()
        fsync_dir(target)
    for name in sorted(written) + sorted(p.name for p in staging.iterdir() if p.name not in written):
        os.replace(staging / name, target / name)
    if index is not None:
        write_index(staging / INDEX, index)
        os.replace(staging / INDEX, target / INDEX)
    fsync_dir(target)
    if index is None:
        old_index.unlink(missing_ok=True)
    for old in target.iterdir():
        if old.name not in written and (SHARD_NAME.fullmatch(old.name) or old.name == SINGLE) and old.is_file():
            old.unlink()
    fsync_dir(target)
    shutil.rmtree(staging)


def _named_by(index: Path) -> set[str]:
    """The files an earlier export's index names (all of them, as far as it can be read, if it is broken)."""
    try:
        return set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {p.name for p in index.parent.iterdir() if SHARD_NAME.fullmatch(p.name)}
