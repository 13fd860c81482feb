"""Sharded checkpoints: every rank saves its own shards, and a checkpoint loads on any mesh.

``save(path, state, step)`` writes, on every rank together, the parameters and
optimizer state as global tensors cut into the boxes each rank owns (see
``checkpoint_cut``), in torch.distributed.checkpoint's file layout (see
``checkpoint_format``), with the step count, loss scale, mesh, transform stack and
per-leaf shard specs. ``load(path, step, mesh)`` lays out a rank's tensors as
``step.init`` would on ``mesh`` and reads into them the parts of those boxes that meet
them (see ``load_state``), never a whole tensor the rank does not keep: the mesh, the
ZeRO stage, the pipeline partition and the precision policy may all differ from the
ones that saved it, and training continues as if it had never stopped (a step that scales its loss
otherwise, or not at all, goes on with its own loss scale: the state is saved unscaled).

A save is atomic. Ranks write into ``.<name>.partial`` next to ``path``; when every rank
has written (they agree by gathering each rank's error, if any, so a rank that failed
stops them all, each naming it and its error), rank 0 writes the metadata and the ``COMMITTED`` marker, and renames the
directory to ``path`` (a checkpoint already there is moved to ``.<name>.previous``
first and removed after). A crash at any point, also in a save after a crashed one,
leaves a complete checkpoint that ``load`` finds: ``path``, else ``.previous`` (the
crash fell between the renames), else a committed ``.partial`` (a first save's crash
after its marker). A save first puts
that one back at ``path`` and removes the rest, so it never removes the only complete
checkpoint; with ``overwrite=False`` it refuses while one exists. ``load`` refuses a
directory without its marker.

``save(..., blocking=False)`` copies this rank's shards to host memory and writes them
from a thread while training goes on; ``handle.wait()`` (every rank calls it; the next
``save`` calls it for you) commits.

>>> import tempfile, torch, shardwise as sw
>>> checkpoint = sw.checkpoint
>>> chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 3)))
>>> step = sw.shard_params(
...     sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), "dp", stage=3
... )
>>> batch = (torch.randn(8, 4), torch.randn(8, 3))
>>> path = tempfile.mkdtemp() + "/ckpt"
>>> def train_and_save():
...     state, _ = step(step.init(params, sw.Mesh(dp=2)), batch)
...     checkpoint.save(path, state, step)
>>> _ = sw.launch(train_and_save, world=2)
>>> def resume():           # on four ranks now: the state is resharded
...     state = checkpoint.load(path, step, sw.Mesh(dp=4))
...     return state.step, state.params["0"].shape
>>> sw.launch(resume, world=4)[0]
(1, torch.Size([4]))
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from ...collectives.mesh import Mesh
from ...collectives.rank_end import at_rank_end, in_launched_rank
from ..layout.devices import device_of
from ..layout.state import TrainState
from ..layout.state_layout import StateLayout
from ..run.agreement import gather_texts
from .arguments import check_mesh, check_path, check_state, check_step
from .buffers import changed_buffers, restore_keys
from .cut import boxes, flat_start, my_regions, split_opt_state, update_tree
from .file_format import (
    COMMITTED,
    DCP_META,
    FORMAT,
    META,
    VERSION,
    CheckpointError,
    Committed,
    Reader,
    check_committed,
    data_file,
    dcp_metadata,
    dtype_name,
    dtype_of,
    fsync_dir,
    index_file,
    not_replaceable,
    open_committed,
    read_json,
    read_records,
    verified,
    write_commit_marker,
    write_dcp_metadata,
    write_json,
    write_rank,
)
from .held_names import every_ranks_names
from .load_state import build_state, other_optimizer_or_layout
from .model_of_state import other_model
from .names import module_params, state_dict_names
from .opt_structure import record_digest, record_structure, update_name

__all__ = ["CheckpointError", "SaveHandle", "describe", "load", "save"]

# A test's crash points: called with the name of each point a save passes (see tests).
_fault: Callable[[str], None] | None = None
_T = TypeVar("_T")
_pending = threading.local()  # this rank's unfinished async save (ranks are threads on the threads backend)


def _reached(point: str) -> None:
    if _fault is not None:
        _fault(point)


def _rename(source: Path, dest: Path) -> None:
    os.rename(source, dest)


def _discard(directory: Path) -> None:
    """Remove a checkpoint directory, its commit marker first: a removal stopped half way leaves
    no directory that passes for a complete checkpoint."""
    (directory / COMMITTED).unlink(missing_ok=True)
    fsync_dir(directory)
    shutil.rmtree(directory)


def _partial(target: Path) -> Path:
    return target.parent / f".{target.name}.partial"


def _previous(target: Path) -> Path:
    return target.parent / f".{target.name}.previous"


def _agree(mesh: Mesh | None, problem: str | None, device: torch.device) -> str | None:
    """The first rank's problem as ``"rank r: problem"``, or None when every rank is ok (a barrier:
    every rank hears every rank's problem, so each can name the one that failed and why; the launcher
    may report any rank's error as the failure)."""
    if mesh is None:
        return None if problem is None else f"rank 0: {problem}"
    texts = [ts[0] for ts in gather_texts(mesh, [problem or ""], device)]
    return next((f"rank {rank}: {text}" for rank, text in enumerate(texts) if text), None)


