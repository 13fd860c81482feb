"""Scaffolding shared by the benchmark scripts in this folder (not a benchmark itself).

The scripts are run as ``python benchmarks/NAME.py``, so this folder is on
``sys.path`` and they import it as ``from _common import ...``; the spawned
gloo ranks inherit that ``sys.path`` and import it the same way.

What is here:

* command-line flags every script spells the same (``--steps``, ``--warmup``,
  ``--worlds``, ``--models``, ``--mlp-batch``, ``--gpt-batch``, ``--out``,
  ``--malloc``);
* :func:`environment`: the machine / version keys written into every JSON line;
* :func:`json_lines`: one JSON object per line on stdout and, optionally, in a file;
* :func:`sweep`: the training benchmarks' loop over worlds (one gloo
  :class:`ProcessPool` each) and models, and :func:`run_on_ranks`;
* timing inside a rank: :func:`timed` (barrier, then wall time of one call),
  :func:`round_robin` (every variant's step ``i`` before any step ``i + 1``)
  and :func:`profile_steps` (a cProfile of a few more steps);
* aggregating over ranks: :func:`slowest_per_step`, :func:`median_of_max`,
  :func:`max_rel_diff`;
* the two training benchmarks' models (``mlp``, ``gpt``), batches, losses and
  their single-process ``torch.optim.AdamW`` reference run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.memory import LIVE_MALLOC, status_bytes
from shardwise.testing.models import TinyGPT

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]

# -- command line ------------------------------------------------------------------------


def add_run_flags(parser: argparse.ArgumentParser, *, steps: int, warmup: int) -> None:
    """``--steps``, ``--warmup`` (with these defaults), ``--worlds`` and ``--models``."""
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per variant (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps first, >= 1 (default {warmup})")
    add_worlds_flag(parser)
    parser.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt (default both)")


def add_worlds_flag(parser: argparse.ArgumentParser) -> None:
    """``--worlds``: comma-separated world sizes, default ``2,4``."""
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")


def add_batch_flags(parser: argparse.ArgumentParser) -> None:
    """``--mlp-batch`` and ``--gpt-batch``: the global batch of each model."""
    parser.add_argument("--mlp-batch", type=int, default=64, help="global MLP batch (default 64)")
    parser.add_argument("--gpt-batch", type=int, default=8, help="global GPT batch in sequences (default 8)")


def add_out_flag(parser: argparse.ArgumentParser) -> None:
    """``--out FILE``: also write the JSON lines there (see :func:`json_lines`)."""
    parser.add_argument("--out", help="also write the JSON lines to this file")


# glibc's malloc moves its mmap and trim thresholds with what a process has allocated and
# freed so far. A step that frees megabytes at the top of the heap then has them handed
# back to the OS and faults them in again on the next step (about 1 ms per thousand pages
# here), and whether that hits one library's step or the other's depends on the order
# their buffers happen to lie in the heap, which running them round-robin in one process
# mixes. "steady" fixes both thresholds high for the rank processes (glibc's documented
# environment tunables), so neither library's step pays for the heap's history.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
# "live" fixes both low (the memory tests' and benchmarks/memory.py's LIVE_MALLOC): a freed block goes back at
# once, so RSS follows live memory and a step's peak above its starting RSS is what it holds at its most (a
# benchmark's ``step_peak_mib``); every step pays the page faults of what it allocates.
MALLOC_ENVS = {"steady": STEADY_MALLOC, "live": LIVE_MALLOC}
MALLOC_MODES = ("default", *MALLOC_ENVS)


def add_malloc_flag(parser: argparse.ArgumentParser) -> None:
    """``--malloc default|steady|live``: glibc's malloc as it comes, or with fixed thresholds (:data:`MALLOC_ENVS`)."""
    parser.add_argument("--malloc", choices=MALLOC_MODES, default="default",
                        help="glibc malloc in the rank processes: 'default' (as it comes), 'steady' (mmap "
                             "and trim thresholds fixed at 256 MB: no step pays page faults for memory an "
                             "earlier step gave back to the OS) or 'live' (both at 128 KiB: freed memory goes "
                             "back at once, so RSS follows live memory; where a benchmark reports a step's peak "
                             "memory)")


