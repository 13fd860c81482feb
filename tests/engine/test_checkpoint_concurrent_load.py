"""A load that another process's save overtakes, and ranks that read different checkpoints.

An evaluator loads the path a trainer saves to with ``overwrite=True``; the save renames its new
directory into place while the load reads. Each read after the commit marker is checked against the
marker read first (the metadata, each rank's index by the sha256 the marker lists, each record by the
crc32 in that index), so a load never returns the step count of one save with the tensors of the next
(one device: the old metadata with the new indexes and records, 5.8e-2 relative from the state of its
step count before), and the ranks agree on the marker they read, so no state is made of two saves'
parts (ZeRO-3 on two ranks: rank 0's shards of one save, rank 1's of the next), nor of two paths'.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.checkpoint import file_format
from shardwise.engine.checkpoint import save_load as ck
from shardwise.testing.models import mlp

REPLACED = "was replaced while this load read it: another process saved to it"


def _problem(stage: int | None = None) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2))
    if stage is not None:
        step = sw.shard_params(step, "dp", stage=stage)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
                torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return step, params, batches


def _states(step: sw.Step, params: Any, batches: list[Any]) -> list[sw.TrainState]:
    states = [step.init(params)]
    for batch in batches:
        states.append(step(states[-1], batch)[0])
    return states


def _first_saved(tmp_path: Path) -> tuple[sw.Step, Path, sw.TrainState, sw.TrainState]:
    """(the step, the path its first step's state is saved at, that state, the state after the second step)."""
    step, params, batches = _problem()
    _, first, second = _states(step, params, batches)
    path = tmp_path / "ck"
    sw.checkpoint.save(path, first, step)
    return step, path, first, second


def _equal(a: sw.TrainState, b: sw.TrainState) -> bool:
    return all(torch.equal(a.params[layer][n], b.params[layer][n]) for layer in b.params for n in b.params[layer])


def test_a_save_that_lands_between_the_metadata_and_the_rank_files_is_refused_not_mixed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step, path, first, second = _first_saved(tmp_path)
    check_model = ck._check_model

    def the_trainers_next_save_lands(*args: Any) -> Any:
        out = check_model(*args)  # the load has read and verified step 1's metadata
        monkeypatch.setattr(ck, "_check_model", check_model)
        sw.checkpoint.save(path, second, step, overwrite=True)
        return out

    monkeypatch.setattr(ck, "_check_model", the_trainers_next_save_lands)
    with pytest.raises(sw.checkpoint.CheckpointError, match=REPLACED):
        sw.checkpoint.load(path, step)
    again = sw.checkpoint.load(path, step)  # once that save has returned: all of step 2
    assert again.step == 2 and _equal(again, second) and not _equal(again, first)


def test_a_save_that_lands_while_the_marker_lists_are_checked_is_named_a_replacement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step, path, _, second = _first_saved(tmp_path)
    check_listed = file_format._check_listed

    def the_next_save_lands_after_the_marker_was_read(*args: Any) -> None:
        monkeypatch.setattr(file_format, "_check_listed", check_listed)
        sw.checkpoint.save(path, second, step, overwrite=True)
        check_listed(*args)

    monkeypatch.setattr(file_format, "_check_listed", the_next_save_lands_after_the_marker_was_read)
    with pytest.raises(sw.checkpoint.CheckpointError, match=REPLACED):  # not "truncated" nor "modified"
        sw.checkpoint.load(path, step)


def test_ranks_that_read_before_and_after_a_save_lands_all_refuse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, params, batches = _problem()
    zero3, _, _ = _problem(stage=3)
    _, first, second = _states(base, params, batches)
    path = tmp_path / "ck"
    sw.checkpoint.save(path, first, base)
    reader, rank_0_read, calls = ck.Reader, threading.Event(), {0: 0, 1: 0}
    build_state = ck.build_state

    def rank_0_done(reader_: Any, meta: Any, step: Any, mesh: Any, *rest: Any) -> Any:
        out = build_state(reader_, meta, step, mesh, *rest)
        if mesh.rank == 0:
            rank_0_read.set()
        return out

    def rank_1_reads_late(committed: Any) -> Any:
        rank = sw.Mesh(dp=2).rank
        calls[rank] += 1
        if rank == 1 and calls[1] == 2:  # its reader of the shards (the first reads the buffers)
            assert rank_0_read.wait(60)
            sw.checkpoint.save(path, second, base, overwrite=True)  # the other job's save lands meanwhile
        return reader(committed)

    monkeypatch.setattr(ck, "build_state", rank_0_done)
    monkeypatch.setattr(ck, "Reader", rank_1_reads_late)
    with pytest.raises(sw.collectives.RankFailed, match=REPLACED):
        sw.launch(lambda: sw.checkpoint.load(path, zero3, sw.Mesh(dp=2)), 2, timeout=120)


def test_ranks_that_read_different_saves_all_refuse_naming_each_ranks_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base, params, batches = _problem()
    zero3, _, _ = _problem(stage=3)
    _, first, second = _states(base, params, batches)
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    sw.checkpoint.save(a, first, base)
    sw.checkpoint.save(b, second, base)

    def load_one_per_rank() -> Any:
        mesh = sw.Mesh(dp=2)
        return sw.checkpoint.load(a if mesh.rank == 0 else b, zero3, mesh)  # a path made per process

    with pytest.raises(sw.collectives.RankFailed) as refused:
        sw.launch(load_one_per_rank, 2, timeout=120)
    said = str(refused.value)
    assert "the ranks read different checkpoints" in said and f"rank 0: {a}" in said and f"rank 1: {b}" in said
    assert "pass every rank the same path" in said
    # The same two saves' step counts differ; two saves at one step count (another run's) are refused alike.
    other, _, _ = _problem()
    b2 = tmp_path / "run_b2"
    sw.checkpoint.save(b2, _states(other, params, [(2 * x, y) for x, y in batches[:1]])[1], other)
    with pytest.raises(sw.collectives.RankFailed, match="the ranks read different checkpoints"):
        sw.launch(lambda: sw.checkpoint.load(a if sw.Mesh(dp=2).rank == 0 else b2, zero3, sw.Mesh(dp=2)), 2,
                  timeout=120)
    states = sw.launch(lambda: sw.checkpoint.load(a, zero3, sw.Mesh(dp=2)), 2, timeout=120)  # the same path: loads
    assert all(s.step == 1 for s in states)


def test_ranks_that_save_to_different_paths_all_refuse_before_writing(tmp_path: Path) -> None:
    zero3, params, batches = _problem(stage=3)
    paths = [tmp_path / "rank0" / "ck", tmp_path / "rank1" / "ck"]  # tempfile.mkdtemp() in each process
    for p in paths:
        p.parent.mkdir()

    def save_one_path_per_rank() -> None:
        mesh = sw.Mesh(dp=2)
        state, _ = zero3(zero3.init(params, mesh), batches[0])
        sw.checkpoint.save(paths[mesh.rank], state, zero3)

    with pytest.raises(sw.collectives.RankFailed) as refused:
        sw.launch(save_one_path_per_rank, 2, timeout=120)
    said = str(refused.value)
    assert "ranks [1] do not see the directory rank 0 made" in said
    assert f"rank 0: {paths[0]}; rank 1: {paths[1]}" in said and "nothing was written" in said
    assert [list(p.parent.iterdir()) for p in paths] == [[], []]  # rank 0's directory removed, nothing written


def _swapped_after_first_read(target: Path, new: Path) -> Any:
    """A callback that replaces ``target`` by a copy of ``new`` (another save renaming its directory into place)
    the first time it is called."""
    import shutil

    calls: list[int] = []

    def swap() -> None:
        calls.append(1)
        if len(calls) == 1:
            shutil.rmtree(target)
            shutil.copytree(new, target)

    return swap


def test_the_dcp_readers_refuse_a_checkpoint_replaced_while_they_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_dcp_state_dict and init_from_dcp check no crc32: a chunk read after the replacement was the next
    save's, and the state a mix of two saves (review: 0.weight of step 1, the rest of step 5). The marker read
    first must still be the one at the path once every file was opened."""
    import shutil

    from shardwise.engine.checkpoint import dcp_files

    step, params, batches = _problem()
    _, first, second = _states(step, params, batches)
    old, new, target = tmp_path / "old", tmp_path / "new", tmp_path / "target"
    sw.checkpoint.save(old, first, step)
    sw.checkpoint.save(new, second, step)
    shutil.copytree(old, target)
    swap, real_load = _swapped_after_first_read(target, new), torch.load

    def load_then_swap(*args: Any, **kwargs: Any) -> Any:
        out = real_load(*args, **kwargs)
        swap()
        return out

    monkeypatch.setattr(torch, "load", load_then_swap)
    with pytest.raises(sw.checkpoint.CheckpointError, match=REPLACED):
        sw.checkpoint.read_dcp_state_dict(target, "model.")
    monkeypatch.setattr(torch, "load", real_load)
    assert sw.checkpoint.read_dcp_state_dict(target, "model.").keys()  # whole again: reads

    shutil.rmtree(target)
    shutil.copytree(old, target)
    swap, reader = _swapped_after_first_read(target, new), dcp_files._record_reader

    def read_then_swap(*args: Any, **kwargs: Any) -> Any:
        inner = reader(*args, **kwargs)

        def read(pieces: Any) -> None:
            inner(pieces)
            swap()

        return read

    monkeypatch.setattr(dcp_files, "_record_reader", read_then_swap)
    with pytest.raises(sw.checkpoint.CheckpointError, match=REPLACED):
        sw.checkpoint.init_from_dcp(step, target, prefix="model.")


def test_a_version_1_checkpoint_replaced_after_its_marker_was_read_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version-1 marker lists sizes only: indexes read after a replacement are not checked against it, and they
    match the new records' crc32s (review: the step count of step 1 with the parameters of step 5). The marker is
    compared once more when every file was opened."""
    import json
    import shutil
    import warnings

    step, params, batches = _problem()
    _, first, second = _states(step, params, batches)
    for name, state in (("old", first), ("new", second)):
        sw.checkpoint.save(tmp_path / name, state, step)
        _as_version_1(tmp_path / name, json)
    target = tmp_path / "target"
    shutil.copytree(tmp_path / "old", target)
    open_committed = ck.open_committed

    def then_replaced(directory: Path) -> Any:
        committed = open_committed(directory)
        shutil.rmtree(target)
        shutil.copytree(tmp_path / "new", target)
        return committed

    monkeypatch.setattr(ck, "open_committed", then_replaced)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (version 1 loads with a warning that it is unverified)
        with pytest.raises(sw.checkpoint.CheckpointError, match=REPLACED):
            sw.checkpoint.load(target, step)


def _as_version_1(directory: Path, json: Any) -> None:
    """Rewrite a checkpoint as format version 1 wrote it: no checksums, a marker of sizes only."""
    for path in directory.iterdir():
        if path.suffix == ".json":
            value = json.loads(path.read_text())
            value.pop("sha256", None)
            if path.name == "shardwise.json":
                value["version"] = 1
            path.write_text(json.dumps(value))
    sizes = {p.name: p.stat().st_size for p in directory.iterdir() if p.name != "COMMITTED"}
    (directory / "COMMITTED").write_text(json.dumps({"files": sizes}))