def _layout_of(state: TrainState, step: Any, call: str = "save") -> StateLayout:
    layout = state.layout
    stack = tuple(str(s) for s in step.transforms)
    if not isinstance(layout, StateLayout) or layout.stack != stack:
        made = layout.stack if isinstance(layout, StateLayout) else type(layout).__name__
        raise ValueError(
            f"{call}: this TrainState was made by {made}, not by this step ({stack}); pass the step that made it"
        )
    return layout


class SaveHandle:
    """A save under way: ``wait()`` (on every rank) finishes and commits it and returns its path."""

    def __init__(self, target: Path, commit: Callable[[bool], None], writer: threading.Thread | None,
                 mesh: Mesh | None, device: torch.device) -> None:
        self.path = target
        self._commit, self._writer, self._mesh, self._device = commit, writer, mesh, device
        self.error: BaseException | None = None
        self.bytes_written = 0
        self._done = False

    def done(self) -> bool:
        """Whether this rank's files are written (the commit still needs ``wait``)."""
        return self._writer is None or not self._writer.is_alive()

    def wait(self) -> Path:
        """Wait for every rank's files, commit, and return the checkpoint's path (collective)."""
        if self._done:
            return self.path
        self._done = True
        if self in _not_launched:
            _not_launched.remove(self)
        if getattr(_pending, "handle", None) is self:
            _pending.handle = None
        if self._writer is not None:
            self._writer.join()
        mine = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        failed = _agree(self._mesh, mine, self._device)
        if failed is not None:
            if self.error is not None:
                raise CheckpointError(
                    f"save to {self.path}: this rank could not write its files: {mine}; nothing was committed"
                ) from self.error
            raise CheckpointError(
                f"save to {self.path}: {failed.replace(':', ' could not write its files:', 1)}; nothing was committed"
            )
        self._commit(True)
        return self.path


def save(path: str | os.PathLike[str], state: TrainState, step: Any, *, blocking: bool = True,
         overwrite: bool = False) -> SaveHandle:
    """Save ``state`` (made by ``step``) to the directory ``path``; every rank calls this together.

    ``blocking=False`` returns once this rank's shards are copied to host memory; the files
    are written by a thread, and ``handle.wait()`` (on every rank) commits them; a rank of
    ``sw.launch`` whose function returns first commits it then, a single process at exit (under
    torchrun, wait yourself: at exit its commit is said to be lost). A checkpoint
    already at ``path`` is replaced (atomically) only with ``overwrite=True``.
    """
    call = "save(path, state, step)"
    check_path(call, path)
    check_state(call, state)
    check_step(call, step)
    previous = getattr(_pending, "handle", None)
    if previous is not None:
        previous.wait()  # one save at a time: the next waits for (and commits) the last
    layout = _layout_of(state, step)
    mesh: Mesh | None = state.mesh
    rank, world = (0, 1) if mesh is None else (mesh.rank, mesh.size)
    device = device_of(state.params)
    target = Path(path)
    partial = _partial(target)
    # Refused on every rank alike: a consumed state (its checkpoint would hold a later state under its
    # step count), a link, a file, a directory of other files.
    problem = _consumed(step, state) or not_replaceable(target)
    existing = _loadable(target)
    if existing == target and target.is_dir() and not any(target.iterdir()):
        existing = None  # an empty directory made for it (tempfile.mkdtemp()): nothing to replace
    if problem is None and existing is not None and not overwrite:
        left = "" if existing == target else (
            f" (as {existing.name}, left by an interrupted save; load finds it there)")
        problem = f"{target} exists{left}; pass overwrite=True to replace it, or save to a new path"
    elif problem is None and rank == 0:
        try:
            _recover(target)
            partial.mkdir(parents=True)
        except Exception as err:  # any failure: the other ranks wait in the agreement below to hear of it
            problem = f"cannot create {partial}: {type(err).__name__}: {err}"
    failed = _agree(mesh, problem, device)
    if failed is not None:
        raise CheckpointError(f"save to {target}: {problem or failed}")
    _every_rank_sees(mesh, target, partial, device)
    save_id = _save_id(mesh, device)
    _reached("prepared")
    names = state_dict_names(step.base_chain)
    boxes_, tensors, meta = _snapshot(state, step, layout, mesh, names, rank, device)

    def write(handle: SaveHandle) -> None:
        try:
            handle.bytes_written = write_rank(partial, rank, boxes_, tensors, _fault, save_id)
            _reached("rank-written")
        except BaseException as err:  # reported to every rank by wait()'s agreement
            handle.error = err

    def commit(ok: bool) -> None:
        problem: str | None = None
        if rank == 0:
            try:
                _reached("before-commit")
                _commit(partial, target, meta, world, names.aliases, save_id)
            except Exception as err:
                problem = f"{type(err).__name__}: {err}"
        failed = _agree(mesh, problem, device)
        if failed is not None:
            raise CheckpointError(f"save to {target}: the commit failed: {problem or failed}")

    handle = SaveHandle(target, commit, None, mesh, device)
    if blocking:
        write(handle)
        handle.wait()
        return handle
    handle._writer = threading.Thread(target=write, args=(handle,), name=f"shardwise-save-rank{rank}", daemon=True)
    handle._writer.start()
    _pending.handle = handle
    if in_launched_rank():
        at_rank_end(handle.wait)  # a rank that returns without waiting commits it then, with its collectives
    else:
        _not_launched.append(handle)
        if not _at_exit_registered:
            _at_exit_registered.append(atexit.register(_at_exit))
    return handle


