"""Plan search against measurement: every layout the search finds feasible is also run, and the
predicted ranking is compared with the measured one.

World 4 on gloo processes, two models: TinyGPT (``shardwise.testing.models``, blocks as
units, the vocabulary-parallel loss, ``sw.tp.tiny_gpt_plan()``) and a tiny Hugging Face Llama
(decoder layers as units, ``sw.tp.llama_plan()``). For each:

1. ``sw.search`` prices every candidate: compute from single-device steps measured in this
   process (``MeasuredCompute``, one torch thread, as a rank has), communication from a short
   probe of the collectives on the same 4 gloo ranks (``CommModel.from_benchmark``). Two more
   probes say what a single-device measurement cannot see: what issuing a send or an async
   collective costs a rank while every rank computes (``issue_rank_main``: gloo's copy, the
   hand-off to its threads, the peer it wakes; ``CommModel.issue``, charged per call), and how
   many cores the ranks get together now (``probe_cores``: one rank's work alone against all
   of them at once; on a loaded machine fewer than it has). The issue probe's times are wall
   times with every rank busy, so the model keeps them times each rank's share of a core then
   (``cores / world``): the CPU time of a call, which the simulation stretches by the
   contention of each moment itself. Each ``--pricing`` is priced and
   compared against the one measurement: ``issue@measured`` (issue costs, the probed cores,
   rounded) and, beside it, without the issue costs (``plain``) or on the machine's count
   (``machine``: ``os.cpu_count()``) or a given one.
2. Every layout that fits is run on the 4 ranks, all of them interleaved (step ``i`` of every
   layout before step ``i + 1`` of any): ``--warmup`` steps, then ``--steps`` timed ones (a
   barrier before each; a step's time is its slowest rank's); measured = the median (and,
   compared separately, the fastest step: on a shared machine the least disturbed one).
3. A line with the probes' figures; per pricing and model, one JSON line per layout
   (predicted and measured seconds, predicted peak), then a summary line: Spearman's rank
   correlation of predicted against measured (ties get their average rank), and how far the
   search's first choice is from the measured best (``top_choice_vs_best``: its measured time
   over the best measured time; 1.0 is the best).

    python benchmarks/search.py [--models gpt,llama] [--steps 5] [--warmup 2] [--pricing ...] [--out FILE]
    python benchmarks/search.py --tiny --world 2 --models gpt --limit 2 --steps 1 --warmup 0   # a smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from _common import environment, json_lines, note, round_robin

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.plan_search import Candidate, MeasuredCompute, SearchResult, Space
from shardwise.testing.models import Block, TinyGPT

WORLD = 4
TIMEOUT_S = 300.0
PROBE_OPS = ("psum", "all_gather", "psum_scatter", "send_recv")
PROBE_SIZES = [1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20]
ISSUE_SIZES = [1 << 12, 1 << 16, 1 << 20]
ISSUE_WORK = 20  # busy() iterations around each issued call: about a millisecond, a small layer's action
CORES_WORK = 100  # busy() iterations per rank in the cores probe: a few milliseconds, several time slices


@dataclass(frozen=True)
class ModelConfig:
    """One model; travels to every rank, which builds it identically (seeded)."""

    name: str
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    seq: int = 32
    batch: int = 8
    seed: int = 0


def llama_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


@functools.lru_cache(maxsize=4)
def build(cfg: ModelConfig) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]], Any]:
    """(step, params, batches, tp_plan) of ``cfg``, the same in every process."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = [torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen) for _ in range(8)]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    optimizer = sw.optim.adamw(1e-3)
    if cfg.name == "gpt":
        model = TinyGPT(vocab=cfg.vocab, d_model=cfg.hidden, n_heads=cfg.heads, n_layers=cfg.layers, seq_len=cfg.seq)
        chain, params = sw.functionalize(model, units=Block)
        return (
            sw.train_step(chain, sw.tp.vocab_parallel_cross_entropy, optimizer),
            params,
            batches,
            sw.tp.tiny_gpt_plan(),
        )
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 8 // 3,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=batches[0][0])
    return sw.train_step(chain, llama_loss, optimizer), params, batches, sw.tp.llama_plan()


