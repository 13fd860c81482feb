"""Examples double as smoke tests, shortened."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--vocab", "64", "--d-model", "32", "--n-layers", "2", "--seq-len", "16", "--batch", "8"]


def _load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_train_gpt_on_threads_learns(capsys: pytest.CaptureFixture[str]) -> None:
    losses = _load("train_gpt").main(["--steps", "30", "--world", "2", "--lr", "1e-2", *SMALL])
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert "30/30" in capsys.readouterr().err  # the progress bar, drawn by tqdm on rank 0 only


def test_custom_schedule_is_drawn_checked_and_trained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "schedule.png"
    losses = _load("custom_schedule").main(["--png", str(png), "--steps", "12"])
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "refused, as it should be: the schedule deadlocks" in out
    assert re.search(r"^equivalent over 4 steps", out, re.MULTILINE), out
    assert len(losses) == 12 and sum(losses[-4:]) < sum(losses[:4])  # a pass over the 4 batches


def test_compose_all_is_equivalent_and_learns(capsys: pytest.CaptureFixture[str]) -> None:
    losses = _load("compose_all").main(["--check-steps", "2", "--steps", "12"])
    out = capsys.readouterr().out
    assert "Plan on Mesh(dp=2, pp=2): 4 ranks" in out
    assert re.search(r"^equivalent over 2 steps", out, re.MULTILINE), out
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0]  # measured: 4.18 -> 3.00


@pytest.mark.gloo
def test_train_gpt_under_torchrun() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           f"--master-port={port}", str(ROOT / "examples" / "train_gpt.py"), "--steps", "4", *SMALL]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^loss [\d.]+ -> [\d.]+ ", result.stdout, re.MULTILINE), result.stdout
    assert "4/4" in result.stderr, result.stderr[-3000:]  # rank 0's tqdm bar reached the end


GPU_DRY_RUN = ["--device", "cpu", "--quick", "--steps", "2", "--warmup", "1"]


def _gpu_rows(stdout: str, kinds: set[str]) -> list[dict[str, object]]:
    """benchmarks/gpu.py's CPU dry run of ``kinds`` (``--only``): its rows, none failed, every kind there."""
    rows = [json.loads(line) for line in stdout.splitlines()]
    failed = [row for row in rows if row.get("ok") is False]
    assert not failed, failed
    assert {row["kind"] for row in rows} == kinds, rows
    return rows