@contextlib.contextmanager
def malloc_mode(mode: str) -> Iterator[None]:
    """Rank processes started inside get ``mode``'s malloc environment (glibc reads it at start)."""
    keys = {key for env in MALLOC_ENVS.values() for key in env}
    saved = {key: os.environ.pop(key, None) for key in keys}
    os.environ.update(MALLOC_ENVS.get(mode, {}))
    try:
        yield
    finally:
        for key in keys:
            os.environ.pop(key, None)
        os.environ.update({key: old for key, old in saved.items() if old is not None})


def malloc_now() -> str:
    """The mode whose environment is set for the ranks started now (see :func:`malloc_mode`)."""
    return next((mode for mode, env in MALLOC_ENVS.items() if all(os.environ.get(k) == v for k, v in env.items())),
                "default")


# -- output --------------------------------------------------------------------------------
ENV_KEYS = ("cores", "loadavg_1m", "threads_per_rank", "malloc", "torch", "shardwise")


def environment(threads_per_rank: int | None = None, keys: Iterable[str] = ENV_KEYS) -> dict[str, Any]:
    """Where a JSON line was measured, read when it is written, in this order:

    ``cores`` (``os.cpu_count()``), ``loadavg_1m`` (the machine's 1-minute load
    average: well above ``cores`` means something else was running),
    ``threads_per_rank`` (only when given), ``malloc`` (``steady`` or ``live`` when
    that mode's :data:`MALLOC_ENVS` is set for the ranks, else ``default``), ``torch`` and
    ``shardwise`` (versions).
    ``keys`` keeps only those of them.
    """
    values: dict[str, Any] = {
        "cores": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "malloc": malloc_now(),
        "torch": torch.__version__,
        "shardwise": sw.__version__,
    }
    if threads_per_rank is not None:
        values["threads_per_rank"] = threads_per_rank
    return {key: values[key] for key in keys if key in values}


def emit(row: Mapping[str, Any], out: IO[str] | None = None) -> None:
    """Print ``row`` as one JSON line on stdout (flushed) and, if given, write it to ``out``."""
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


@contextlib.contextmanager
def json_lines(path: str | None) -> Iterator[Callable[[Mapping[str, Any]], None]]:
    """Open ``path`` (if not None) for the whole run; yield an ``emit(row)`` that writes to both."""
    out = open(path, "w") if path else None  # noqa: SIM115 (written line by line, closed below)
    try:
        yield lambda row: emit(row, out)
    finally:
        if out is not None:
            out.close()


def note(text: str) -> None:
    """A progress note on stderr (stdout carries only the JSON lines)."""
    print(text, file=sys.stderr, flush=True)


# -- running on gloo ranks ---------------------------------------------------------------------
POOL_TIMEOUT_S = 600.0