def rank_main(cfg: ModelConfig, candidates: list[Candidate], warmup: int, steps: int) -> dict[str, list[float]]:
    """This rank's seconds per timed step of every candidate, interleaved (``round_robin``: step
    ``i`` of each before step ``i + 1`` of any), so a change in the machine's load over the run
    falls on every layout alike rather than on the ones measured at that moment."""
    torch.set_num_threads(1)
    step, params, batches, tp_plan = build(cfg)
    applied = {str(c): c.apply(step, tp_plan).with_metrics(()) for c in candidates}
    states = {str(c): applied[str(c)].init(params, c.mesh) for c in candidates}

    def one_step(name: str, i: int, batch: Any) -> None:
        states[name], _ = applied[name](states[name], batch)

    feed = [batches[i % len(batches)] for i in range(warmup + steps)]
    times, _ = round_robin(list(applied), feed, warmup, one_step)
    return times


def busy(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """CPU work standing in for a step's computes: ``iterations`` small matmuls."""
    for _ in range(iterations):
        a = torch.tanh(a @ a)
    return a


def issue_rank_main(ops: tuple[str, ...], sizes: list[int], reps: int, work: int) -> dict[str, list[list[float]]]:
    """Seconds each call of ``ops`` took to return (before its wait), per size, on this rank, while
    every rank computes (``busy``) before and after each call, as a step's ranks do: what issuing
    costs a rank when its peers hold the cores (gloo's copy, the hand-off to its threads, the
    peer that the call wakes). A send goes to the next rank of a ring, whose receive is posted."""
    torch.set_num_threads(1)
    mesh = sw.Mesh(x=current_backend().world_size)
    me, n = mesh.rank, mesh.size
    backend, group = mesh.backend, mesh.group("x")
    a = torch.randn(64, 64) * 0.01
    out: dict[str, list[list[float]]] = {}
    for op in ops:
        out[op] = []
        for nbytes in sizes:
            x = torch.full((nbytes // 4,), 1.0)
            start = functools.partial(_issue, op, x, mesh)
            times = []
            for i in range(reps + 1):  # the first one is a warm-up
                backend.barrier(group)
                posted = sw.collectives.recv("x", (me - 1) % n, like=(x.shape, x.dtype), mesh=mesh) \
                    if op == "send" else None
                busy(a, work)
                began = time.perf_counter()
                handle = start()
                took = time.perf_counter() - began
                busy(a, work)
                handle.wait()
                if posted is not None:
                    posted.wait()
                if i:
                    times.append(took)
            out[op].append(times)
    return out


def _issue(op: str, x: torch.Tensor, mesh: sw.Mesh) -> Any:
    """Issue ``op`` of ``x`` over axis ``x`` as a step does (async; a send to the next rank)."""
    if op == "send":
        return sw.collectives.send(x, "x", (mesh.rank + 1) % mesh.size, announce=False, mesh=mesh)
    start = {"all_gather": functools.partial(sw.collectives.all_gather_async, dim=0, tiled=True),
             "psum_scatter": functools.partial(sw.collectives.psum_scatter_async, dim=0, tiled=True),
             "psum": sw.collectives.psum_async}[op]
    return start(x, "x", mesh=mesh)


def cores_rank_main(reps: int, work: int) -> tuple[list[float], list[tuple[float, float]]]:
    """``busy(work)`` on each rank alone (the others wait at a barrier), then on every rank at
    once: this rank's seconds alone, and (start, end) of each together (one clock: perf_counter)."""
    torch.set_num_threads(1)
    mesh = sw.Mesh(x=current_backend().world_size)
    backend, group = mesh.backend, mesh.group("x")
    a = torch.randn(64, 64) * 0.01
    alone: list[float] = []
    together: list[tuple[float, float]] = []
    for _ in range(reps):
        for k in range(mesh.size):
            backend.barrier(group)
            if mesh.rank == k:
                began = time.perf_counter()
                busy(a, work)
                alone.append(time.perf_counter() - began)
        backend.barrier(group)
        began = time.perf_counter()
        busy(a, work)
        together.append((began, time.perf_counter()))
    return alone, together


def probe_cores(pool: ProcessPool, reps: int) -> float:
    """How many cores the pool's ranks get together now: ``world x (one rank's work alone) / (the
    span of every rank doing the same work at once)``, medians over ``reps``. On an idle machine
    with a core per rank about ``world``; on 2 cores about 2; with other jobs on them, fewer."""
    per_rank = pool.run(cores_rank_main, reps, CORES_WORK)
    alone = statistics.median(t for ranks_alone, _ in per_rank for t in ranks_alone)
    spans = [max(r[1][i][1] for r in per_rank) - min(r[1][i][0] for r in per_rank) for i in range(reps)]
    return len(per_rank) * alone / statistics.median(spans)


def probe_comm(pool: ProcessPool, reps: int = 10, cores: float | None = None) -> sw.plan.CommModel:
    """alpha and beta per op, fitted to a short run of benchmarks/collectives.py on the pool's ranks,
    and what issuing each op costs a busy rank (``issue_rank_main``). ``cores``: what the ranks get
    together (``probe_cores``; None: a core each). Every rank computes around each issued call, so
    each runs on ``cores / world`` of a core and a call's wall time is its CPU time stretched by
    that: the rows say so (``core_share``), and the model keeps the CPU time, which the simulation
    stretches by the contention of each moment of a step (a pipeline's idle ranks leave the cores
    to the busy ones)."""
    import collectives  # this folder's benchmark; its ranks import it the same way

    world = pool.world
    share = 1.0 if cores is None else min(1.0, cores / world)
    counts = [reps] * len(PROBE_SIZES)
    rows: list[dict[str, Any]] = []
    for op in PROBE_OPS:
        per_rank = pool.run(collectives.rank_main, op, PROBE_SIZES, counts, False)
        rows += collectives.summarise("gloo", world, op, PROBE_SIZES, counts, per_rank)
    issue_ops = ("send", "all_gather", "psum_scatter", "psum")
    per_rank_issue = pool.run(issue_rank_main, issue_ops, ISSUE_SIZES, reps, ISSUE_WORK)
    for op in issue_ops:
        for k, nbytes in enumerate(ISSUE_SIZES):
            times = [t for r in per_rank_issue for t in r[op][k]]
            # The mean: a step pays every call, the slow ones (a time slice lost) included.
            rows.append({"bench": "collectives_issue", "backend": "gloo", "world": world, "op": op, "bytes": nbytes,
                         "issue_s": statistics.fmean(times), "issue_median_s": statistics.median(times),
                         "core_share": share})
    return sw.plan.CommModel.from_benchmark(rows, backend="gloo")


def ranks_of(values: list[float]) -> list[float]:
    """1-based ranks of ``values``, ties at their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (ties averaged)."""
    ra, rb = ranks_of(a), ranks_of(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


@dataclass(frozen=True)
class Pricing:
    """How the search prices: with or without the issue costs (``issue``), ranks sharing
    ``cores`` cores (``measured``: the probe's figure, ``machine``: ``os.cpu_count()``, or a count)."""

    issue: bool
    cores: str

    @classmethod
    def parse(cls, text: str) -> Pricing:
        kind, _, cores = text.partition("@")
        if kind not in ("issue", "plain") or not (cores in ("measured", "machine") or cores.isdigit()):
            raise argparse.ArgumentTypeError(f"--pricing {text!r}: issue@CORES or plain@CORES, CORES one of "
                                             "measured, machine or a count")
        return cls(kind == "issue", cores)

    def __str__(self) -> str:
        return f"{'issue' if self.issue else 'plain'}@{self.cores}"

    def core_count(self, measured: float, world: int) -> int:
        if self.cores == "measured":
            return min(world, max(1, round(measured)))
        return (os.cpu_count() or 1) if self.cores == "machine" else int(self.cores)


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama (default both)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--memory", default="64MiB", help="memory per rank for the search (default 64MiB)")
    parser.add_argument("--remat", default="none,nothing_saveable", help="remat policies to search, 'none' for off")
    parser.add_argument("--pricing", default="issue@measured,issue@machine,plain@machine,plain@1",
                        help="comma-separated pricings, each priced and compared against the one measurement: "
                             "issue@CORES (issue costs charged) or plain@CORES (not), CORES: measured (the probe's "
                             "count of the cores the ranks get), machine (os.cpu_count()) or a number")
    parser.add_argument("--world", type=int, default=WORLD, help=f"ranks (default {WORLD})")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 2 layers of width 32, ZeRO-1 and 1F1B "
                        "with 1-2 micro-batches only, short probes")
    parser.add_argument("--limit", type=int, default=None, help="measure only the first N layouts the first "
                        "pricing ranks (default all)")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = main_parser().parse_args(argv)
    with json_lines(args.out) as write, ProcessPool(args.world, timeout=TIMEOUT_S) as pool:
        run(args, pool, write)


def run(args: argparse.Namespace, pool: ProcessPool, write: Any) -> None:
    """The probes, then per model: every pricing's search, every layout measured, the comparisons."""
    world = pool.world
    pricings = [Pricing.parse(p) for p in args.pricing.split(",")]
    remat = tuple(None if r == "none" else r for r in args.remat.split(","))
    space = (Space(zero_stages=(1,), schedules=("1f1b",), microbatches=(1, 2), remat=remat) if args.tiny
             else Space(remat=remat, microbatches=(1, 2, 4)))
    reps = 2 if args.tiny else 10
    note(f"# probing the collectives on {world} gloo ranks")
    cores_measured = probe_cores(pool, reps)
    comm = probe_comm(pool, reps, cores_measured)
    write({"bench": "search", "probe": True, "cores_measured": round(cores_measured, 2),
           "issue_core_share": round(min(1.0, cores_measured / world), 3),
           "issue_s": dict(comm.issue), "issue_per_byte_s": dict(comm.issue_per_byte), "alpha_s": dict(comm.alpha),
           "beta_s_per_byte": dict(comm.beta), **environment(1)})
    plain = replace(comm, issue={}, issue_per_byte={})
    for name in args.models.split(","):
        cfg = ModelConfig(name, hidden=32, layers=2) if args.tiny else ModelConfig(name)
        step, params, batches, tp_plan = build(cfg)
        # One single-device measurement serves every pricing below.
        compute = MeasuredCompute(step, params, batches[0], smallest=1.0 / (world * max(space.microbatches)),
                                  steps=2 if args.tiny else 10)
        found: dict[Pricing, SearchResult] = {}
        for pricing in pricings:
            cores = pricing.core_count(cores_measured, world)
            started = time.perf_counter()
            found[pricing] = sw.search(step, params, batches[0], world=world, memory_per_rank=args.memory,
                                       comm=comm if pricing.issue else plain, compute=compute, tp_plan=tp_plan,
                                       space=space, top=10_000, cores=cores)
            note(f"# {name}, priced {pricing} ({cores} cores, {time.perf_counter() - started:.0f} s)")
            note(found[pricing].table())
        layouts = [p.candidate for p in next(iter(found.values())).ranked][:args.limit]
        note(f"# measuring {len(layouts)} layouts of {name}, interleaved")
        per_rank = pool.run(rank_main, cfg, layouts, args.warmup, args.steps)
        # A step takes as long as its slowest rank; a layout, the median of its steps (and,
        # beside it, its fastest step: what it takes when the machine's other load leaves it be).
        steps = {str(c): [max(t) for t in zip(*(r[str(c)] for r in per_rank), strict=True)] for c in layouts}
        for pricing, result in found.items():
            for statistic in ("median", "min"):
                average = statistics.median if statistic == "median" else min
                compare(name, pricing, pricing.core_count(cores_measured, world), result,
                        {s: average(t) for s, t in steps.items()}, statistic, write)


def compare(name: str, pricing: Pricing, cores: int, found: SearchResult, measured: dict[str, float], statistic: str,
            write: Any) -> None:
    """One JSON line per layout measured, both rankings, and the summary: Spearman and the first
    choice, against the ``statistic`` (median or min) of each layout's measured steps."""
    ranked = [p for p in found.ranked if str(p.candidate) in measured]
    stacks = [str(p.candidate) for p in ranked]
    predicted = [p.time for p in ranked]
    seconds = [measured[s] for s in stacks]
    key = {"bench": "search", "model": name, "pricing": str(pricing), "issue_costs": pricing.issue,
           "simulated_cores": cores, "measured": statistic}
    for p, took in zip(ranked, seconds, strict=True):
        write({**key, "stack": str(p.candidate), "predicted_s": p.time, "measured_s": took,
               "ratio": round(p.time / took, 3), "peak_bytes": p.memory})
    for ranking, values in (("predicted", predicted), ("measured", seconds)):
        order = [stacks[i] for i in sorted(range(len(values)), key=values.__getitem__)]
        write({**key, "ranking": ranking, "order": order})
    write({**key, "summary": True, "layouts": len(stacks),
           "refused": len(found.refused), "spearman": round(spearman(predicted, seconds), 3),
           "top_choice": stacks[0], "measured_best": stacks[seconds.index(min(seconds))],
           "top_choice_vs_best": round(seconds[0] / min(seconds), 3),
           "refusals": {f"{s}: {why}": n for (s, why), n in found.refusals_by_reason().items()}, **environment(1)})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