# benchmarks/gpu.py runs on GPU machines only by hand; its CPU dry run keeps it working here, in two
# runs: its process checks start two gloo rank processes (the gloo worker's); its equivalence checks
# (thread ranks), speed rows and process-group check (one child process, a group of one on its own
# port: no ranks) start none, and run beside them on the other worker.
@pytest.mark.gloo
def test_gpu_benchmark_dry_run_on_the_cpu_processes() -> None:
    """In an interpreter of its own: its ranks, forked from its fork server, import its functions from it."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *GPU_DRY_RUN, "--only", "processes"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    _gpu_rows(result.stdout, {"processes"})


def test_gpu_benchmark_dry_run_on_the_cpu_threads(
    capsys: pytest.CaptureFixture[str], benchmark_script: Callable[[str], Any]
) -> None:
    """Its ``main`` in this process: its ranks are threads, its process-group check starts its own child."""
    kinds = {"equivalence", "speed", "process_group"}
    bench = benchmark_script("gpu")
    capsys.readouterr()
    bench.main([*GPU_DRY_RUN, "--only", ",".join(sorted(kinds))])
    rows = _gpu_rows(capsys.readouterr().out, kinds)
    losses = {row["variant"]: row["losses"] for row in rows if row["kind"] == "speed"}
    # The same arithmetic written twice: ours and torch eager agree (to the 5 decimals reported).
    assert losses["ours:f32"] == losses["torch:f32"] == losses["ours:zero3_dp1_f32"]
    assert losses["ours:bf16"] == losses["torch:bf16_pure"]


@pytest.mark.gloo  # the gloo half starts two processes
def test_collectives_benchmark_round_trip(
    capsys: pytest.CaptureFixture[str], benchmark_script: Callable[[str], Any]
) -> None:
    """benchmarks/collectives.py's send_recv (the pipeline's message pattern) runs and checks itself."""
    def args(world: int) -> list[str]:
        return ["--backends", "threads,gloo", "--worlds", str(world), "--ops", "send_recv", "--sizes", "4K",
                "--reps", "3"]

    cmd = [sys.executable, str(ROOT / "benchmarks" / "collectives.py"), *args(2)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["backend"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {"threads", "gloo"}
    for row in rows.values():
        assert row["op"] == "send_recv" and row["bytes"] == row["ledger_sent_bytes"] == 4096
        assert row["median_s"] > 0
    assert rows["threads"]["torch_median_s"] is None and rows["gloo"]["ratio_to_torch"] > 0
    # An odd world is refused as the arguments are read (exit status 2), in this process: no interpreter
    # to start for it.
    bench = benchmark_script("collectives")
    with pytest.raises(SystemExit) as refused:
        bench.main(args(3))
    assert refused.value.code == 2 and "odd" in capsys.readouterr().err


@pytest.mark.gloo  # two gloo processes
def test_pipeline_benchmark_runs_and_checks_itself() -> None:
    """benchmarks/pipeline.py: ours, ours reporting no metrics and torch's 1F1B on a narrow MLP, glibc returning
    freed memory at once (``--malloc live``): each step's peak memory per rank."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--models", "mlp", "--worlds", "2",
           "--schedules", "1f1b", "--steps", "2", "--warmup", "1", "--mlp-hidden", "16", "--malloc", "live"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["impl"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {"ours", "ours_quiet", "torch"}
    assert {row["malloc"] for row in rows.values()} == {"live"}
    # Per rank: this narrow MLP's step (16 x 16 weights) holds kilobytes, mostly from heap pages resident already
    # (0.0-0.02 MiB measured): a figure for each rank, none negative, none near a MiB.
    assert all(len(row["step_peak_mib"]) == 2 and all(0 <= p < 1 for p in row["step_peak_mib"])
               for row in rows.values()), rows
    # The same model, batches and update: ours' loss is torch's to float32 rounding.
    assert rows["ours"]["max_rel_loss_diff"] < 1e-5 and rows["torch"]["max_rel_loss_diff"] < 1e-5
    # The quiet step reports no loss; its parameters ended bitwise equal to ours on both ranks.
    assert "first_loss" not in rows["ours_quiet"] and rows["ours_quiet"]["params_equal_to_ours"] is True
    assert all(row["median_step_s"] > 0 and row["paired_ratio_to_torch"] > 0 for row in rows.values())
    # Both libraries' computes were timed (the benchmark checks it timed each op of the schedule once).
    for row in rows.values():
        assert set(row["mean_op_ms"]) == {"F", "B"} and row["handover_ms"] is not None, row


def test_tensor_parallel_example_is_equivalent_and_learns(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/tensor_parallel.py: an HF Llama on dp=2 x pp=2 x tp=2 (8 thread ranks), checked in
    float64 against the single-device step, then trained in float32."""
    pytest.importorskip(
        "transformers", reason="examples/tensor_parallel.py needs the [hf] extra: pip install -e '.[hf]'"
    )
    losses = _load("tensor_parallel").main(["--check-steps", "2", "--steps", "12"])
    out = capsys.readouterr().out
    assert "-> pipeline(axis='pp', schedule='1f1b', microbatches=2) -> shard_params(axis='dp', stage=3" in out
    assert re.search(r"^tp bytes sent by rank 0 per step: \{'all_gather': \d+, 'psum': \d+, 'psum_scatter': \d+\}",
                     out, re.MULTILINE), out
    assert re.search(r"^equivalent over 2 steps", out, re.MULTILINE), out
    assert len(re.findall(r"^step +\d+  loss ", out, re.MULTILINE)) == 12  # rank 0 alone prints
    assert len(losses) == 12 and sum(losses[-4:]) < 0.8 * sum(losses[:4])  # measured: 4.18 -> 2.43


@pytest.mark.gloo  # one pool of two gloo processes for every variant
def test_the_llama_memory_benchmark_reports_fsdp2_and_zero3_side_by_side() -> None:
    """benchmarks/memory_llama.py on a tiny Llama: FSDP2 and ZeRO-3 rows with peaks, the ratio and the Plan's.
    The variants share one pool (``--pools world``): a fresh one per variant (a forkserver importing torch,
    ranks importing transformers) took the run from 37 s to 90 s on a loaded machine, and what is asserted
    here is what each row says, not how its figures compare with a clean process's."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_llama.py"), "--hidden", "64", "--intermediate", "128",
           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "256", "--seq", "16", "--worlds", "2",
           "--steps", "1", "--batch", "4", "--pools", "world", "--variants",
           "fsdp2,shardwise,export_fsdp2,export_save_pretrained"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["variant"]: row for row in map(json.loads, result.stdout.splitlines())}
    exports = {"export_fsdp2", "export_save_pretrained"}  # (full_state_dict's rows run the same code)
    assert set(rows) == {"fsdp2", "shardwise"} | exports and not [r for r in rows.values() if "failed" in r], rows
    assert {row["pools"] for row in rows.values()} == {"world"}
    for name in exports:  # each export's peak per rank, beside FSDP2's
        row = rows[name]
        assert len(row["export_peak_bytes_per_rank"]) == 2 and row["export_peak_bytes"] > 0, row
        assert name == "export_fsdp2" or row["export_ratio_to_fsdp2"] > 0, row
    assert rows["fsdp2"]["ratio_to_fsdp2"] == 1.0
    ours = rows["shardwise"]
    assert ours["peak_bytes"] >= ours["init_peak_bytes"] > 0
    assert ours["ratio_to_fsdp2"] == round(ours["peak_bytes"] / rows["fsdp2"]["peak_bytes"], 3)
    assert ours["plan_peak_bytes"] == ours["plan"]["peak"] > ours["plan"]["params"] > 0


def _peak_of_its_parts(plan: dict[str, int]) -> None:
    """The parameter shards and the moments, and the most that the gradient shards made so far, the buffers,
    and what the forward and the loss keep hold together at one action: at least the state at rest with either
    the buffers' peak or the activations', at most with every part's own peak (each comes at its own action)."""
    rest = plan["params"] + plan["opt_state"]
    assert rest + max(plan["held_in_step"], plan["kept_for_backward"]) <= plan["peak"], plan
    assert plan["peak"] <= rest + plan["held_in_step"] + plan["kept_for_backward"] + plan.get("loss_buffers", 0), plan


@pytest.mark.gloo  # a pool of one process (one_process: a fresh pool) and one of two gloo processes
def test_memory_benchmark_runs_and_reports_each_variant() -> None:
    """benchmarks/memory.py on a small model: one line per variant with peaks and the Plan's figures.
    The world-2 variants share one pool (``--pools world``): each start of a pool costs seconds."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--widths", "256", "--layers", "4",
           "--worlds", "2", "--steps", "1", "--batch", "8", "--pools", "world"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["variant"]: row for row in map(json.loads, result.stdout.splitlines())}
    ours_and_torch = {"one_process", "fsdp2_meta", "shardwise_meta", "shardwise_meta_functional", "shardwise_eager",
                      "ddp", "shardwise_zero1", "shardwise_zero2", "shardwise_zero1_meta", "shardwise_zero2_meta",
                      "fsdp2_meta_bf16", "shardwise_meta_bf16", "shardwise_zero1_meta_bf16",
                      "shardwise_zero2_meta_bf16", "shardwise_meta_kept", "shardwise_meta_bf16_kept"}
    seed_systems = {"fairscale_fsdp", "deepspeed_zero3", "deepspeed_zero3_init", "fairscale_oss",
                    "deepspeed_zero2", "deepspeed_zero2_bf16"}  # measured where installed
    assert set(rows) == ours_and_torch | seed_systems, sorted(rows)
    assert not [row for row in rows.values() if "failed" in row], rows
    assert {row["pools"] for row in rows.values()} == {"world"}
    for name, row in rows.items():
        if "skipped" in row:  # only a seed system may be missing, and it says how to install it
            assert name in seed_systems and "pip install" in row["skipped"], row
            continue
        assert row["peak_bytes"] >= row["init_peak_bytes"] >= 0, row
        if name.startswith("shardwise"):  # the steps' own peak too, from the same baseline
            assert row["peak_bytes"] == max(row["init_peak_bytes"], row["step_peak_bytes"]), row
    assert rows["fsdp2_meta"]["ratio_to_fsdp2"] == 1.0
    # The bf16 rows against each other: FSDP2's bf16 row is their reference, and the Plan's bf16
    # figures count each unit's compute copy only while its gather is in flight (two in flight at most).
    assert rows["fsdp2_meta_bf16"]["ratio_to_fsdp2"] == 1.0
    bf16 = rows["shardwise_meta_bf16"]
    assert bf16["ratio_to_fsdp2"] == round(bf16["peak_bytes"] / rows["fsdp2_meta_bf16"]["peak_bytes"], 3)
    assert 0 < bf16["plan"]["compute_copies"] <= 2 * bf16["plan"]["params"] / 4 / 2, bf16["plan"]
    assert rows["ddp"]["ratio_to_ddp"] == 1.0 and "ratio_to_ddp" in rows["shardwise_zero2"]
    if "peak_bytes" in rows["deepspeed_zero2_bf16"]:  # the bf16 ZeRO-1/2 rows beside DeepSpeed's
        deepspeed = rows["deepspeed_zero2_bf16"]["peak_bytes"]
        assert rows["deepspeed_zero2_bf16"]["ratio_to_deepspeed_zero2_bf16"] == 1.0
        for name in ("shardwise_zero1_meta_bf16", "shardwise_zero2_meta_bf16", "shardwise_meta_bf16_kept"):
            assert rows[name]["ratio_to_deepspeed_zero2_bf16"] == round(rows[name]["peak_bytes"] / deepspeed, 3)
    # Kept from forward to backward: every unit gathered at once (in bf16, half the bytes), the
    # Plan its own.
    kept, kept_bf16 = rows["shardwise_meta_kept"]["plan"], rows["shardwise_meta_bf16_kept"]["plan"]
    for stage in (1, 2):  # ZeRO-1/2 in bf16: float32 shards at rest, every unit gathered in bf16 through the step
        own = rows[f"shardwise_zero{stage}_meta_bf16"]["plan"]
        assert own["params"] == kept_bf16["params"] < rows[f"shardwise_zero{stage}_meta"]["plan"]["params"]
        assert own["gathered_peak"] == kept_bf16["gathered_peak"]
    assert kept["gathered_peak"] > rows["shardwise_meta"]["plan"]["gathered_peak"]
    assert kept["gathered_peak"] == 2 * kept_bf16["gathered_peak"]
    assert rows["shardwise_meta_kept"]["plan_peak_bytes"] == kept["peak"]
    for name in [f"shardwise_zero{s}{m}" for s in (1, 2) for m in ("", "_meta")]:
        # Each ZeRO-1/2 row carries its own stage's Plan (however the model was built), whose peak
        # counts the same parts.
        row = rows[name]
        own = row["plan"]
        assert own == rows[name.removesuffix("_meta")]["plan"]
        assert row["plan_peak_bytes"] == own["peak"] != rows["shardwise_eager"]["plan"]["peak"]
        _peak_of_its_parts(own)
    plan = rows["shardwise_meta"]["plan"]
    _peak_of_its_parts(plan)
    assert max(plan["gathered_peak"], plan["reduce_buffers"]) <= plan["held_in_step"], plan
    buffers = plan["gathered_peak"] + plan["reduce_buffers"] + plan["comm_buffers"] + plan["update_buffers"]
    assert plan["held_in_step"] <= plan["grads"] + buffers, plan
    # The functional AdamW's update makes new parameters and moments beside the old ones.
    functional = rows["shardwise_meta_functional"]["plan"]
    assert functional["update_buffers"] >= 3 * functional["params"], functional
    assert functional["update_buffers"] > plan["update_buffers"], (functional, plan)


@pytest.mark.gloo  # one pool of two gloo processes, for both systems
def test_memory_trace_reports_each_ranks_peak_and_where() -> None:
    """benchmarks/memory_trace.py on a small model: a line per rank and system, its peak and the segment
    (an executor action of shardwise's, a module hook of FSDP2's) it came in."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_trace.py"), "--width", "64", "--layers", "3",
           "--worlds", "2", "--batch", "4", "--timeline", "--pools", "world"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted((r["variant"], r["rank"]) for r in rows) == [("fsdp2_meta", 0), ("fsdp2_meta", 1),
                                                                ("shardwise_meta", 0), ("shardwise_meta", 1)]
    assert {row["pools"] for row in rows} == {"world"}
    for row in rows:
        labels = [label for label, _, _ in row["timeline"]]
        assert row["at"] in labels and row["peak_mib"] == max(peak for _, peak, _ in row["timeline"]), row
        assert labels[-1] == ("step end" if row["variant"] == "shardwise_meta" else "update"), labels
    shardwise_labels = [label for label, _, _ in rows[-1]["timeline"]]
    assert "reduce_scatter(0)" in shardwise_labels and "wait_gather(0)" in shardwise_labels, shardwise_labels


