"""remat policies and bf16 compute on the small GPT: bytes kept for backward, step time, loss.

Run it from the repository root:

    python benchmarks/remat_precision.py                     # defaults: 2-3 minutes on 2 cores
    python benchmarks/remat_precision.py --steps 60 --warmup 5 --out remat.jsonl
    python benchmarks/remat_precision.py --profile f32:nothing_saveable   # + torch.profiler op table (stderr)
    python benchmarks/remat_precision.py --no-rss --no-micro              # only the interleaved timings

What is measured
----------------
Model: ``TinyGPT(vocab=1024, d_model=256, n_heads=4, n_layers=4, seq_len=128)``
with cross-entropy, functionalized with ``units=["tok_emb", "blocks", "head"]``
(six layers: ``tok_emb``, ``blocks.0..3``, ``head``; the head is tied to the
token embedding), ``sw.optim.adamw`` (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight decay 0.01), the same initial weights and the same batches (``--batch``
sequences of 128 tokens) for every variant. One process, ``torch.set_num_threads(1)``.

Variants (``variant`` is ``<compute dtype>:<remat policy>``):

* ``f32:none``: ``sw.train_step(...)`` as it is: the baseline.
* ``f32:nothing_saveable`` (full remat), ``f32:dots_saveable``,
  ``f32:everything_saveable``: ``sw.remat(step, policy)`` on every layer.
* ``bf16:none``, ``bf16:nothing_saveable``: the same, then
  ``sw.mixed_precision(step, "compute=bf16")`` (fp32 master weights and
  optimizer state, bf16 layer compute, fp32 output; no loss scaling). remat is
  applied first, as in DESIGN.md (``remat`` then ``mixed_precision``).

All variants are built in the same process and stepped round-robin (step i of
every variant, then step i + 1 ...), so machine load and slow drift hit them
alike.

How to read the output
----------------------
One JSON object per variant on stdout (and in ``--out``), then one
``"variant": "target:full_remat"`` line, then (unless ``--no-micro``) one
``"variant": "micro:matmul"`` line per matmul shape:

* ``saved_bytes``: ``sw.policies.saved_bytes(step, params, batch)`` summed over
  layers: bytes of activations each layer keeps for its backward, measured on
  the first batch (each distinct storage once; parameters, buffers and the
  layer's output not counted; see its docstring). ``saved_bytes_per_layer``
  is the per-layer dict, ``saved_ratio_to_none`` is ``f32:none``'s total
  divided by this one's (> 1: keeps less). For bf16 variants the layers get
  the bf16 compute copies, as in the step, so only activations count.
* ``median_step_s``: median wall time of one whole step (forward, backward,
  optimizer) over ``--steps`` timed steps after ``--warmup`` untimed ones.
  ``ratio_to_baseline`` is that median over ``f32:none``'s;
  ``paired_ratio_median`` is the median over rounds of (this step / the
  baseline's step in the same round), which is less sensitive to drift.
* ``final_loss``: the loss of the last step (``warmup + steps`` steps on the
  same batches); ``final_loss_rel_diff`` is ``|loss - f32 loss| / f32 loss``
  for that step, ``max_rel_loss_diff`` the largest over all steps, and
  ``losses_bitwise_equal_to_f32`` says whether every step's loss equals the
  baseline's bit for bit (remat promises this in the same dtype).
* ``peak_rss_bytes``, ``peak_rss_step_delta_bytes``,
  ``peak_rss_fwd_bwd_delta_bytes`` (unless ``--no-rss``): measured in a fresh
  process per variant (no other variant alive) that runs one warm-up step,
  then ``--rss-steps`` steps. Before each of those the high-water mark is
  reset (``echo 5 > /proc/self/clear_refs``) and ``VmRSS`` read; the step
  delta is ``VmHWM`` after the step minus that, the largest over the steps:
  the memory the step added at its peak (activations, gradients, the
  optimizer's new tensors, temporaries). The fwd/bwd delta is the same read
  just before the optimizer phase (``Step.finish``, wrapped in the child):
  the peak of forward + backward alone, which is where remat acts.
  ``peak_rss_bytes`` is the whole process (torch itself included). The
  children run with ``MALLOC_MMAP_THRESHOLD_=65536``, so glibc unmaps every
  freed tensor over 64 KiB instead of keeping it in its heap; RSS then
  follows the live tensors (the default dynamic threshold makes the deltas
  depend on the heap's history, by tens of MB). ``rss_hwm_reset`` is false
  where the kernel refused the reset; the deltas then include start-up peaks.
* ``target:full_remat``: the issue's targets for ``f32:nothing_saveable``
  against ``f32:none``: saved bytes cut >= 3x at <= 1.4x the step time.
* ``micro:matmul``: per Linear of the GPT (batch x 128 tokens), median time
  of the forward ``F.linear`` and of the two backward matmuls in float32 and
  bfloat16, one thread; ``bf16_over_f32_*`` < 1 means bf16 is faster on this
  CPU. ``cpu_capability`` is torch's kernel dispatch level.
* ``cores``: ``os.cpu_count()``; ``loadavg_1m``: the machine's load when the
  line was written. Load well above 1 (this benchmark's one thread) means
  something else was running; the ratios suffer less than the absolute times.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing.models import TinyGPT

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
GPT_SHAPE: dict[str, Any] = {"vocab": 1024, "d_model": 256, "n_heads": 4, "n_layers": 4, "seq_len": 128}
GPT_UNITS = ["tok_emb", "blocks", "head"]
BASELINE = "f32:none"
FULL_REMAT = "f32:nothing_saveable"
VARIANTS = (
    "f32:none",
    "f32:nothing_saveable",
    "f32:dots_saveable",
    "f32:everything_saveable",
    "bf16:none",
    "bf16:nothing_saveable",
)
TARGET_SAVED_RATIO, TARGET_TIME_RATIO = 3.0, 1.4


# -- model, data, variants ---------------------------------------------------------------------
def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(seed: int) -> tuple[sw.Step, Any]:
    """The baseline step and its seeded initial parameters."""
    torch.manual_seed(seed)
    chain, params = sw.functionalize(TinyGPT(**GPT_SHAPE), units=GPT_UNITS)
    # In place, as torch.optim works: the step peak then shows what remat saves, not optimizer temporaries.
    return sw.train_step(chain, lm_loss, sw.optim.adamw(LR, BETAS, EPS, WEIGHT_DECAY, inplace=True)), params


def make_variant(base: sw.Step, name: str) -> sw.Step:
    dtype, policy = name.split(":")
    step = base if policy == "none" else sw.remat(base, policy=getattr(sw.policies, policy))
    if dtype == "bf16":
        step = sw.mixed_precision(step, "compute=bf16")
    return step


def make_batches(n: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n):
        tokens = torch.randint(GPT_SHAPE["vocab"], (batch, GPT_SHAPE["seq_len"] + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


# -- peak RSS, in a fresh process per variant --------------------------------------------------
def proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_child(name: str, steps: int, batch: int, seed: int) -> dict[str, Any]:
    """Runs in a fresh process: build one variant, step it once, then measure ``steps`` steps.

    Before each measured step the high-water mark is reset and VmRSS read; the
    step's optimizer phase (``Step.finish``, called once per step after the
    backward) is wrapped to read VmHWM when forward + backward are done.
    """
    torch.set_num_threads(1)
    base, params = build(seed)
    step = make_variant(base, name)
    state = step.init(params)
    batches = make_batches(steps + 1, batch, seed)
    del base, params
    state, _ = step(state, batches[0])  # warm-up: one-time allocations, lazy inits
    marks: dict[str, int] = {}
    finish = type(step).finish

    def timed_finish(self: Any, *a: Any, **k: Any) -> Any:
        marks["fwd_bwd_hwm"] = proc_status_kb("VmHWM") * 1024
        return finish(self, *a, **k)

    setattr(type(step), "finish", timed_finish)  # noqa: B010 (this process only; it exits right after)
    reset, step_delta, fwd_bwd_delta, peak = True, 0, 0, 0
    for b in batches[1:]:
        reset = reset_hwm() and reset
        before = proc_status_kb("VmRSS") * 1024
        state, _ = step(state, b)
        hwm = proc_status_kb("VmHWM") * 1024
        peak, step_delta = max(peak, hwm), max(step_delta, hwm - before)
        fwd_bwd_delta = max(fwd_bwd_delta, marks["fwd_bwd_hwm"] - before)
    return {"rss_before_step_bytes": before, "peak_rss_bytes": peak, "peak_rss_step_delta_bytes": step_delta,
            "peak_rss_fwd_bwd_delta_bytes": fwd_bwd_delta, "rss_hwm_reset": reset}


def measure_rss(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", name, "--rss-steps", str(args.rss_steps),
           "--batch", str(args.batch), "--seed", str(args.seed)]
    # A fixed mmap threshold turns off glibc's dynamic one: every allocation over 64 KiB is its
    # own mapping, unmapped on free, so RSS follows the live tensors instead of the heap's slack.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        stderr = getattr(exc, "stderr", "") or ""
        return {"peak_rss_error": f"{type(exc).__name__}: {exc} {stderr[-300:]}".strip()}


# -- micro-measurement: fp32 vs bf16 matmul on this CPU ----------------------------------------
def micro_matmul(batch: int, repeats: int) -> list[dict[str, Any]]:
    """fp32 vs bf16 for the GPT's Linear layers: forward ``F.linear(x, w, b)`` (``aten.addmm``
    with a transposed weight, as ``nn.Linear``) and the two backward matmuls
    (``g @ w`` for the input, ``g.T @ x`` for the weight), in a round-robin over dtypes."""
    tokens, d, v = batch * GPT_SHAPE["seq_len"], GPT_SHAPE["d_model"], GPT_SHAPE["vocab"]
    shapes = {"qkv": (d, 3 * d), "attn_proj": (d, d), "mlp_up": (d, 4 * d), "mlp_down": (4 * d, d), "head": (d, v)}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, (k, n) in shapes.items():
        ops = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(tokens, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
            b, g = torch.randn(n, generator=gen).to(dtype), torch.randn(tokens, n, generator=gen).to(dtype)
            ops[dtype] = (lambda x=x, w=w, b=b: F.linear(x, w, b), lambda g=g, w=w: g @ w,
                          lambda g=g, x=x: g.t() @ x)
        times: dict[tuple[torch.dtype, int], list[float]] = {(dt, i): [] for dt in ops for i in range(3)}
        for r in range(repeats + 3):  # 3 untimed rounds first
            for dt, fns in ops.items():
                for i, fn in enumerate(fns):
                    start = time.perf_counter()
                    fn()
                    if r >= 3:
                        times[dt, i].append(time.perf_counter() - start)
        med = {key: statistics.median(ts) for key, ts in times.items()}
        f32 = [med[torch.float32, i] for i in range(3)]
        bf16 = [med[torch.bfloat16, i] for i in range(3)]
        flops = 2 * tokens * k * n
        rows.append({
            "shape": label, "tokens_in_out": [tokens, k, n],
            "f32_fwd_s": round(f32[0], 6), "bf16_fwd_s": round(bf16[0], 6),
            "f32_fwd_gflops": round(flops / f32[0] / 1e9, 1), "bf16_fwd_gflops": round(flops / bf16[0] / 1e9, 1),
            "bf16_over_f32_fwd": round(bf16[0] / f32[0], 3),
            "bf16_over_f32_bwd_input": round(bf16[1] / f32[1], 3),
            "bf16_over_f32_bwd_weight": round(bf16[2] / f32[2], 3),
            "bf16_over_f32_fwd_bwd": round(sum(bf16) / sum(f32), 3),
        })
    return rows


# -- profile -------------------------------------------------------------------------------------
def profile_variant(name: str, step: sw.Step, state: Any, batches: list, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            state, _ = step(state, batches[i % len(batches)])
        wall = time.perf_counter() - start
    out = io.StringIO()
    out.write(f"--- torch.profiler of {name}: {steps} steps, {wall / steps * 1e3:.1f} ms/step (with profiler) ---\n")
    out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return out.getvalue()


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, >= 1 (default 3)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (f32:none is always run)")
    parser.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak RSS measurement")
    parser.add_argument("--rss-steps", type=int, default=3, help="steps per fresh RSS process (default 3)")
    parser.add_argument("--no-micro", action="store_true", help="skip the fp32 vs bf16 matmul micro-measurement")
    parser.add_argument("--micro-repeats", type=int, default=30)
    parser.add_argument("--profile", choices=VARIANTS, help="torch.profiler op table of this variant (to stderr)")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--out", help="also write the JSON lines to this file")
    parser.add_argument("--rss-child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--steps and --warmup must be >= 1")
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.names = [n for n in VARIANTS if n in names or n == BASELINE]
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.rss_steps, args.batch, args.seed)))
        return []
    torch.set_num_threads(1)
    started = time.perf_counter()
    base, params = build(args.seed)
    steps = {name: make_variant(base, name) for name in args.names}
    batches = make_batches(args.warmup + args.steps, args.batch, args.seed)
    saved = {name: sw.policies.saved_bytes(step, params, batches[0]) for name, step in steps.items()}
    states = {name: step.init(params) for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for i, batch in enumerate(batches):
        for name, step in steps.items():
            start = time.perf_counter()
            states[name], metrics = step(states[name], batch)
            elapsed = time.perf_counter() - start
            losses[name].append(metrics["loss"].item())
            if i >= args.warmup:
                times[name].append(elapsed)
    print(f"# interleaved steps: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.profile:
        if args.profile not in steps:
            steps[args.profile] = make_variant(base, args.profile)
            states[args.profile] = steps[args.profile].init(params)
        print(profile_variant(args.profile, steps[args.profile], states[args.profile], batches, args.profile_steps),
              file=sys.stderr)
    rss = {}
    if not args.no_rss:
        states.clear()  # nothing of ours matters to the children, but keep the parent small anyway
        for name in args.names:
            rss[name] = measure_rss(name, args)
        print(f"# + peak RSS processes: {time.perf_counter() - started:.1f} s", file=sys.stderr)

    def common() -> dict[str, Any]:
        return {"bench": "remat_precision", "model": "gpt", "batch": args.batch, "steps": args.steps,
                "warmup": args.warmup, "threads": 1, "cores": os.cpu_count(),
                "loadavg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__, "shardwise": sw.__version__}

    rows: list[dict[str, Any]] = []
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    ref_saved, ref_time, ref_losses = sum(saved[BASELINE].values()), medians[BASELINE], losses[BASELINE]
    for name in steps:
        dtype, policy = name.split(":")
        total = sum(saved[name].values())
        ls = losses[name]
        rows.append({
            **common(),
            "variant": name,
            "policy": policy,
            "compute_dtype": {"f32": "float32", "bf16": "bfloat16"}[dtype],
            "saved_bytes": total,
            "saved_bytes_per_layer": saved[name],
            "saved_ratio_to_none": round(ref_saved / total, 3) if total else None,
            "median_step_s": round(medians[name], 5),
            "ratio_to_baseline": round(medians[name] / ref_time, 3),
            "paired_ratio_median": round(statistics.median(a / b for a, b in zip(times[name], times[BASELINE], strict=True)), 3),
            "final_loss": round(ls[-1], 6),
            "final_loss_rel_diff": float(f"{abs(ls[-1] - ref_losses[-1]) / abs(ref_losses[-1]):.3g}"),
            "max_rel_loss_diff": float(f"{max(abs(a - b) / abs(b) for a, b in zip(ls, ref_losses, strict=True)):.3g}"),
            "losses_bitwise_equal_to_f32": ls == ref_losses,
            **rss.get(name, {}),
        })
    if FULL_REMAT in steps:
        full = next(r for r in rows if r["variant"] == FULL_REMAT)
        rows.append({
            **common(),
            "variant": "target:full_remat",
            "saved_ratio_to_none": full["saved_ratio_to_none"],
            "target_saved_ratio_min": TARGET_SAVED_RATIO,
            "saved_target_met": (full["saved_ratio_to_none"] or 0) >= TARGET_SAVED_RATIO,
            "ratio_to_baseline": full["ratio_to_baseline"],
            "paired_ratio_median": full["paired_ratio_median"],
            "target_time_ratio_max": TARGET_TIME_RATIO,
            "time_target_met": full["ratio_to_baseline"] <= TARGET_TIME_RATIO,
        })
    if not args.no_micro:
        cap = torch.backends.cpu.get_cpu_capability()
        for m in micro_matmul(args.batch, args.micro_repeats):
            rows.append({**common(), "variant": "micro:matmul", "cpu_capability": cap, **m})
    with open(args.out, "w") if args.out else open(os.devnull, "w") as out:
        for row in rows:
            line = json.dumps(row)
            print(line, flush=True)
            out.write(line + "\n")
    print(f"# total: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
