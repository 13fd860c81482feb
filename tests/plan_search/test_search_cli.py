"""``shardwise search FILE:FUNCTION --world N --memory M``: a table, JSON, a plot, clear usage errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardwise.cli import main

TARGET = '''
import torch, shardwise as sw
from shardwise.plan_search import Space
from shardwise.testing.models import mlp


def make():
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 32, 8]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    batch = (torch.randn(8, 8), torch.randn(8, 8))
    space = Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(1, 2), remat=(None,))
    return step, params, batch, {"tp_plan": {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}, "space": space}


def bad_options():
    return (*make()[:3], {"tp_pln": {}})


class DictIn(torch.nn.Module):
    """Takes a dict of inputs, as a Hugging Face model does."""

    def __init__(self):
        super().__init__()
        self.net = mlp([8, 32, 8])

    def forward(self, inputs):
        return self.net(inputs["x"] * inputs["mask"])


def dict_batch():
    torch.manual_seed(0)
    batch = ({"x": torch.randn(8, 8), "mask": torch.ones(8, 1)}, torch.randn(8, 8))
    chain, params = sw.functionalize(DictIn(), example_input=batch[0])
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    return step, params, batch, {"space": Space(zero_stages=(1,), microbatches=(1,), remat=(None,))}
'''


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "search_target.py"
    path.write_text(TARGET)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield path
    sys.modules.pop("search_target", None)


def test_table_json_and_plot(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1MiB", "--flops", "1e9", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == ["#", "stack", "time/step", "peak/rank", "bytes", "per", "axis"]
    assert "communication is not priced" in text and "layouts that fit" in text
    picture = tmp_path / "frontier.png"
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1MiB", "--flops", "1e9", "--json",
                 "--plot", str(picture)]) == 0
    data = json.loads(capsys.readouterr().out)
    times = [row["time_s"] for row in data["ranked"]]
    assert data["ok"] and times == sorted(times) and {row["tp"] for row in data["ranked"]} == {1, 2}
    assert all(row["peak_bytes"] <= 2**20 for row in data["ranked"] + data["others"])
    pytest.importorskip("matplotlib")
    assert data["plot"] == f"plot written to {picture}" and picture.stat().st_size > 1000
    bare = tmp_path / "frontier"  # no suffix: matplotlib writes frontier.png, which the output names
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1MiB", "--flops", "1e9", "--json",
                 "--plot", str(bare)]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == f"plot written to {bare}.png" and not bare.exists()


def test_usage_errors(target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "lots"]) == 2
    assert "write a number and a unit" in capsys.readouterr().err
    assert main(["search", f"{target}:bad_options", "--world", "2", "--memory", "1GB", "--flops", "1e9"]) == 2
    assert "options ['tp_pln'] are not search options" in capsys.readouterr().err
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1GB", "--comm", "nowhere.jsonl"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_no_layout_that_fits_is_answer_no_and_flags_that_mean_nothing_are_refused(
    target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing fitting 1 B per rank exited 0 with "ok": true (a script chaining `search && launch` went on);
    --flops inf ranked by memory alone (every time 0); --tokens-per-sample without --flops was ignored."""
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1B", "--flops", "1e9"]) == 1
    captured = capsys.readouterr()
    assert "refused by memory" in captured.out and "no layout of 2 ranks fits 1 B per rank" in captured.err
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1B", "--flops", "1e9", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["fitting"] == 0 and data["refused"]
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1MiB", "--flops", "inf"]) == 2
    assert "--flops inf: a finite rate above 0" in capsys.readouterr().err
    assert main(["search", f"{target}:make", "--world", "2", "--memory", "1MiB", "--tokens-per-sample", "9"]) == 2
    assert "--tokens-per-sample counts the FLOPs of --flops: give --flops too" in capsys.readouterr().err


def test_flops_counts_the_samples_of_a_dict_batch(target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--flops read the batch's size off its first element, a tensor: a Hugging Face batch
    ``({"input_ids": ..., "attention_mask": ...}, labels)`` crashed with AttributeError."""
    assert main(["search", f"{target}:dict_batch", "--world", "2", "--memory", "1MiB", "--flops", "1e9",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["stack"] for row in data["ranked"]] == ["dp2 zero1"], data


def test_a_plot_that_cannot_be_written_is_refused_before_the_search(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --plot into a missing folder ran the whole search (minutes on a large model), then failed
    with FileNotFoundError and no table."""
    import shardwise.cli.search_cmd as search_cmd

    searched: list[bool] = []
    real_search = search_cmd.search
    monkeypatch.setattr(search_cmd, "search", lambda *a, **k: searched.append(True) or real_search(*a, **k))
    nowhere = tmp_path / "no_such_folder" / "frontier.png"
    args = ["search", f"{target}:make", "--world", "2", "--memory", "1MiB", "--flops", "1e9"]
    assert main([*args, "--plot", str(nowhere)]) == 2
    assert "--plot" in (err := capsys.readouterr().err) and "there is no folder" in err and not searched
    pytest.importorskip("matplotlib")
    assert main([*args, "--plot", str(tmp_path / "frontier.pngx")]) == 2
    assert "matplotlib cannot write a .pngx file" in capsys.readouterr().err and not searched
    # found by session 41's probing: a folder was taken, and the plot landed beside it as <folder>.png
    assert main([*args, "--plot", str(tmp_path)]) == 2
    assert "is a folder: name a file in it" in capsys.readouterr().err and not searched

    def fails(*_: object) -> str:  # a failure only the drawing finds (a full disk): the table still comes
        raise OSError("No space left on device")

    monkeypatch.setattr(search_cmd, "plot_frontier", fails)
    assert main([*args, "--plot", str(tmp_path / "frontier.png")]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split()[:2] == ["#", "stack"] and "No space left" in captured.err