_not_launched: list[SaveHandle] = []  # this process's async saves outside sw.launch (one rank; torchrun)
_at_exit_registered: list[Any] = []  # the hook, once registered


def _at_exit() -> None:
    """At exit, an async save never waited for: a single rank's is committed (it needs no other rank);
    under torchrun the collectives a commit needs may be gone, so its writer is let finish (a writer
    killed inside torch aborted the interpreter) and the loss is said."""
    for handle in _not_launched:
        if handle._done:
            continue
        if handle._mesh is None:
            handle.wait()
            continue
        if handle._writer is not None:
            handle._writer.join()
        sys.stderr.write(
            f"shardwise: checkpoint.save({str(handle.path)!r}, ..., blocking=False) was never waited for: its files "
            "are written but not committed, so it does not load; call handle.wait() on every rank before the "
            "program ends (sw.launch does it when a rank returns)\n"
        )


def _consumed(step: Any, state: TrainState) -> str | None:
    """Why ``state`` cannot be saved, if an in-place update of ``step`` already wrote past it, its
    parameters are not laid out as the step's init lays them out (cast or replaced by hand), or it was
    made for a model whose buffers or frozen parameters differ from the step's (model_of_state)."""
    # A Step's (engine/step sits above this folder); a step-like object may have only the first.
    check = getattr(step, "check_state", None) or getattr(step, "check_not_consumed", None)
    if check is None:
        return None
    try:
        check(state)
    except (ValueError, TypeError) as err:
        return str(err)
    return other_model(step, state)


def _snapshot(state: TrainState, step: Any, layout: StateLayout, mesh: Mesh | None, names: Any, rank: int,
              device: torch.device) -> tuple[
        list[tuple[str, tuple[int, ...], torch.Tensor]], dict[str, Any], dict[str, Any]]:
    """Host copies of this rank's boxes, the global shape and dtype of their tensors, and the metadata."""
    tree = update_tree(layout, mesh, state.params)
    mirrors, scalars = split_opt_state(state.opt_state, tree)
    out: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
    tensors: dict[str, Any] = {}
    coords = {} if mesh is None else dict(mesh.coords)  # a split leaf's index: the rank's on its axis

    def add(fqn: str, shape: tuple[int, ...], segment: torch.Tensor, start: int, stop: int, spec: Any = None) -> None:
        """Elements [start, stop) of this rank's tensor as boxes of the whole one (of ``shape``);
        under tensor parallel this rank's tensor is its slice of the whole (``spec.split``)."""
        tensors[fqn] = {"shape": list(shape), "dtype": dtype_name(segment.dtype)}
        split = None if spec is None else spec.split
        held = shape if split is None else spec.local_shape
        for offsets, sizes in boxes(held, start, stop):
            first = flat_start(held, offsets) - start
            box = segment[first : first + math.prod(sizes)].reshape(sizes)
            pieces = [(offsets, box)] if split is None else split.to_global(
                offsets, box, coords.get(split.axis, 0), shape
            )
            for at, piece in pieces:
                out.append((fqn, at, piece.detach().to("cpu", copy=True)))  # a copy: training goes on

    for region in my_regions(layout, mesh):
        key = names.param_key[(region.layer, region.name)]
        spec = layout.leaves[(region.layer, region.name)]
        add(f"model.{key}", spec.shape, region.cut(tree), region.start, region.stop, spec)
        for path, mirror in mirrors.items():
            add(f"optim.{path}.{key}", spec.shape, region.cut(mirror), region.start, region.stop, spec)
    # The optimizer's other tensors: a pipeline stage's per-parameter ones are held by its ranks only.
    holders = every_ranks_names(mesh, list(scalars), device)
    for path, t in scalars.items():
        if min(r for r, held in enumerate(holders) if path in held) == rank:
            add(f"optim.{path}", tuple(t.shape), t.reshape(-1), 0, t.numel())
    if rank == 0:
        for key, (layer, name) in names.buffers.items():
            t = step.base_chain[layer].buffers[name]
            add(f"model.{key}", tuple(t.shape), t.reshape(-1), 0, t.numel())
    mesh_shape = None if mesh is None else mesh.shape
    meta = {
        "format": FORMAT, "version": VERSION, "step": int(state.step),
        "loss_scale": None if state.loss_scale is None else
        {"type": type(state.loss_scale).__name__, "fields": state.loss_scale._asdict()},
        "rng": getattr(state, "rng", None),  # the seed of the step's random streams, where states carry one
        "stack": list(layout.stack), "mesh": mesh_shape, "world": 1 if mesh is None else mesh.size,
        "layers": list(layout.layers),
        "params": [{"layer": s.layer, "name": s.name, "key": names.param_key[(s.layer, s.name)],
                    "shape": list(s.shape), "dtype": dtype_name(s.dtype)} for s in layout.leaves.values()],
        "leaves": {names.param_key[k]: s.describe() for k, s in layout.leaves.items()},
        "buffers": {f"model.{k}": list(v) for k, v in names.buffers.items()},
        "aliases": {f"model.{a}": f"model.{k}" for a, k in names.aliases.items()},
        "optimizer": {"mirrors": sorted(mirrors), "scalars": sorted(set().union(*holders)),
                      "structure": _structure(state.opt_state, tree, mesh, device),
                      "update": update_name(getattr(step, "optimizer", None))},
    }
    return out, tensors, meta


