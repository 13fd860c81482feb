"""The single-device step against a plain torch loop of the same model, in one process.

Usage::

    python benchmarks/one_device.py                                # both models, both optimizers, 7 rounds
    python benchmarks/one_device.py --models mlp --optims sgd --rounds 9 --steps 20
    python benchmarks/one_device.py --models gpt --profile         # + a cProfile of shardwise's step
    python benchmarks/one_device.py --models mlp --paired 500      # + 500 steps alternated step by step
    python benchmarks/one_device.py --models mlp --mlp-hidden 8    # the fixed cost: layers of 8 features

``shardwise``: ``sw.train_step(chain, loss_fn, optimizer, clip_norm=1.0)`` on the functionalized
model, its state made by ``step.init(params)``, metrics ``loss`` and ``grad_norm`` (each read with
``.item()`` after the step, as a training loop that logs them would). ``torch``: the same model as
an ``nn.Module``, ``loss.backward()``, ``torch.nn.utils.clip_grad_norm_(..., foreach=True)`` and
``torch.optim.SGD`` (momentum 0.9) or ``torch.optim.AdamW`` with ``foreach=True``, the loss and the
norm ``clip_grad_norm_`` returns read with ``.item()``. Both update in place (``inplace=True`` for
shardwise). The models are the training benchmarks' (``_common.py``): ``mlp`` 8 x (Linear(512), GELU), batch 32; ``gpt``
TinyGPT 4 x 256, batch 8 sequences of 128.

Timing: one thread (``torch.set_num_threads(1)``); each round runs ``--steps`` steps of one system
then ``--steps`` of the other (the order alternates by round), after ``--warmup`` untimed steps of
each. Per round it records wall time (``perf_counter``) and CPU time of this thread
(``time.thread_time``) per step. The machine this was written on is shared (load well above its
cores), so wall time is inflated by waiting for a core; CPU time counts only the work done.
One JSON line per (model, optimizer): the medians over rounds of the per-step times, and the
median over rounds of the paired ratio shardwise / torch (both measured in the same round),
for CPU and wall time, the minor page faults per step (median over rounds), and the losses'
largest relative difference over the steps. A round's ratio moves by +-0.1 on a shared machine;
``--paired N`` adds ``N`` more steps of each system alternated step by step (which goes first
alternating too), each step's CPU time read on its own: ``paired_cpu_ratio`` is the median of
the N per-step ratios, which a neighbour's burst moves far less (each step of one system has its
twin of the other beside it). It is not the same quantity: a system stepping after the other
finds its caches cold, so per step both pay for the other's traffic.

glibc's malloc hands memory a step freed back to the OS and faults it in again on the next one,
depending on the heap's history (see ``STEADY_MALLOC`` in ``_common.py``): run with
``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=268435456`` in the environment to take
that out of both systems' times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    MLP_HIDDEN,
    add_out_flag,
    environment,
    json_lines,
    loss_fn_of,
    make_batches,
    max_rel_diff,
    minor_faults,
    note,
    seeded_model,
)

import shardwise as sw

CLIP = 1.0
SGD = {"lr": 1e-2, "momentum": 0.9}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
BATCH = {"mlp": 32, "gpt": 8}


def torch_loop(model_name: str, optim: str, mlp_hidden: int = MLP_HIDDEN) -> Callable[[Any], float]:
    """One step of the plain torch loop; returns the loss as a float."""
    model = seeded_model(model_name, 0, mlp_hidden=mlp_hidden)
    loss_fn = loss_fn_of(model_name)
    params = list(model.parameters())
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, foreach=True, **SGD) if optim == "sgd"  # type: ignore[arg-type]
        else torch.optim.AdamW(params, foreach=True, **ADAMW)  # type: ignore[arg-type]
    )

    def step(batch: Any) -> float:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True).item()
        opt.step()
        return loss.item()

    return step


def shardwise_step(model_name: str, optim: str, mlp_hidden: int = MLP_HIDDEN) -> Callable[[Any], float]:
    """One shardwise single-device step (clip_norm, loss and grad_norm reported); returns the loss."""
    chain, params = sw.functionalize(seeded_model(model_name, 0, mlp_hidden=mlp_hidden))
    optimizer = (
        sw.optim.sgd(SGD["lr"], momentum=SGD["momentum"], inplace=True) if optim == "sgd"
        else sw.optim.adamw(ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"], inplace=True)
    )
    train = sw.train_step(chain, loss_fn_of(model_name), optimizer, clip_norm=CLIP)
    box = [train.init(params)]

    def step(batch: Any) -> float:
        box[0], metrics = train(box[0], batch)
        metrics["grad_norm"].item()
        return metrics["loss"].item()

    return step


def timed_steps(step: Callable[[Any], float], batches: list[Any]) -> tuple[float, float, list[float], float]:
    """Run ``step`` on each batch: CPU and wall seconds per step, the losses, minor page faults per step."""
    losses = []
    faults, cpu, wall = minor_faults(), time.thread_time(), time.perf_counter()
    for batch in batches:
        losses.append(step(batch))
    n = len(batches)
    return (time.thread_time() - cpu) / n, (time.perf_counter() - wall) / n, losses, (minor_faults() - faults) / n


def paired_ratios(systems: dict[str, Callable[[Any], float]], batches: list[Any], steps: int) -> list[float]:
    """``steps`` steps of each system alternated step by step (the first of each pair alternating):
    each step's CPU time; the per-step ratios shardwise / torch."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for i in range(steps):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.thread_time()
            systems[name](batches[i % len(batches)])
            times[name].append(time.thread_time() - start)
    return [a / b for a, b in zip(times["shardwise"], times["torch"], strict=True)]


