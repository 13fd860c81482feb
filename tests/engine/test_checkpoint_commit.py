"""The commit protocol under crashes: wherever a save stops (each crash point it passes, each
rename and each removal it makes, a removal stopped half way), and wherever the save after such a
crash stops, a complete checkpoint stays and ``load`` finds it: the state loadable before the save
or the one it saves, never a mix, never nothing. ``overwrite=False`` refuses while one exists,
also one that only a recovery would put back in place.

One device (no mesh): the protocol is rank 0's alone, and a save takes milliseconds, so every
point of two saves in a row is tried.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.file_format import COMMITTED, CheckpointError
from shardwise.testing.models import mlp


class Crash(Exception):
    """What a test raises where a save would have died."""


@pytest.fixture(scope="module")
def problem() -> tuple[Any, list[Any]]:
    """A step and three states of it, one step apart (so each differs from the others)."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
    states = [step.init(params)]
    for _ in range(2):
        states.append(step(states[-1], batch)[0])
    return step, states


class _CrashAt:
    """Counts the points a save passes; a crash is due at the ``at``-th (or the one so named)."""

    def __init__(self, at: int | str) -> None:
        self.at, self.passed, self.reached = at, 0, False

    def tick(self, what: str) -> bool:
        self.passed += 1
        self.reached = self.reached or self.at in (self.passed, what)
        return self.at in (self.passed, what)