def _structure(opt_state: Any, tree: Any, mesh: Mesh | None, device: torch.device) -> Any:
    """The record of the optimizer state's containers (opt_structure.py), where every rank's is the same (a
    collective); None where they differ (a pipeline stage's per-layer entries): load then rebuilds the state
    from the optimizer alone, as it did before the record."""
    record = record_structure(opt_state, tree)
    if mesh is not None and len({ts[0] for ts in gather_texts(mesh, [record_digest(record)], device)}) > 1:
        return None
    return record


def _every_rank_sees(mesh: Mesh | None, target: Path, partial: Path, device: torch.device) -> None:
    """Refuse, on every rank alike, a save whose ranks do not all see the directory rank 0 made: ranks given
    different paths (a path made per process) or a path on a file system some ranks do not share would
    each write elsewhere, and the commit find their files missing."""
    if mesh is None:
        return
    seen = [texts[0].split("\t", 1) for texts in gather_texts(mesh, [f"{int(partial.is_dir())}\t{target.absolute()}"],
                                                               device)]
    blind = [rank for rank, (sees, _) in enumerate(seen) if sees != "1"]
    if not blind:
        return
    if mesh.rank == 0:
        _discard_if_there(partial)  # (empty: no rank has written)
    paths = sorted({where for _, where in seen})
    listed = "; ".join(f"rank {rank}: {where}" for rank, (_, where) in enumerate(seen))
    why = (f"the ranks passed different paths ({listed}; a path made per process, such as tempfile.mkdtemp() in "
           "each, differs)" if len(paths) > 1 else
           f"{target.parent} is not one file system that every rank shares")
    raise CheckpointError(
        f"save to {target}: ranks {blind} do not see the directory rank 0 made beside its path to write into: {why}; "
        "pass every rank the same path, on a file system every rank shares; nothing was written"
    )


def _save_id(mesh: Mesh | None, device: torch.device) -> str:
    """This save's id, rank 0's draw, the same on every rank (a collective): each rank's index records it."""
    mine = uuid.uuid4().hex
    return mine if mesh is None else gather_texts(mesh, [mine], device)[0][0]