def _help_entries(text: str) -> dict[str, str]:
    """Each option of an argparse --help, with its help text (which may run over several lines)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"  (-[\w-]+(?:, -[\w-]+)?)(?: [A-Z_]+)?(?:\s+(.*))?$", line)
        if match:
            current = match[1]
            entries[current] = match[2] or ""
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "examples").glob("*.py")
                                        if "argparse" in p.read_text()))
def test_an_examples_help_says_every_default(name: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [f"examples/{name}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        _load(name).main()
    assert exit_.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    assert len(entries) > 2, entries
    missing = [flag for flag, text in entries.items() if flag != "-h, --help" and "(default: " not in text]
    assert not missing, f"examples/{name}.py --help gives no default for {missing}"


def test_the_help_reader_sees_an_option_without_a_default() -> None:
    text = (
        "options:\n  -h, --help  show this\n  --steps STEPS  training steps (default:\n                 3)\n  --lr LR\n"
    )
    assert _help_entries(text) == {"-h, --help": "show this", "--steps": "training steps (default: 3)", "--lr": ""}


def test_before_after_benchmark_compares_two_trees() -> None:
    """benchmarks/before_after.py (issue 26's before/after): a tree against itself, one config, one step."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "before_after.py"), "--trees", str(ROOT), str(ROOT),
         "--rounds", "1", "--steps", "1", "--configs", "mlp1"],
        capture_output=True, text=True, timeout=240, check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["tree"] for line in lines[:2]] == [str(ROOT), str(ROOT)]
    assert all(line["cpu"] > 0 and line["wall"] >= line["cpu"] * 0.99 for line in lines[:2])
    assert lines[2]["cfg"] == "mlp1" and lines[2]["cpu_ratio_new_over_old_median"] > 0


