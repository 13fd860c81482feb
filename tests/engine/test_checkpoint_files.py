"""A checkpoint on disk: refused when partial, corrupt, of another version or of another model;
replaced atomically; never able to run code on load; described by ``shardwise checkpoint inspect``."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.cli import main as cli_main
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.file_format import CheckpointError, write_commit_marker, write_json
from shardwise.testing.models import mlp


def _step(widths: tuple[int, ...] = (4, 6, 3), dtype: torch.dtype = torch.float64,
          policy: str | None = None) -> tuple[Any, Any]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp(list(widths)).to(dtype))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    if policy is not None:
        base = sw.mixed_precision(base, policy)
    return sw.shard_params(base, "dp", stage=3), params


def _saved(tmp_path: Path, name: str = "c") -> tuple[Path, Any, Any]:
    step, params = _step()
    path = tmp_path / name

    def main() -> None:
        ck.save(path, step.init(params, sw.Mesh(dp=2)), step)

    sw.launch(main, 2)
    return path, step, params


def _load(path: Path, step: Any) -> Any:
    return sw.launch(lambda: ck.load(path, step, sw.Mesh(dp=2)), 2)


def _refused(path: Path, step: Any, *fragments: str) -> None:
    with pytest.raises(sw.collectives.RankFailed) as info:
        _load(path, step)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_truncated_rank_file_is_refused_naming_it(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)
    data = path / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    _refused(path, step, "__1_0.distcp", "truncated")


def test_a_corrupt_record_is_refused_by_its_checksum(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the crc32 can tell
    data.write_bytes(bytes(raw))
    _refused(path, step, "__0_0.distcp", "crc32")


def test_a_missing_rank_file_is_refused_naming_it(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)
    (path / "rank1.json").unlink()
    _refused(path, step, "rank1.json", "missing")


def test_an_uncommitted_checkpoint_is_refused(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)
    (path / "COMMITTED").unlink()
    _refused(path, step, "not committed", "COMMITTED")


def test_another_format_version_is_refused(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)
    meta = json.loads((path / "shardwise.json").read_text())
    meta.pop("sha256")
    # rewrite the files as a save of version 99 would have: signed, and the marker listing them
    write_json(path / "shardwise.json", {**meta, "version": 99})
    write_commit_marker(path)
    _refused(path, step, "format version 99", "reads versions 1 and 2")


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    path, _, _ = _saved(tmp_path)
    deeper, _ = _step((4, 6, 6, 3))
    _refused(path, deeper, "another model", "4.weight")
    wider, wider_params = _step((4, 8, 3))  # same names, other shapes
    with pytest.raises(CheckpointError, match="shapes or dtypes differ"):
        ck.load(path, wider, None, like=wider_params)  # checked before any layout is made


def test_a_model_of_other_widths_is_refused_without_like(tmp_path: Path) -> None:
    """The step's modules say what it was built for: loading must not train with the checkpoint's
    shapes instead."""
    path, _, _ = _saved(tmp_path)
    wider, _ = _step((4, 8, 3))
    _refused(path, wider, "0.weight (params['0']['weight']) is float64 [6, 4] in the checkpoint, "
             "float64 [8, 4] in the model", "its widths")


def test_another_dtype_is_refused_and_a_policy_that_stores_it_loads(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)
    single, _ = _step(dtype=torch.float32)
    _refused(path, single, "is float64 [6, 4] in the checkpoint, float32 [6, 4] in the model",
             "mixed_precision")
    # its master params are float64: it loads
    stored_f64, _ = _step(dtype=torch.float32, policy="params=f64,compute=f32")
    for got, want in zip(_load(path, stored_f64), _load(path, step), strict=True):
        pairs = zip(optree.tree_leaves(got.params), optree.tree_leaves(want.params), strict=True)
        assert all(a.dtype == torch.float64 and torch.equal(a, b) for a, b in pairs)


def test_a_record_that_would_run_code_is_refused(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, ("echo owned",))

    buffer = io.BytesIO()
    torch.save(Payload(), buffer, pickle_module=pickle)
    index = json.loads((path / "rank0.json").read_text())
    record = index["records"][0]
    raw = bytearray((path / "__0_0.distcp").read_bytes())
    evil = buffer.getvalue()
    raw[record["offset"]: record["offset"] + record["length"]] = evil
    (path / "__0_0.distcp").write_bytes(bytes(raw))
    import zlib

    shift = len(evil) - record["length"]
    for r in index["records"]:
        if r["offset"] > record["offset"]:
            r["offset"] += shift
    record.update(length=len(evil), crc32=zlib.crc32(evil))
    # as a record saved before ranged reads (no chunk crc32s), which is read whole and unpickled;
    # with them, the load would read the chunks at data_offset and refuse them by their crc32s
    record.pop("data_offset")
    record.pop("chunk_crc32s")
    index.pop("sha256")
    write_json(path / "rank0.json", index)  # signed and committed, as a save would have
    write_commit_marker(path)
    _refused(path, step, "does not load", "__0_0.distcp")


def test_overwrite_replaces_atomically_and_an_interrupted_replace_keeps_the_old_one(tmp_path: Path) -> None:
    path, step, params = _saved(tmp_path)
    with pytest.raises(sw.collectives.RankFailed, match="exists; pass overwrite=True"):
        sw.launch(lambda: ck.save(path, step.init(params, sw.Mesh(dp=2)), step), 2)

    # One batch for both ranks: each drawing its own would pass different batches (the step refuses).
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))

    def advance_and_overwrite() -> None:
        state, _ = step(step.init(params, sw.Mesh(dp=2)), batch)
        ck.save(path, state, step, overwrite=True)

    sw.launch(advance_and_overwrite, 2)
    assert _load(path, step)[0].step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    # a crash between the two renames leaves only the moved-aside checkpoint: load finds it
    os.rename(path, tmp_path / ".c.previous")
    assert _load(path, step)[0].step == 1


def test_a_save_left_partial_is_named_when_loading(tmp_path: Path) -> None:
    path, step, _ = _saved(tmp_path)
    shutil.move(path, tmp_path / ".c.partial")
    (tmp_path / ".c.partial" / "COMMITTED").unlink()
    _refused(path, step, "interrupted", ".c.partial")


def test_inspect_lists_ranks_and_leaves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = _saved(tmp_path)
    assert cli_main(["checkpoint", "inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "step 0" in text and "rank 1" in text and "0.weight" in text and "ZeRO-3" in text
    assert cli_main(["checkpoint", "inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert {"model.0.weight", "optim.momentum.0.weight"} <= set(report["tensors"])
    assert cli_main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 1
    assert "no checkpoint" in capsys.readouterr().err


def test_the_step_count_and_the_random_streams_seed_come_back(tmp_path: Path) -> None:
    step, params = _step()
    batch = (torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))  # one for both ranks

    def main() -> None:
        state, _ = step(step.init(params, sw.Mesh(dp=2), seed=7), batch)
        ck.save(tmp_path / "c", state, step)

    sw.launch(main, 2)
    loaded = _load(tmp_path / "c", step)[1]
    assert (loaded.step, loaded.rng) == (1, 7)


def test_a_path_that_is_not_a_checkpoint_says_what_it_is(tmp_path: Path) -> None:
    """A directory of other files was called "an interrupted save", a file "does not exist"."""
    step, _ = _tiny_step()
    (tmp_path / "notes.txt").write_text("x")
    torch.save({"a": 1}, tmp_path / "state.pt")
    other = r"is not a shardwise checkpoint: it holds none of its files .*\['notes\.txt', 'state\.pt'"
    with pytest.raises(CheckpointError, match=other + r"\]; pass the directory"):
        sw.checkpoint.load(tmp_path, step)
    a_file = r"state\.pt: it is a file, and a shardwise checkpoint is a directory .*torch\.load"
    with pytest.raises(CheckpointError, match=a_file):
        sw.checkpoint.load(tmp_path / "state.pt", step)


def test_a_torch_saved_state_on_another_world_points_to_sw_checkpoint() -> None:
    step, params = _tiny_step(dp=True)
    blob = sw.launch(lambda: _torch_saved(step.init(params, sw.Mesh(dp=2))), 2)[0]
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    hint = (r"made on Mesh\(dp=2\) \(2 ranks\), but this program runs on a world of 4.*"
            r"sw\.checkpoint\.save\(path, state, step\).*sw\.checkpoint\.load\(path, step, mesh\)")
    with pytest.raises(sw.collectives.RankFailed, match=hint):
        sw.launch(lambda: step(torch.load(io.BytesIO(blob), weights_only=False), batch), 4)


def _tiny_step(dp: bool = False) -> tuple[sw.Step, Any]:
    chain, params = sw.functionalize(mlp([3, 4, 2]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    return (sw.shard_params(step, "dp", 3) if dp else step), params


def _torch_saved(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()