def _commit(partial: Path, target: Path, meta: dict[str, Any], world: int, aliases: Mapping[str, str],
            save_id: str | None = None) -> None:
    """Rank 0, once every rank has written: metadata, the commit marker, then the renames. A rank's
    index from another save (two runs saving to one path: the other's recovery removed this save's
    directory, and its ranks write into the one it made) stops the commit: the marker would vouch
    for a mix of the two runs' shards."""
    gone = [rank for rank in range(world) if not (partial / index_file(rank)).is_file()]
    if gone:  # every rank reported its files written: something removed them since
        raise CheckpointError(
            f"{partial}: the files of ranks {gone} are gone after they were written: another save to {target} "
            f"may have removed {partial.name} (two runs saving to one path?); nothing was committed. "
            "Give each run its own checkpoint path"
        )
    tensors: dict[str, Any] = {}
    for rank in range(world):
        index = read_json(partial / index_file(rank), f"rank {rank}'s index")
        if save_id is not None and index.get("save") != save_id:
            raise CheckpointError(
                f"{partial}: rank {rank}'s files are another save's: another save to {target} wrote into "
                f"{partial.name} while this one did (two runs saving to one path?); nothing was committed. "
                "Give each run its own checkpoint path"
            )
        tensors.update(index["tensors"])
    try:
        meta = {**meta, "tensors": tensors}
        write_json(partial / META, meta)
        write_dcp_metadata(
            partial,
            dcp_metadata(meta, read_records(partial, world), {f"model.{a}": f"model.{k}" for a, k in aliases.items()}),
        )
        write_commit_marker(partial)
        fsync_dir(partial)
    except FileNotFoundError as err:  # the directory went while rank 0 wrote into it: nothing vouches for it
        raise CheckpointError(
            f"{partial}: removed by another process while this save committed it ({err.filename} is gone): "
            f"another save to {target} (two runs saving to one path?) or a cleanup of {partial.parent}; "
            f"nothing was committed, and {_as_it_was(target)}. Give each run its own checkpoint path"
        ) from err
    _reached("committed")
    previous = _previous(target)
    if target.exists():
        if previous.exists():
            _discard_if_there(previous)  # target is complete: a .previous is not the only checkpoint
        try:
            _rename(target, previous)
        except FileNotFoundError:
            pass  # another process removed the old checkpoint since: the new one replaces nothing
        else:
            _reached("between-renames")
    try:
        _rename(partial, target)  # here the new checkpoint takes over; .previous is the old one
    except FileNotFoundError as err:
        kept = (f"the checkpoint that was at {target.name} is kept as {previous} (load finds it there)"
                if previous.exists() and not target.exists() else _as_it_was(target))
        raise CheckpointError(
            f"{partial}: committed, then removed or moved by another process before it was renamed to {target} "
            f"(another save to that path, two runs saving to one path?, or a cleanup of {partial.parent}): this "
            f"save is not at {target}; {kept}. Give each run its own checkpoint path"
        ) from err
    fsync_dir(target.parent)
    if previous.exists():
        _discard_if_there(previous)


def _discard_if_there(directory: Path) -> None:
    """:func:`_discard`, where another process may remove ``directory`` first (what is wanted anyway)."""
    with contextlib.suppress(FileNotFoundError):
        _discard(directory)


def _as_it_was(target: Path) -> str:
    """What a failed commit left at ``target``, in words."""
    found = _loadable(target)
    if found is None:
        return f"no checkpoint is at {target} (none was there before this save, or another process removed it)"
    return f"the checkpoint at {found} is as it was before this save"


def _complete(directory: Path) -> bool:
    """Whether ``directory`` holds a committed checkpoint whose files are as written."""
    try:
        check_committed(directory)
    except CheckpointError:
        return False
    return True


def _loadable(target: Path) -> Path | None:
    """Where the checkpoint for ``target`` is: ``target`` itself, else (a save stopped between its
    renames) the ``.previous`` it had moved aside: a save that did not return has not replaced
    it; else (a first save stopped after its marker) its committed ``.partial``."""
    if target.exists():
        return target
    return next((d for d in (_previous(target), _partial(target)) if _complete(d)), None)


def _recover(target: Path) -> None:
    """Rank 0, before a save writes: put what an interrupted save left back in place, then remove
    the rest. Each step leaves a complete checkpoint where ``_loadable`` finds it: the rename
    moves it to ``target``, and what is removed after is not it."""
    found = _loadable(target)
    if found is not None and found != target:
        _rename(found, target)
        fsync_dir(target.parent)
    for leftover in (_partial(target), _previous(target)):
        if leftover.exists():
            _discard(leftover)


# -- loading ---------------------------------------------------------------------------------------
def resolve(path: str | os.PathLike[str]) -> Path:
    """The committed checkpoint directory for ``path``: itself, or the complete one an interrupted
    save left beside it (see ``_loadable``)."""
    target = Path(path)
    found = _loadable(target)
    if found is not None:
        return found
    if _partial(target).exists():
        raise CheckpointError(
            f"no checkpoint at {target}: a save to it was interrupted ({_partial(target)} holds its unfinished files)"
        )
    return target