@pytest.mark.gloo  # one pool of two gloo processes for every variant
def test_the_encoder_decoder_memory_benchmark_reports_fsdp2_and_both_zero3_splits() -> None:
    """benchmarks/memory_encdec.py on a tiny BART: one line per variant, each with its step peak per rank; the
    split per layer in both stacks has 7 layers (embed, 2 encoder layers, the bridge, 2 decoder layers, head),
    and the ratios are to FSDP2's peak in the same run. One pool for the three variants (``--pools world``,
    as the Llama's above: 44 s against 99 s with a pool per variant, loaded)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_encdec.py"), "--worlds", "2", "--d-model", "64",
           "--layers", "2", "--steps", "1", "--pools", "world"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["variant"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert set(rows) == {"fsdp2", "shardwise_whole", "shardwise_split"}, sorted(rows)
    assert {row["pools"] for row in rows.values()} == {"world"}
    assert rows["shardwise_whole"]["layers"] == 1 and rows["shardwise_split"]["layers"] == 7
    for name in ("shardwise_whole", "shardwise_split"):
        row = rows[name]
        per_rank = row["step_peak_bytes_per_rank"]
        assert len(per_rank) == 2 and row["step_peak_bytes"] == max(per_rank), row
        assert row["ratio_to_fsdp2"] == round(row["step_peak_bytes"] / rows["fsdp2"]["step_peak_bytes"], 3), row
