"""Every file a checkpoint reads is verified: a one-character edit of an index or of the metadata
(same length, so the marker's sizes agree) is refused naming the file, never loaded as wrong values;
a format-version-1 checkpoint (no checksums) still loads, with a warning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.file_format import CheckpointError, write_json
from shardwise.testing.models import mlp


def _step() -> tuple[Any, Any]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 6, 3]).double())
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    return sw.shard_params(base, "dp", stage=3), params


def _saved(tmp_path: Path) -> tuple[Path, Any]:
    step, params = _step()
    path = tmp_path / "c"
    sw.launch(lambda: ck.save(path, step.init(params, sw.Mesh(dp=2)), step), 2)
    return path, step


def _load(path: Path, step: Any) -> Any:
    return sw.launch(lambda: ck.load(path, step, sw.Mesh(dp=2)), 2)


def _edit_json(path: Path, edit: Any) -> None:
    """Apply ``edit`` to the parsed file and write it back in its own layout, at its own length
    (so only a checksum can tell)."""
    before = path.read_text()
    value = json.loads(before)
    edit(value)
    after = json.dumps(value, indent=1)
    assert after != before and len(after) == len(before), "the edit must keep the file's length"
    path.write_text(after)


def _refused(path: Path, step: Any, *fragments: str) -> None:
    with pytest.raises(sw.collectives.RankFailed) as info:
        _load(path, step)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def _shift_a_box(index: dict[str, Any]) -> None:
    """Move one box a row up: still inside its tensor, every element still counted once."""
    record = next(r for r in index["records"] if r["offsets"] and 1 <= r["offsets"][0] <= 9)
    record["offsets"][0] -= 1


def test_a_shifted_box_in_a_rank_index_is_refused_naming_the_file(tmp_path: Path) -> None:
    path, step = _saved(tmp_path)
    _edit_json(path / "rank1.json", _shift_a_box)
    _refused(path, step, "rank1.json", "modified or corrupted", "restore the file")


def test_a_changed_step_count_is_refused(tmp_path: Path) -> None:
    path, step = _saved(tmp_path)
    _edit_json(path / "shardwise.json", lambda meta: meta.update(step=7))
    _refused(path, step, "shardwise.json", "modified or corrupted", "load another checkpoint")


def test_a_same_length_shape_edit_is_refused_naming_the_metadata(tmp_path: Path) -> None:
    path, step = _saved(tmp_path)

    def transpose(meta: dict[str, Any]) -> None:
        entry = next(p for p in meta["params"] if p["shape"] == [6, 4])
        entry["shape"] = [4, 6]

    _edit_json(path / "shardwise.json", transpose)
    _refused(path, step, "shardwise.json", "modified or corrupted")


def test_a_corrupt_dcp_metadata_or_marker_is_refused(tmp_path: Path) -> None:
    path, step = _saved(tmp_path)
    original = (path / ".metadata").read_bytes()
    raw = bytearray(original)
    raw[len(raw) // 2] ^= 0x01  # DCP's reader would trust it: shardwise refuses the checkpoint
    (path / ".metadata").write_bytes(bytes(raw))
    _refused(path, step, ".metadata", "modified or corrupted")
    (path / ".metadata").write_bytes(original)
    _load(path, step)  # restored: loads again

    def grow(marker: dict[str, Any]) -> None:
        entry = marker["files"]["rank0.json"]
        entry["bytes"] = entry["bytes"] + 1 if entry["bytes"] % 10 != 9 else entry["bytes"] - 1

    _edit_json(path / "COMMITTED", grow)
    _refused(path, step, "COMMITTED", "modified or corrupted")


def test_a_rank_index_from_another_save_is_refused(tmp_path: Path) -> None:
    """Each file consistent in itself, but not the one this checkpoint committed: the marker's
    digest of it differs."""
    path, step = _saved(tmp_path)
    index = json.loads((path / "rank1.json").read_text())
    index.pop("sha256")
    _shift_a_box(index)
    write_json(path / "rank1.json", index)  # signed, at the same length
    _refused(path, step, "rank1.json", "modified or corrupted", "COMMITTED")


def _as_version_1(path: Path) -> None:
    """Rewrite a checkpoint as format version 1 wrote it: no checksums, the marker sizes only."""
    for name in ("shardwise.json", "rank0.json", "rank1.json"):
        value = json.loads((path / name).read_text())
        value.pop("sha256")
        if name == "shardwise.json":
            value["version"] = 1
        (path / name).write_text(json.dumps(value, indent=1))
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.name != "COMMITTED"}
    (path / "COMMITTED").write_text(json.dumps({"files": files}, indent=1))


def test_a_version_1_checkpoint_loads_with_a_warning(tmp_path: Path) -> None:
    path, step = _saved(tmp_path)
    expected = ck.load(path, step, sw.Mesh(dp=1))
    _as_version_1(path)
    with pytest.warns(UserWarning, match="format version 1.*no checksums"):
        state = ck.load(path, step, sw.Mesh(dp=1))
    assert state.step == expected.step == 0
    pairs = zip(optree.tree_leaves(state.params), optree.tree_leaves(expected.params), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.warns(UserWarning, match="format version 1"):
        assert ck.describe(path)["version"] == 1


def test_a_version_1_marker_with_a_version_2_metadata_is_refused(tmp_path: Path) -> None:
    """Stripping the checksums off a version-2 checkpoint does not make it loadable unverified."""
    path, step = _saved(tmp_path)
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.name != "COMMITTED"}
    (path / "COMMITTED").write_text(json.dumps({"files": files}, indent=1))
    with pytest.raises(CheckpointError, match="modified or corrupted"):
        ck.load(path, step, sw.Mesh(dp=1))


def test_a_read_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """One flipped byte in the records only rank 1 reads: rank 1's load raised while rank 0's returned
    its state, so a loop that starts afresh on an error trained a ZeRO-3 model half loaded, half fresh
    (at step counts 4 and 2), without an error. Every rank now raises: rank 1 its own error, rank 0
    that another rank failed."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([5, 7, 3, 6]).double())
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)),
                           "dp", 3)
    path = tmp_path / "c"
    sw.launch(lambda: ck.save(path, step.init(params, sw.Mesh(dp=2)), step), 2)
    record = json.loads((path / "rank1.json").read_text())["records"][0]
    data = bytearray((path / "__1_0.distcp").read_bytes())
    data[record["offset"] + record["data_offset"] + 3] ^= 0xFF
    (path / "__1_0.distcp").write_bytes(bytes(data))

    def resume() -> str:
        try:
            ck.load(path, step, sw.Mesh(dp=2))
        except CheckpointError as err:
            return str(err)
        return "loaded"

    rank0, rank1 = sw.launch(resume, 2)
    assert "rank 1 failed (CheckpointError: checkpoint " in rank0 and "so this one stops too" in rank0, rank0
    assert "__1_0.distcp" in rank1, rank1