def load(path: str | os.PathLike[str], step: Any, mesh: Mesh | None = None, *,
         like: Any = None, device: torch.device | str = "cpu") -> TrainState:
    """This rank's TrainState for ``step`` on ``mesh`` from the checkpoint at ``path``, resharded.

    Every rank calls it (each reads what it needs; the ranks first check, as ``step.init`` does, that
    they built the same step: one rank with another learning rate or clipping is refused, not
    trained on). Every parameter's shape and
    dtype must be those the step expects: its chain's modules' (as ``functionalize`` kept them),
    cast by the step's precision policy, and, when given, those of ``like`` (params, real or
    ``device="meta"``). A hand-written layer has no module, so only ``like`` checks its
    parameters. Tensors are read onto ``device``. A save to ``path`` still under way
    (``blocking=False``) is waited for first, as the next save waits for it. A read that fails on
    one rank (a corrupt record only it reads) fails on every rank: none returns a state the others
    do not have. The saved buffers and frozen (``requires_grad=False``) parameters, which the
    chain carries, are copied into the chain's tensors, as ``nn.Module.load_state_dict``
    restores a module's; one saved with another shape is refused. They are copied last, once every
    rank has its state, one at a time: a load refused on the way leaves them as they were. The
    chain is the step's, shared by all its states (and by the module): after a second load, a state
    from the first computes with the second checkpoint's frozen weights.
    """
    call = "load(path, step, mesh)"
    check_path(call, path)
    check_step(call, step)
    check_mesh(call, mesh)
    step.check_axes_used(mesh)  # (as init: each rank along an axis no transform uses would train its own model)
    on = torch.device(device)
    pending = getattr(_pending, "handle", None)
    if pending is not None and pending.path.resolve() == Path(path).resolve():
        pending.wait()  # this rank's save to it is in flight (blocking=False): what it loads is that save

    def check() -> tuple[Committed, dict[str, dict[str, torch.Tensor]], dict[tuple[str, str], str], list[str]]:
        committed = open_committed(resolve(path))
        params_meta, keys = _check_model(committed.directory, committed.meta, step, like)
        return committed, params_meta, keys, _buffers(committed, step)

    committed, params_meta, keys, changed = together(mesh, on, f"load of {path}", check)
    directory, meta = committed.directory, committed.meta
    same_save(mesh, committed.marker, directory, on)
    axes = sorted({str(s.axis) for s in step.transforms if getattr(s, "axis", None)})
    if mesh is None and axes:
        raise ValueError(
            f"load(path, step, mesh): this step ({step.describe()}) runs on a mesh of axes {axes}, and no mesh was "
            "given; pass the one to resume on (any shape: the checkpoint reshards): load(path, step, sw.Mesh(...))"
        )
    # Not the buffers' values: every rank restores the same saved ones below (buffers.py), whatever
    # each built (a model rebuilt under another seed, or on the meta device).
    step.check_ranks_agree(mesh, step.layout(mesh, params_meta), {
        "parameter names, shapes and dtypes": repr(
            [(k, n, tuple(t.shape), t.dtype) for k, v in params_meta.items() for n, t in v.items()]
        ),
        "checkpoint's step": str(meta["step"]),
    }, on, buffer_values=False)

    def read() -> tuple[TrainState, list[str]]:
        reader = Reader(committed)
        try:
            built = build_state(reader, meta, step, mesh, params_meta, keys, on)
        finally:
            reader.close()
        committed.check_unreplaced()  # every file was opened: each from the save the marker read first vouches
        return built

    state, scalars = together(mesh, on, f"load of {directory}", read)
    wanted = set().union(*every_ranks_names(mesh, scalars, on))
    saved = set(meta["optimizer"]["scalars"])
    if wanted != saved:
        raise CheckpointError(
            f"checkpoint {directory}: its optimizer state has {sorted(saved)[:8]} besides "
            f"the per-parameter {meta['optimizer']['mirrors']}, this step's optimizer has {sorted(wanted)[:8]}; "
            + other_optimizer_or_layout(saved, wanted)
        )
    _buffers(committed, step, restore=changed)  # last: a refusal above leaves the chain as it was
    return state


def same_save(mesh: Mesh | None, marker: str, directory: Path, device: torch.device) -> None:
    """Refuse, on every rank alike, ranks that read different saves: each rank reads its own part, so ranks
    given different paths (a path made per process) or reading while another process saved to the path
    (``overwrite=True``) would return one model made of two checkpoints. The marker's sha256 names the
    save (paths may differ: one file system mounted at two places)."""
    if mesh is None:
        return
    read = [texts[0].split("\t", 1) for texts in gather_texts(mesh, [f"{marker}\t{directory}"], device)]
    if len({marker for marker, _ in read}) == 1:
        return
    listed = "; ".join(f"rank {rank}: {where} (its COMMITTED's sha256 {marker[:12]})"
                       for rank, (marker, where) in enumerate(read))
    raise CheckpointError(
        f"the ranks read different checkpoints ({listed}), and a state made of their parts would be two models' "
        "mix: pass every rank the same path (a path made per process, such as tempfile.mkdtemp() in each, "
        "differs); where it is the same path, another process saved to it (overwrite=True) while the ranks read "
        "it: load again once that save has returned"
    )


