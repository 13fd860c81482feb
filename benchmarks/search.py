"""Plan search against measurement: every layout the search finds feasible is also run, and the
predicted ranking is compared with the measured one.

World 4 on gloo processes, two models: TinyGPT (``shardwise.testing.models``, blocks as
units, the vocabulary-parallel loss, ``sw.tp.tiny_gpt_plan()``) and a tiny Hugging Face Llama
(decoder layers as units, ``sw.tp.llama_plan()``). For each:

1. ``sw.search`` prices every candidate: compute from single-device steps measured in this
   process (``MeasuredCompute``, one torch thread, as a rank has), communication from a short
   probe of the collectives on the same 4 gloo ranks (``CommModel.from_benchmark``), the ranks
   sharing ``--cores`` cores (``PlanCosts.cores``; several values: each priced and compared
   against the one measurement, since what the ranks get of a loaded machine is not known).
2. Every layout that fits is run on the 4 ranks, all of them interleaved (step ``i`` of every
   layout before step ``i + 1`` of any): ``--warmup`` steps, then ``--steps`` timed ones (a
   barrier before each; a step's time is its slowest rank's); measured = the median (and,
   compared separately, the fastest step: on a shared machine the least disturbed one).
3. One JSON line per layout (predicted and measured seconds, predicted peak), then a summary
   line per model: Spearman's rank correlation of predicted against measured (ties get their
   average rank), and how far the search's first choice is from the measured best
   (``top_choice_vs_best``: its measured time over the best measured time; 1.0 is the best).

    python benchmarks/search.py [--models gpt,llama] [--steps 5] [--warmup 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from _common import environment, json_lines, note, round_robin

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.plan_search import Candidate, MeasuredCompute, SearchResult, Space
from shardwise.testing.models import Block, TinyGPT

WORLD = 4
TIMEOUT_S = 300.0
PROBE_OPS = ("psum", "all_gather", "psum_scatter", "send_recv")
PROBE_SIZES = [1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20]


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


def probe_comm(pool: ProcessPool) -> sw.plan.CommModel:
    """alpha and beta per op, fitted to a short run of benchmarks/collectives.py on the pool's ranks."""
    import collectives  # this folder's benchmark; its ranks import it the same way

    reps = [10] * len(PROBE_SIZES)
    rows: list[dict[str, Any]] = []
    for op in PROBE_OPS:
        per_rank = pool.run(collectives.rank_main, op, PROBE_SIZES, reps, False)
        rows += collectives.summarise("gloo", WORLD, op, PROBE_SIZES, reps, per_rank)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama (default both)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--memory", default="64MiB", help="memory per rank for the search (default 64MiB)")
    parser.add_argument("--remat", default="none,nothing_saveable", help="remat policies to search, 'none' for off")
    parser.add_argument("--cores", default=str(os.cpu_count() or 1),
                        help="comma-separated: cores the ranks share in the simulation, each priced and compared "
                             "(default: this machine's count)")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    remat = tuple(None if r == "none" else r for r in args.remat.split(","))
    space = Space(remat=remat, microbatches=(1, 2, 4))
    with json_lines(args.out) as write, ProcessPool(WORLD, timeout=TIMEOUT_S) as pool:
        note("# probing the collectives on 4 gloo ranks")
        comm = probe_comm(pool)
        for name in args.models.split(","):
            cfg = ModelConfig(name)
            step, params, batches, tp_plan = build(cfg)
            # One single-device measurement serves every pricing below.
            compute = MeasuredCompute(step, params, batches[0], smallest=1.0 / (WORLD * max(space.microbatches)))
            found: dict[int, SearchResult] = {}
            for cores in (int(c) for c in args.cores.split(",")):
                started = time.perf_counter()
                found[cores] = sw.search(step, params, batches[0], world=WORLD, memory_per_rank=args.memory,
                                         comm=comm, compute=compute, tp_plan=tp_plan, space=space, top=10_000,
                                         cores=cores)
                note(f"# {name}, simulated on {cores} cores ({time.perf_counter() - started:.0f} s)")
                note(found[cores].table())
            layouts = [p.candidate for p in next(iter(found.values())).ranked]
            note(f"# measuring {len(layouts)} layouts of {name}, interleaved")
            per_rank = pool.run(rank_main, cfg, layouts, args.warmup, args.steps)
            # A step takes as long as its slowest rank; a layout, the median of its steps (and,
            # beside it, its fastest step: what it takes when the machine's other load leaves it be).
            steps = {str(c): [max(t) for t in zip(*(r[str(c)] for r in per_rank), strict=True)] for c in layouts}
            for cores, result in found.items():
                for statistic in ("median", "min"):
                    average = statistics.median if statistic == "median" else min
                    compare(name, cores, result, {s: average(t) for s, t in steps.items()}, statistic, write)


def compare(name: str, cores: int, found: SearchResult, measured: dict[str, float], statistic: str,
            write: Any) -> None:
    """One JSON line per layout, both rankings, and the summary: Spearman and the first choice,
    against the ``statistic`` (median or min) of each layout's measured steps."""
    stacks = [str(p.candidate) for p in found.ranked]
    predicted = [p.time for p in found.ranked]
    seconds = [measured[s] for s in stacks]
    for p, took in zip(found.ranked, seconds, strict=True):
        write(
            {
                "bench": "search",
                "model": name,
                "simulated_cores": cores,
                "measured": statistic,
                "stack": str(p.candidate),
                "predicted_s": p.time,
                "measured_s": took,
                "ratio": round(p.time / took, 3),
                "peak_bytes": p.memory,
            }
        )
    for ranking, values in (("predicted", predicted), ("measured", seconds)):
        order = [stacks[i] for i in sorted(range(len(values)), key=values.__getitem__)]
        write({"bench": "search", "model": name, "simulated_cores": cores, "measured": statistic, "ranking": ranking,
               "order": order})
    write({"bench": "search", "model": name, "simulated_cores": cores, "measured": statistic, "summary": True,
           "layouts": len(stacks),
           "refused": len(found.refused), "spearman": round(spearman(predicted, seconds), 3),
           "top_choice": stacks[0], "measured_best": min(measured, key=measured.__getitem__),
           "top_choice_vs_best": round(seconds[0] / min(seconds), 3),
           "refusals": {f"{s}: {why}": n for (s, why), n in found.refusals_by_reason().items()}, **environment(1)})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