def measure(model: str, optim: str, args: argparse.Namespace) -> dict[str, Any]:
    hidden = args.mlp_hidden
    batches = make_batches(model, BATCH[model], args.warmup + args.rounds * args.steps, seed=0, mlp_hidden=hidden)
    systems = {"torch": torch_loop(model, optim, hidden), "shardwise": shardwise_step(model, optim, hidden)}
    losses: dict[str, list[float]] = {name: [] for name in systems}
    for name, step in systems.items():
        losses[name] += timed_steps(step, batches[: args.warmup])[2]
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    wall: dict[str, list[float]] = {name: [] for name in systems}
    faults: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * args.steps: args.warmup + (r + 1) * args.steps]
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for name in order:
            c, w, lo, f = timed_steps(systems[name], chunk)
            faults[name].append(f)
            cpu[name].append(c)
            wall[name].append(w)
            losses[name] += lo
    med = statistics.median
    row = {
        "model": model, "optim": optim, "batch": BATCH[model], "rounds": args.rounds, "steps": args.steps,
        **({"mlp_hidden": hidden} if model == "mlp" else {}),
        "cpu_ms_torch": round(med(cpu["torch"]) * 1e3, 3), "cpu_ms_shardwise": round(med(cpu["shardwise"]) * 1e3, 3),
        "cpu_ratio": round(med(a / b for a, b in zip(cpu["shardwise"], cpu["torch"], strict=True)), 4),
        "wall_ms_torch": round(med(wall["torch"]) * 1e3, 3),
        "wall_ms_shardwise": round(med(wall["shardwise"]) * 1e3, 3),
        "wall_ratio": round(med(a / b for a, b in zip(wall["shardwise"], wall["torch"], strict=True)), 4),
        "cpu_ratios": [round(a / b, 4) for a, b in zip(cpu["shardwise"], cpu["torch"], strict=True)],
        "faults_per_step_torch": med(faults["torch"]),
        "faults_per_step_shardwise": med(faults["shardwise"]),
        "max_rel_loss_diff": max_rel_diff(losses["shardwise"], losses["torch"]),
        **environment(threads_per_rank=1),
    }
    if args.paired:
        ratios = paired_ratios(systems, batches, args.paired)
        row["paired_steps"] = args.paired
        row["paired_cpu_ratio"] = round(med(ratios), 4)
    if args.profile:
        profile(systems["shardwise"], batches, args.steps)
    return row


def profile(step: Callable[[Any], float], batches: list[Any], steps: int) -> None:
    """A cProfile of ``steps`` more shardwise steps, on stderr."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        step(batches[i % len(batches)])
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    note(out.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt (default both)")
    parser.add_argument("--optims", default="sgd,adamw", help="comma-separated: sgd, adamw (default both)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="steps per system per round (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default 3)")
    parser.add_argument("--profile", action="store_true", help="cProfile shardwise's step after (stderr)")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="and N steps of each alternated step by step: paired_cpu_ratio (default 0: none)")
    parser.add_argument("--mlp-hidden", type=int, default=MLP_HIDDEN,
                        help=f"the MLP's width (default {MLP_HIDDEN}; 8: what a step costs besides its kernels)")
    add_out_flag(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with json_lines(args.out) as emit:
        for model in args.models.split(","):
            for optim in args.optims.split(","):
                emit(measure(model, optim, args))


if __name__ == "__main__":
    main()