def together(mesh: Mesh | None, device: torch.device, what: str, fn: Callable[[], _T]) -> _T:
    """``fn()`` on every rank, failing on every rank if it fails on one, each naming the cause: each
    rank reads its own part of a checkpoint, and a rank whose read failed (a corrupt record only it
    reads, a file missing on its machine) while the others go on would leave a model half loaded
    and half not (a caller that starts afresh on an error), or the others waiting in its next
    collective."""
    try:
        result, error = fn(), None
    except Exception as err:  # any failure: the other ranks must hear of it
        result, error = None, err
    if mesh is not None:
        texts = [ts[0] for ts in gather_texts(mesh, ["" if error is None else f"{type(error).__name__}: {error}"],
                                              device)]
        failed = [(rank, text) for rank, text in enumerate(texts) if text]
        if failed and error is None:
            first, text = failed[0]
            raise CheckpointError(
                f"{what}: rank {first} failed ({text}), so this one stops too: no rank goes on with a state the "
                "others do not have"
            )
    if error is not None:
        raise error
    assert result is not None
    return result


def _buffers(committed: Committed, step: Any, restore: list[str] | None = None) -> list[str]:
    """The chain's persistent buffers (frozen parameters among them) whose saved values differ from
    its own; with ``restore``, those given their saved values (buffers.py)."""
    directory, meta = committed.directory, committed.meta
    stored = {fqn: (tuple(spec["shape"]), dtype_of(spec["dtype"], fqn)) for fqn, spec in meta["tensors"].items()}
    names, reader = state_dict_names(step.base_chain), Reader(committed)
    try:
        if restore is not None:
            restore_keys(step.base_chain, names, stored, reader.read_into, restore, prefix="model.")
            return restore
        return changed_buffers(f"checkpoint {directory}", step.base_chain, names, stored, reader.read_into,
                               prefix="model.")
    finally:
        reader.close()


def _check_model(
    directory: Path, meta: Mapping[str, Any], step: Any, like: Any
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[tuple[str, str], str]]:
    """The checkpoint's parameters as meta tensors, once they are the ones ``step``'s chain has."""
    saved = {(p["layer"], p["name"]): p for p in meta["params"]}
    chain = step.chain
    wanted = {(layer.name, n) for layer in chain.layers for n in layer.owned_param_names}
    if set(saved) != wanted:
        # The same module functionalized with other units (its layers cut elsewhere): its parameters
        # are found by their state_dict keys, which the checkpoint holds them under.
        by_key = {p["key"]: p for p in meta["params"]}
        names = state_dict_names(step.base_chain)
        aliases = {a.removeprefix("model."): k.removeprefix("model.") for a, k in meta.get("aliases", {}).items()}
        key_of = {k: _tie_named_from_its_other_end(key, by_key, aliases, names.aliases)
                  for k, key in names.param_key.items()}
        keys_wanted = {key_of[k] for k in wanted if k in key_of}
        if len(keys_wanted) != len(wanted) or keys_wanted != set(by_key):
            missing = sorted(keys_wanted - set(by_key)) or sorted(f"{a}.{b}" for a, b in wanted - set(saved))
            extra = sorted(set(by_key) - keys_wanted)
            tied = [f"{m} (saved as a tie of {aliases[m]})" for m in missing if m in aliases]
            frozen = _frozen_either_side(meta, step, missing, extra)
            if frozen:
                raise CheckpointError(f"checkpoint {directory} {frozen}")
            raise CheckpointError(
                f"checkpoint {directory} is of another model: this step's model has parameters {missing[:8]} that "
                f"it lacks, and it has {extra[:8]} that the model does not (state_dict keys)"
                + (f"; its model tied them: {tied[:8]}: load it into a model tied as it was, or start an untied "
                   "one from its weights with sw.checkpoint.init_from_dcp(step, path, mesh, prefix='model.'), "
                   "which copies each tie's tensor" if tied else "")
            )
        saved = {k: by_key[key_of[k]] for k in wanted}
    params: dict[str, dict[str, torch.Tensor]] = {layer.name: {} for layer in chain.layers}
    for (layer, name), p in saved.items():
        params[layer][name] = torch.empty(tuple(p["shape"]), dtype=dtype_of(p["dtype"], p["key"]), device="meta")
    _check_fits(directory, params, {k: p["key"] for k, p in saved.items()}, step, like)
    # step.init's order: each layer's parameters in the chain's order
    ordered = {layer.name: {n: params[layer.name][n] for n in layer.owned_param_names} for layer in chain.layers}
    return ordered, {k: p["key"] for k, p in saved.items()}