def sweep(
    args: argparse.Namespace, measure: Callable[[ProcessPool, int, str, int], Iterable[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Every (world, model) of ``args.worlds`` x ``args.models``: emit and return the rows of each.

    Each world gets one :class:`ProcessPool` (gloo, one process per rank) for
    all its models. ``measure(pool, world, model, batch)`` returns the rows of
    one (world, model); ``batch`` is ``args.mlp_batch`` or ``args.gpt_batch``.
    Rows go out as soon as they are made (:func:`json_lines`, to ``args.out`` too).
    The ranks run with ``args.malloc`` (:func:`malloc_mode`).
    """
    worlds = [int(w) for w in args.worlds.split(",")]
    models = args.models.split(",")
    rows: list[dict[str, Any]] = []
    with json_lines(args.out) as emit, malloc_mode(args.malloc):
        for world in worlds:
            with ProcessPool(world, timeout=POOL_TIMEOUT_S) as pool:
                for model in models:
                    batch = args.mlp_batch if model == "mlp" else args.gpt_batch
                    for row in measure(pool, world, model, batch):
                        emit(row)
                        rows.append(row)
    return rows


def run_on_ranks(pool: ProcessPool, fn: Callable[..., T], *args: Any, label: str) -> list[T]:
    """``pool.run(fn, *args)`` (every rank's result), noting its wall time on stderr after ``label``."""
    started = time.perf_counter()
    per_rank = pool.run(fn, *args)
    note(f"# {label}: {time.perf_counter() - started:.1f} s on the ranks")
    return per_rank


# -- timing inside a rank ----------------------------------------------------------------------
def reset_peak_rss() -> int:
    """Reset this process's high-water mark (VmHWM) to its resident size now, and return that size (bytes):
    ``status_bytes("VmHWM")`` minus it is then the most held above it since (no collection first, as
    ``shardwise.testing.memory.PeakRSS`` makes: this runs inside timed steps)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def minor_faults() -> int:
    """Minor page faults of this process so far (``getrusage``; a spawned child counts its own)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn: Callable[..., T], *args: Any, barrier: Callable[[], Any] = dist.barrier) -> tuple[T, float]:
    """Meet the other ranks at ``barrier``, then call ``fn(*args)``: its result and wall seconds.

    The time runs from leaving the barrier to holding the result.
    """
    barrier()
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def round_robin(
    names: Iterable[str], batches: Sequence[Any], warmup: int, step: Callable[[str, int, Any], T], *,
    block: int = 1, finish: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[T]]]:
    """Step every variant on every batch, interleaved: step ``i`` of each, then step ``i + 1`` ...

    ``step(name, i, batch)`` runs one step of variant ``name``; each call is
    :func:`timed` after a ``dist.barrier()``, so the variants share the same
    machine conditions. The order within a round rotates by one every step, so
    no variant always runs right after the same other one (what the previous
    step left in the caches and the allocator's free lists differs by variant).
    Returns, per name, the wall times of the steps after the first ``warmup``
    and the results of every step.

    ``block`` > 1: each turn runs ``block`` consecutive steps of one variant, timed together
    after one barrier, then ``finish(name)`` inside the timing (a step that leaves work in flight
    for the next, as ZeRO-1/2's overlapped all-gather, then pays for it within its own variant's
    time: stepped one at a time between other variants and barriers, that work would run during
    theirs). A block is one timed entry, its mean step time; a block with a warm-up step is untimed.
    """
    names = list(names)
    times: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, list[T]] = {name: [] for name in names}
    if block > 1 or finish is not None:
        for turn, start in enumerate(range(0, len(batches), block)):
            chunk = range(start, min(start + block, len(batches)))
            shift = turn % len(names) if names else 0
            for name in names[shift:] + names[:shift]:

                def run(name: str = name, chunk: range = chunk) -> list[T]:
                    out = [step(name, i, batches[i]) for i in chunk]
                    if finish is not None:
                        finish(name)
                    return out

                out, elapsed = timed(run)
                results[name] += out
                if chunk.start >= warmup:
                    times[name].append(elapsed / len(chunk))
        return times, results
    for i, batch in enumerate(batches):
        shift = i % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            result, elapsed = timed(step, name, i, batch)
            results[name].append(result)
            if i >= warmup:
                times[name].append(elapsed)
    return times, results


def profile_steps(
    step: Callable[[Any], Any],
    batches: Sequence[Any],
    steps: int,
    report: bool,
    sections: Sequence[tuple[str, tuple[Any, ...]]],
) -> str:
    """cProfile ``steps`` more calls of ``step(batch)``; every rank steps, only a ``report`` rank profiles.

    ``sections``: ``(sort key, print_stats restrictions)`` pairs, e.g.
    ``[("tottime", (25,)), ("cumulative", ("shardwise", 30))]``. Returns the
    report (a header with the wall time per step, then the sections), or ``""``
    on a rank that does not report.
    """
    profiler = cProfile.Profile()
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        if report:
            profiler.enable()
        step(batches[i % len(batches)])
        if report:
            profiler.disable()
    wall = time.perf_counter() - start
    if not report:
        return ""
    out = io.StringIO()
    out.write(f"{steps} profiled steps, {wall / steps * 1e3:.1f} ms/step wall (with profiler)\n")
    stats = pstats.Stats(profiler, stream=out)
    for sort_key, restrictions in sections:
        stats.sort_stats(sort_key).print_stats(*restrictions)
    return out.getvalue()


# -- aggregating over ranks -----------------------------------------------------------------
def slowest_per_step(per_rank: Iterable[Sequence[float]]) -> list[float]:
    """Per step, the largest time over ranks (``per_rank``: one list of step times per rank)."""
    return [max(step) for step in zip(*per_rank, strict=True)]


def median_of_max(per_rank: Iterable[Sequence[float]]) -> float:
    """The median over steps of the slowest rank's time (see :func:`slowest_per_step`)."""
    return statistics.median(slowest_per_step(per_rank))


def paired_ratio_median(per_rank: Sequence[Sequence[float]], ref_per_rank: Sequence[Sequence[float]]) -> float:
    """The median over steps of (slowest rank's time / the reference's slowest rank's time in the
    same round): steps of a round run back to back, so load that drifts over the run cancels."""
    return statistics.median(
        a / b for a, b in zip(slowest_per_step(per_rank), slowest_per_step(ref_per_rank), strict=True)
    )


def rel_diff(value: float, ref: float) -> float:
    """``|value - ref| / |ref|`` to 3 significant digits."""
    return float(f"{abs(value - ref) / abs(ref):.3g}")


def max_rel_diff(values: Iterable[float], refs: Iterable[float]) -> float:
    """The largest ``|value - ref| / |ref|`` over pairs (equal lengths), to 3 significant digits."""
    return float(f"{max(abs(a - b) / abs(b) for a, b in zip(values, refs, strict=True)):.3g}")


# -- the training benchmarks' models, data and reference --------------------------------------
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
MLP_HIDDEN, MLP_LAYERS = 512, 8
GPT_SHAPE = {"vocab": 1024, "d_model": 256, "n_heads": 4, "n_layers": 4, "seq_len": 128}
GPT_UNITS = ["tok_emb", "blocks", "head"]


def seeded_model(model: str, seed: int, *, tie_weights: bool = True, mlp_hidden: int = MLP_HIDDEN) -> nn.Module:
    """``mlp`` (8 x (Linear(h, h), GELU), h = ``mlp_hidden``) or ``gpt`` (TinyGPT), seeded: identical
    in every process."""
    torch.manual_seed(seed)
    if model == "mlp":
        layers: list[nn.Module] = []
        for _ in range(MLP_LAYERS):
            layers += [nn.Linear(mlp_hidden, mlp_hidden), nn.GELU()]
        return nn.Sequential(*layers)
    if model == "gpt":
        return TinyGPT(**GPT_SHAPE, tie_weights=tie_weights)
    raise ValueError(f"unknown model {model!r}; choose mlp or gpt")


def make_batches(model: str, batch: int, count: int, seed: int, *, mlp_hidden: int = MLP_HIDDEN) -> list[Batch]:
    """``count`` global batches (inputs, targets) of ``batch`` rows, the same in every process."""
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(count):
        if model == "mlp":
            x = torch.randn(batch, mlp_hidden, generator=gen)
            batches.append((x, torch.randn(batch, mlp_hidden, generator=gen)))
        else:
            seq = GPT_SHAPE["seq_len"]
            tokens = torch.randint(GPT_SHAPE["vocab"], (batch, seq + 1), generator=gen)
            batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_fn_of(model: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """MSE for ``mlp``, :func:`lm_loss` for ``gpt``."""
    return F.mse_loss if model == "mlp" else lm_loss


def torch_adamw(parameters: Any) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with the benchmarks' hyper-parameters."""
    return torch.optim.AdamW(parameters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def sw_adamw() -> Any:
    """``sw.optim.adamw`` with the benchmarks' hyper-parameters, updating in place as torch's does
    (the benchmarks never reuse a state once it went into a step)."""
    return sw.optim.adamw(LR, BETAS, EPS, WEIGHT_DECAY, inplace=True)


def reference_losses(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batches: Iterable[Batch]) -> list[float]:
    """Single-process torch: ``model`` on each whole global batch with :func:`torch_adamw`; every loss."""
    opt = torch_adamw(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
