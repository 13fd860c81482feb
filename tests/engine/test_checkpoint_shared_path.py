"""Two runs saving to one path at once: the second's recovery removes the first's unfinished directory
and makes its own, and the first's ranks, still writing, write into it. A commit over files of two
saves must not pass: each rank's index records the save that wrote it, and the commit checks it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.file_format import data_file, index_file, read_json
from shardwise.testing.models import mlp


def _problem() -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)),
                           "dp", stage=3)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
                torch.randn(8, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
    return step, params, batches


def test_a_commit_over_another_saves_rank_files_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step, params, batches = _problem()
    other, mine = tmp_path / "other", tmp_path / "mine"

    def save_after(steps: int, path: Path) -> None:
        state = step.init(params, sw.Mesh(dp=2))
        for batch in batches[:steps]:
            state, _ = step(state, batch)
        sw.checkpoint.save(path, state, step)

    sw.launch(lambda: save_after(1, other), 2)  # the other run's save: another state, the same layout

    def other_run_writes_rank_1(point: str) -> None:
        if point == "before-commit":  # rank 0 alone, once every rank of this save has written
            partial = ck._partial(mine)
            for name in (data_file(1), index_file(1)):
                shutil.copyfile(other / name, partial / name)

    monkeypatch.setattr(ck, "_fault", other_run_writes_rank_1)
    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1's files are another save's: another save to .*mine "
                                                        r"wrote into \.mine\.partial while this one did"):
        sw.launch(lambda: save_after(2, mine), 2)
    monkeypatch.setattr(ck, "_fault", None)
    assert not mine.exists()
    with pytest.raises(sw.checkpoint.CheckpointError, match="a save to it was interrupted"):
        ck.resolve(mine)  # what load looks for: nothing committed, no mix of the two runs


def test_each_rank_index_names_the_save_and_a_save_loads_whole(tmp_path: Path) -> None:
    step, params, batches = _problem()

    def run() -> Any:
        state, _ = step(step.init(params, sw.Mesh(dp=2)), batches[0])
        sw.checkpoint.save(tmp_path / "c", state, step)
        loaded = sw.checkpoint.load(tmp_path / "c", step, sw.Mesh(dp=2))
        return all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((state.params, state.opt_state)),
                                                      optree.tree_leaves((loaded.params, loaded.opt_state)),
                                                      strict=True))

    assert all(sw.launch(run, 2))
    ids = {read_json(tmp_path / "c" / index_file(r), "index")["save"] for r in range(2)}
    assert len(ids) == 1 and len(next(iter(ids))) == 32, ids


def test_rank_files_removed_after_they_were_written_are_named_with_the_likely_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the other run's recovery does to this save's directory: a raw 'rank0.json is missing' before."""
    step, params, batches = _problem()

    def other_run_removes_it(point: str) -> None:
        if point == "before-commit":
            shutil.rmtree(ck._partial(tmp_path / "c"))
            ck._partial(tmp_path / "c").mkdir()

    monkeypatch.setattr(ck, "_fault", other_run_removes_it)

    def run() -> None:
        state, _ = step(step.init(params, sw.Mesh(dp=2)), batches[0])
        sw.checkpoint.save(tmp_path / "c", state, step)

    with pytest.raises(sw.collectives.RankFailed, match=r"the files of ranks \[0, 1\] are gone after they were "
                                                        r"written: another save to .* may have removed \.c\.partial"):
        sw.launch(run, 2)



def _commit_with_removal(step: sw.Step, params: Any, batches: Any, path: Path, armed: list[bool]) -> tuple[str, bool]:
    """Save after one step (committed), then, ``armed``, after two (the save under test); then what the
    second save raised, and whether the path loads as the first save's state."""
    state, _ = step(step.init(params, sw.Mesh(dp=2)), batches[0])
    sw.checkpoint.save(path, state, step)
    first = optree.tree_leaves((state.params, state.opt_state))
    later, _ = step(state, batches[1])
    armed.append(True)
    try:
        sw.checkpoint.save(path, later, step, overwrite=True)
        raised = "nothing"
    except sw.checkpoint.CheckpointError as err:
        raised = str(err)
    armed.clear()
    loaded = sw.checkpoint.load(path, step, sw.Mesh(dp=2))
    same = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves((loaded.params, loaded.opt_state)), first,
                                                  strict=True))
    return raised, same


def test_a_directory_removed_while_the_commit_writes_into_it_is_named_and_the_old_checkpoint_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (the other run's recovery) removing this save's directory while rank 0 writes its
    metadata into it: a raw FileNotFoundError ('.c.partial/.metadata') before. The checkpoint saved
    before stays at the path and loads."""
    step, params, batches = _problem()
    path, armed = tmp_path / "c", []
    write = ck.write_dcp_metadata

    def removed_first(directory: Path, metadata: Any) -> None:
        if armed:  # the second save: gone between rank 0's metadata and its DCP metadata
            shutil.rmtree(directory)
        write(directory, metadata)

    monkeypatch.setattr(ck, "write_dcp_metadata", removed_first)
    results = sw.launch(lambda: _commit_with_removal(step, params, batches, path, armed), 2)
    for raised, same in results:
        assert re.search(r"\.c\.partial: removed by another process while this save committed it \(.*\.c\.partial/"
                         r"\.metadata is gone\): another save to .*c \(two runs saving to one path\?\) or a cleanup "
                         r".*; nothing was committed, and the checkpoint at .*c is as it was before this save",
                         raised), raised
        assert same
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_directory_moved_away_after_its_commit_marker_is_named_and_the_old_checkpoint_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removed between the commit marker and the rename that puts it in place (after the old checkpoint
    was moved aside as .c.previous): the old one is where load finds it."""
    step, params, batches = _problem()
    path, armed = tmp_path / "c", []

    def remove_it(point: str) -> None:
        if armed and point == "between-renames":
            shutil.rmtree(ck._partial(path))

    monkeypatch.setattr(ck, "_fault", remove_it)
    results = sw.launch(lambda: _commit_with_removal(step, params, batches, path, armed), 2)
    for raised, same in results:
        assert re.search(r"\.c\.partial: committed, then removed or moved by another process before it was renamed "
                         r"to .*c .*this save is not at .*c; the checkpoint that was at c is kept as .*\.c\.previous "
                         r"\(load finds it there\)", raised), raised
        assert same