def _tie_named_from_its_other_end(key: str, saved: Mapping[str, Any], saved_aliases: Mapping[str, str],
                                  our_aliases: Mapping[str, str]) -> str:
    """The saved key of this model's parameter ``key``: itself, or, where the checkpoint's model tied the same
    two names the other way round (the module registered first owns a tie, so a model that registers
    ``head`` before ``emb`` names ``emb.weight = head.weight`` by ``head.weight``), the name it was saved
    under. Both models tie the two names: the one tensor, as ``load_state_dict`` takes either's."""
    other = saved_aliases.get(key)
    if other is not None and key not in saved and other in saved and our_aliases.get(other) == key:
        return other
    return key


def _frozen_either_side(meta: Mapping[str, Any], step: Any, missing: list[str], extra: list[str]) -> str:
    """Where the parameters one side lacks are frozen (``requires_grad=False``) on the other: what changed and the
    ways on, in words; "" otherwise."""
    saved_frozen = set(meta.get("buffers", {}))
    now_frozen = set(state_dict_names(step.base_chain).buffers)
    trained_now = [k for k in missing if f"model.{k}" in saved_frozen]
    frozen_now = [k for k in extra if k in now_frozen]
    if (not trained_now and not frozen_now) or len(trained_now) + len(frozen_now) != len(missing) + len(extra):
        return ""
    what = "; ".join(
        [f"was saved with {trained_now[:8]} frozen (requires_grad=False: held beside the state, not trained), "
         "and this step trains them"] * bool(trained_now)
        + [f"trained {frozen_now[:8]}, which this step's model holds frozen"] * bool(frozen_now))
    return (
        f"{what}. A checkpoint resumes the training it saved; to change what trains, start from its weights (the "
        "optimizer's state starts afresh): sw.checkpoint.init_from_dcp(step, path, mesh, prefix='model.'). Or "
        "freeze with a frozen group (sw.optim.group(pattern, frozen=True)), which keeps the parameters in the "
        "state, so that a step training them later resumes from the same checkpoint"
    )


def _check_fits(directory: Path, params: Mapping[str, Mapping[str, torch.Tensor]],
                keys: Mapping[tuple[str, str], str], step: Any, like: Any) -> None:
    """Refuse a checkpoint whose parameters' shapes or (master) dtypes are not those of the model
    the step was built for (its modules' tensors) or of ``like``: loaded, it would train with the
    checkpoint's shapes, or fail later in a matmul."""
    sources = []
    if like is not None:
        sources.append(("like", {(layer, n): t for layer, ts in like.items() for n, t in ts.items()}))
    sources.append(("the model", module_params(step.base_chain)))
    bad = []
    for source, tensors in sources:
        expected = _master_meta(step, tensors)
        for (layer, name), want in expected.items():
            got = params.get(layer, {}).get(name)
            if got is None:
                bad.append(f"params[{layer!r}][{name!r}] is in {source}, not in the checkpoint")
            elif (tuple(got.shape), got.dtype) != (tuple(want.shape), want.dtype):
                bad.append(f"{keys[(layer, name)]} (params[{layer!r}][{name!r}]) is {_kind(got)} "
                           f"in the checkpoint, {_kind(want)} in {source}")
    if bad:
        raise CheckpointError(
            f"checkpoint {directory} is of another model: parameter shapes or dtypes differ from "
            f"the checkpoint's: {'; '.join(bad[:8])}; load it for a model built like the one that "
            "saved it (its widths, and its dtype: model.to(dtype) before functionalize, or a "
            "mixed_precision step whose params dtype is the checkpoint's)"
        )


def _master_meta(step: Any, tensors: Mapping[tuple[str, str], torch.Tensor]
                 ) -> dict[tuple[str, str], torch.Tensor]:
    """``tensors`` as the step stores them (its precision policy's master dtype), as meta."""
    tree: dict[str, dict[str, torch.Tensor]] = {}
    for (layer, name), t in tensors.items():
        tree.setdefault(layer, {})[name] = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    master = step.master_params(tree)
    return {(layer, name): t for layer, ts in master.items() for name, t in ts.items()}


def _kind(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)} {list(t.shape)}"


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a committed checkpoint holds: its metadata, and per rank its file, bytes and records."""
    committed = open_committed(resolve(path))
    directory, meta = committed.directory, committed.meta
    records = read_records(directory, int(meta["world"]), verify=verified(meta), committed=committed)
    ranks: list[dict[str, Any]] = []
    for rank in range(int(meta["world"])):
        mine = [r for rs in records.values() for r in rs if r.file == data_file(rank)]
        ranks.append({
            "rank": rank, "file": data_file(rank), "bytes": sum(r.length for r in mine),
            "tensors": sorted({r.fqn for r in mine}),
            "records": [
                {"tensor": r.fqn, "offsets": list(r.offsets), "sizes": list(r.sizes), "bytes": r.length} for r in mine
            ],
        })
    return {"path": str(directory), "dcp_metadata": (directory / DCP_META).is_file(), **meta, "ranks": ranks}