@pytest.fixture
def crash_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``crash_at(n)``: the next save dies at its ``n``-th point (a crash point, a rename, a
    removal: the removal half done, its marker gone first as the code removes it), or at the
    point named ``n``."""
    rename, discard = ck._rename, ck._discard
    current: list[_CrashAt] = []

    def crashing_rename(source: Path, dest: Path) -> None:
        if current and current[0].tick(f"rename {source.name}"):
            raise Crash(f"before renaming {source.name} to {dest.name}")
        rename(source, dest)

    def crashing_discard(directory: Path) -> None:
        if current and current[0].tick(f"remove {directory.name}"):
            (directory / COMMITTED).unlink(missing_ok=True)
            for file in sorted(directory.iterdir())[:1]:
                file.unlink()
            raise Crash(f"half way through removing {directory.name}")
        discard(directory)

    def fault(point: str) -> None:
        if current and current[0].tick(point):
            raise Crash(f"at {point}")

    monkeypatch.setattr(ck, "_rename", crashing_rename)
    monkeypatch.setattr(ck, "_discard", crashing_discard)
    monkeypatch.setattr(ck, "_fault", fault)

    def arm(n: int | str) -> _CrashAt:
        current[:] = [_CrashAt(n)]
        return current[0]

    yield arm
    current.clear()


def _save(path: Path, state: Any, step: Any, crash: _CrashAt, **kw: Any) -> bool:
    """Whether the save crashed (at ``crash``'s point)."""
    try:
        ck.save(path, state, step, overwrite=True, **kw)
    except (Crash, CheckpointError) as err:
        # a rank's write error is the cause; the commit's error names it
        assert isinstance(err, Crash) or isinstance(err.__cause__, Crash) or "Crash" in str(err), err
        return True
    assert not crash.reached, "the save passed its crash point without crashing"
    return False


def _which(path: Path, step: Any, states: list[Any]) -> int:
    """The index of the state that loads from ``path``, which must be one of ``states`` exactly."""
    loaded = ck.load(path, step)
    leaves = optree.tree_leaves((loaded.params, loaded.opt_state))
    for i, state in enumerate(states):
        pairs = zip(leaves, optree.tree_leaves((state.params, state.opt_state)), strict=True)
        if loaded.step == state.step and all(torch.equal(a, b) for a, b in pairs):
            return i
    raise AssertionError(f"{path} loads none of the saved states (its step is {loaded.step})")


def _copy(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def test_a_crash_anywhere_in_a_replace_and_in_the_save_after_it_keeps_a_checkpoint(
    problem: tuple[Any, list[Any]], crash_at: Any, tmp_path: Path
) -> None:
    step, (s0, s1, s2) = problem
    base = tmp_path / "base"
    base.mkdir()
    ck.save(base / "c", s0, step)
    points = 0
    for n in itertools.count(1):
        first = _copy(base, tmp_path / f"n{n}")
        crashed = _save(first / "c", s1, step, crash_at(n))
        before = _which(first / "c", step, [s0, s1]) if crashed else 1
        for m in itertools.count(1):
            second = _copy(first, tmp_path / f"n{n}m{m}")
            crashed_again = _save(second / "c", s2, step, crash_at(m))
            got = _which(second / "c", step, [s0, s1, s2])
            assert got in (before, 2), f"crashes at points {n}, {m}: state {got}, not {before} or 2"
            if not crashed_again:
                assert got == 2 and [p.name for p in second.iterdir()] == ["c"], list(second.iterdir())
                break
            shutil.rmtree(second)
        points += 1
        if not crashed:
            assert sorted(p.name for p in first.iterdir()) == ["c"]
            break
        shutil.rmtree(first)
    assert points >= 8, "every rename, removal and crash point of a save is tried"


def test_overwrite_false_refuses_a_recoverable_checkpoint_and_changes_nothing(
    problem: tuple[Any, list[Any]], crash_at: Any, tmp_path: Path
) -> None:
    step, (s0, s1, s2) = problem
    path = tmp_path / "c"
    ck.save(path, s0, step)
    assert _save(path, s1, step, crash_at("between-renames"))
    assert not path.exists()  # only .c.previous and a committed .c.partial
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="overwrite=True"):
        ck.save(path, s2, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == listing
    assert _which(path, step, [s0, s1]) == 0  # the old one: the save that replaced it did not return
    crash_at(0)  # disarmed: no point is the 0th
    ck.save(path, s2, step, overwrite=True)
    assert _which(path, step, [s2]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def _listing(root: Path) -> dict[str, list[str]]:
    return {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() and not p.is_symlink() else [] for p in
            sorted(root.iterdir())}


def test_a_save_through_a_symbolic_link_is_refused_and_the_checkpoint_it_points_to_kept(
    problem: tuple[Any, list[Any]], tmp_path: Path
) -> None:
    """A ``latest`` link to the newest checkpoint: a save to it moved the link aside and removed the
    commit marker of the checkpoint it points to (which then refused to load, as an interrupted save),
    and every later save to the link failed."""
    step, (s0, s1, _) = problem
    ck.save(tmp_path / "step1", s0, step)
    (tmp_path / "latest").symlink_to(tmp_path / "step1")
    before = _listing(tmp_path)
    for overwrite in (True, False):
        with pytest.raises(CheckpointError, match=r"latest is a symbolic link \(to .*step1\): a save moves the "
                           r"checkpoint at its path aside .*save to a path of its own and point the link at it"):
            ck.save(tmp_path / "latest", s1, step, overwrite=overwrite)
    assert _listing(tmp_path) == before
    assert _which(tmp_path / "latest", step, [s0]) == 0 and _which(tmp_path / "step1", step, [s0]) == 0


def test_overwrite_replaces_only_a_checkpoint(problem: tuple[Any, list[Any]], tmp_path: Path) -> None:
    """overwrite=True on a directory of the user's own files deleted them all; on a file, moved it
    aside as a hidden .previous and reported a failed commit."""
    step, (s0, _, _) = problem
    run = tmp_path / "run1"
    run.mkdir()
    for name in ("config.yaml", "train.log", "best_model.pt"):
        (run / name).write_text("precious")
    weights = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(3)}, weights)
    before = _listing(tmp_path)
    with pytest.raises(CheckpointError, match=r"run1 is not a shardwise checkpoint: it holds none of its files .*"
                       r"\['best_model.pt', 'config.yaml', 'train.log'\], which a save \(overwrite=True\) "
                       r"would delete"):
        ck.save(run, s0, step, overwrite=True)
    with pytest.raises(CheckpointError, match=r"weights.pt is a file, not a shardwise checkpoint"):
        ck.save(weights, s0, step, overwrite=True)
    assert _listing(tmp_path) == before and (run / "train.log").read_text() == "precious"
    empty = tmp_path / "empty"
    empty.mkdir()  # a directory made for the checkpoint: saved into
    ck.save(empty, s0, step, overwrite=True)
    assert _which(empty, step, [s0]) == 0


def test_overwrite_refuses_a_checkpoint_holding_files_of_the_users(
    problem: tuple[Any, list[Any]], tmp_path: Path
) -> None:
    """Found by session 41's probing: a NOTES.txt kept in a checkpoint's directory was deleted with the checkpoint
    a save with overwrite=True replaced."""
    step, (s0, s1, _) = problem
    path = tmp_path / "ck"
    ck.save(path, s0, step)
    (path / "NOTES.txt").write_text("precious")
    before = _listing(tmp_path)
    with pytest.raises(CheckpointError, match=r"ck holds a shardwise checkpoint and files no save wrote "
                       r"\(\['NOTES.txt'\]\), which a save \(overwrite=True\) replacing it would delete"):
        ck.save(path, s1, step, overwrite=True)
    assert _listing(tmp_path) == before and _which(path, step, [s0, s1]) == 0
    (path / "NOTES.txt").unlink()
    ck.save(path, s1, step, overwrite=True)
    assert _which(path, step, [s0, s1]) == 1


def test_a_state_an_in_place_update_consumed_is_not_saved(tmp_path: Path) -> None:
    """The step refuses a state its in-place update wrote past; save took it: the checkpoint said step
    1 and held update 2's parameters and momentum."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9, inplace=True))
    batch = (torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
    s1, _ = step(step.init(params), batch)
    s2, _ = step(s1, batch)
    with pytest.raises(CheckpointError, match=r"this TrainState \(step 1\) was consumed by an in-place update"):
        ck.save(tmp_path / "c", s1, step)
    assert list(tmp_path.iterdir()) == []
    ck.save(tmp_path / "c", s2, step)
    assert ck.load(tmp_path / "c", step).step == 2


def test_async_save_commits_through_the_same_protocol(
    problem: tuple[Any, list[Any]], crash_at: Any, tmp_path: Path
) -> None:
    step, (s0, s1, _) = problem
    path = tmp_path / "c"
    ck.save(path, s0, step)
    handle = ck.save(path, s1, step, blocking=False, overwrite=True)
    assert handle.wait() == path
    assert _which(path, step, [s1]) == 0


def test_any_failure_preparing_the_directory_fails_every_rank_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rank 0 prepares the directory; an error there other than an OSError escaped it, and rank 1 waited in
    the agreement until the launch's timeout. Now every rank raises, naming the error."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", 3)

    def broken(target: Path) -> None:
        raise RuntimeError("a filesystem plugin's bug")

    monkeypatch.setattr(ck, "_recover", broken)

    def save() -> str:
        try:
            ck.save(tmp_path / "c", step.init(params, sw.Mesh(dp=2)), step)
        except CheckpointError as err:
            return str(err)
        return "saved"

    for message in sw.launch(save, 2, timeout=30):
        assert "RuntimeError: a filesystem plugin's bug" in message, message


@pytest.mark.parametrize("blocking", [True, False])
def test_a_rank_that_cannot_write_is_named_with_its_error_on_every_rank(
    blocking: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rank 1's files cannot be written (a full disk on its host). Every rank fails, and every rank's
    error names rank 1 and its error: the launcher may report any rank's as the failure, and rank 0's
    said only that "another rank could not write its files"."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", 3)
    write_rank = ck.write_rank

    def full_on_rank_1(directory: Path, rank: int, *args: Any) -> int:
        if rank == 1:
            raise OSError(28, "No space left on device")
        return write_rank(directory, rank, *args)

    monkeypatch.setattr(ck, "write_rank", full_on_rank_1)

    def save() -> str:
        try:
            ck.save(tmp_path / "c", step.init(params, sw.Mesh(dp=2)), step, blocking=blocking).wait()
        except CheckpointError as err:
            return str(err)
        return "saved"

    for rank, message in enumerate(sw.launch(save, 2, timeout=30)):
        assert "No space left on device" in message and "nothing was committed" in message, message
        assert ("this rank could not write" if rank == 1 else "rank 1 could not write its files") in message
    assert not (tmp_path / "c").exists()


def test_an_async_save_never_waited_for_is_committed_when_the_rank_returns(tmp_path: Path) -> None:
    """A loop saving with blocking=False that returned without handle.wait() left its last checkpoint
    uncommitted (it did not load), and the interpreter often aborted at exit with the writer inside
    torch. A launched rank now commits it when its function returns, with its collectives still up."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([5, 7, 6]).double())
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)),
                           "dp", 3)
    batches = [(torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)) for _ in range(3)]

    def main() -> int:
        state = step.init(params, sw.Mesh(dp=2))
        for i, batch in enumerate(batches):
            state, _ = step(state, batch)
            ck.save(tmp_path / f"step{i + 1}", state, step, blocking=False)
        return int(state.step)

    assert sw.launch(main, 2) == [3, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1", "step2", "step3"]
    assert sw.launch(lambda: int(ck.load(tmp_path / "step3", step, sw.Mesh(dp=2)).step), 2) == [3, 3]


ONE_RANK_EXITS = r"""
import sys
import torch
import shardwise as sw
from shardwise.testing.models import mlp

chain, params = sw.functionalize(mlp([5, 7, 6]).double())
step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
sw.checkpoint.save(sys.argv[1], step.init(params), step, blocking=False)
"""


def test_a_single_process_async_save_never_waited_for_is_committed_at_exit(
    tmp_path: Path, fresh_interpreter: Any
) -> None:
    fresh_interpreter(ONE_RANK_EXITS, str(tmp_path / "c"), timeout=120)
    torch.manual_seed(0)
    chain, _ = sw.functionalize(mlp([5, 7, 6]).double())
    assert ck.load(tmp_path / "c", sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))).step == 0
