"""Simulated against measured: a composed dp=2 x pp=2 step's Plan, calibrated on one half of a run.

Run it from the repository root:

    python benchmarks/plan_timeline.py                              # gloo processes, ~15 s on 2 idle cores
    python benchmarks/plan_timeline.py --backend threads --steps 20
    python benchmarks/plan_timeline.py --collectives collectives.jsonl --draw out/   # + pictures
    python benchmarks/plan_timeline.py --stack tp2 --hidden 256 --layers 4 --batch 8   # tensor parallel

What runs
---------
``sw.shard_params(sw.pipeline(step, "pp", "1f1b", M, trace=True), "dp", 3)``
on ``Mesh(dp=2, pp=2)``: an MLP (``--layers`` x Linear(h, h) + GELU, h =
``--hidden``), AdamW, global batch ``--batch`` cut into ``M`` =
``--microbatches``. Four ranks (gloo processes, or threads of one process), one
torch thread each, every step after a barrier; ``--warmup`` untimed steps, then
``--steps`` recorded ones: each rank's ``metrics["action_times"]``, every
action of its Plan with its start and end (``time.perf_counter``, one clock
for every process of the machine).

``--stack tp2`` runs a tensor-parallel step instead: TinyGPT (``--hidden``
wide, ``--layers`` blocks, 4 heads, ``--batch`` rows of 32 tokens) under
``sw.tensor_parallel(..., sequence_parallel=blocks)`` with the vocabulary-parallel
loss, on ``Mesh(tp=2)``, traced with ``step.with_trace()``.

Calibration and comparison
--------------------------
* Computes, issues and bookkeeping: ``PlanCosts.fit`` on the first half of the
  recorded steps (``--statistic`` per (kind, stage), (kind, unit) or (kind,
  rank); a blocking action its shortest duration), with ``--cores C``: only the
  share of a core an action had while more than ``C`` ranks were busy, and the
  same sharing simulated.
* Communication: ``CommModel.fit`` (least squares of ``alpha x steps + beta x
  bytes x factor``, per op, each sample at its size's mean) on what the first half's
  waits show (``measured_transfers``, default), or ``CommModel.from_benchmark``
  on ``benchmarks/collectives.py``'s JSON lines of the same backend (``--comm
  benchmark``: ``--collectives FILE``, or else a short probe run here first, ops
  psum, all_gather, psum_scatter and send_recv, 1 KiB to 1 MiB, world 2, as the
  step's dp and pp groups are).
* The prediction: ``simulate(plan, costs.of_step(plan, step))`` for every
  calibration step (its own action costs, the fitted waits and communication),
  the median of those. The measured figures are the medians over the second half
  of ``PlanTimeline.from_measured``: ``step_s`` its makespan (first action of any
  rank to last action of any rank) and ``bubble`` its ``1 - compute / (ranks x
  makespan)``.

Output: JSON lines. ``kind: "calibration"`` (the fitted alpha and beta, and
compute averages); ``kind: "compare"``: ``measured_step_s``,
``simulated_step_s``, ``step_ratio`` (simulated / measured), the same for
``bubble`` and ``comm_wait_s`` (mean per rank), ``averaged_costs_*``: one
simulation at the averaged costs instead (shorter: the critical path of average
costs is not the average critical path), ``replay_*_ratio`` (each calibration
step simulated at its own costs against that same step: the model alone) and
``halves_*_ratio`` (the calibration half's measured median against the compared
half's: how much the machine drifted), ``simulated_no_comm_step_s`` (the same
costs, communication free: what the transfers add), ``within_15pct`` for the
step and bubble ratios, and the machine (``cores``, ``loadavg_1m``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import add_out_flag, environment, json_lines, note
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.models import Block, TinyGPT
from shardwise.transforms.pipeline import (
    CommModel,
    PlanCosts,
    PlanTimeline,
    ascii_timeline,
    gantt,
    measured_transfers,
    simulate,
    write_chrome_trace,
)
from shardwise.transforms.tensor_parallel import TINY_GPT_BLOCKS

TIMEOUT_S = 600.0
MESH_SHAPES = {"dp2xpp2": {"dp": 2, "pp": 2}, "tp2": {"tp": 2}}
TP_VOCAB, TP_SEQ = 512, 32
PROBE_OPS = ("psum", "all_gather", "psum_scatter", "send_recv")
PROBE_SIZES = [1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20]
ActionTimes = list[tuple[int, float, float]]


@dataclass(frozen=True)
class Config:
    hidden: int
    layers: int
    batch: int
    microbatches: int
    steps: int
    warmup: int
    stack: str = "dp2xpp2"
    seed: int = 0

    @property
    def mesh(self) -> sw.Mesh:
        return sw.Mesh(**MESH_SHAPES[self.stack])


def build(cfg: Config) -> tuple[sw.Step, dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The composed step, the seeded parameters and the batches (identical in every process)."""
    torch.manual_seed(cfg.seed)
    if cfg.stack == "tp2":
        return build_tp(cfg)
    layers: list[nn.Module] = []
    for _ in range(cfg.layers):
        layers += [nn.Linear(cfg.hidden, cfg.hidden), nn.GELU()]
    chain, params = sw.functionalize(nn.Sequential(*layers))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-3))
    composed = sw.shard_params(sw.pipeline(step, "pp", "1f1b", cfg.microbatches, trace=True), "dp", 3)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batches = [(torch.randn(cfg.batch, cfg.hidden, generator=gen), torch.randn(cfg.batch, cfg.hidden, generator=gen))
               for _ in range(cfg.warmup + cfg.steps)]
    return composed, params, batches


def build_tp(cfg: Config) -> tuple[sw.Step, dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """TinyGPT (``--hidden`` wide, ``--layers`` blocks, 4 heads) at tp=2 with sequence parallel and
    the vocabulary-parallel loss, traced."""
    model = TinyGPT(vocab=TP_VOCAB, d_model=cfg.hidden, n_heads=4, n_layers=cfg.layers, seq_len=TP_SEQ)
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, sw.tp.vocab_parallel_cross_entropy, sw.optim.adamw(1e-3))
    split = sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(), sequence_parallel=TINY_GPT_BLOCKS).with_trace()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batches = [(torch.randint(TP_VOCAB, (cfg.batch, TP_SEQ), generator=gen),
                torch.randint(TP_VOCAB, (cfg.batch, TP_SEQ), generator=gen)) for _ in range(cfg.warmup + cfg.steps)]
    return split, params, batches


# Thread ranks share torch's global generator: one build at a time, or their seeded
# initialisations interleave and the ranks start from different weights (step.init refuses).
_BUILD = threading.Lock()


def rank_main(cfg: Config) -> list[ActionTimes]:
    """Every step after a barrier of all ranks; the recorded steps' action times of this rank."""
    torch.set_num_threads(1)
    with _BUILD:
        composed, params, batches = build(cfg)
    mesh = cfg.mesh
    world = sw.Mesh(world=mesh.size)
    backend, everyone = world.backend, world.group("world")
    state = composed.init(params, mesh)
    recorded = []
    for i, batch in enumerate(batches):
        backend.barrier(everyone)
        state, metrics = composed(state, batch)
        if i >= cfg.warmup:
            recorded.append(list(metrics["action_times"]))
    return recorded


def run_ranks(backend: str, fn: Any, world: int, *args: Any) -> list[Any]:
    if backend == "threads":
        return sw.launch(fn, world, timeout=TIMEOUT_S, args=args)
    with ProcessPool(world, timeout=TIMEOUT_S) as pool:
        return pool.run(fn, *args)


def probe_collectives(backend: str) -> list[dict[str, Any]]:
    """A short run of benchmarks/collectives.py's measurement (world 2: the step's groups' size)."""
    import collectives  # this folder's benchmark; its ranks import it the same way

    reps = [10] * len(PROBE_SIZES)
    rows: list[dict[str, Any]] = []
    for op in PROBE_OPS:
        per_rank = run_ranks(backend, collectives.rank_main, 2, op, PROBE_SIZES, reps, False)
        rows += collectives.summarise(backend, 2, op, PROBE_SIZES, reps, per_rank)
    return rows


def median_of(timelines: list[PlanTimeline], figure: str) -> float:
    if figure == "comm_wait":
        return statistics.median(statistics.fmean(t.comm_wait) for t in timelines)
    return statistics.median(getattr(t, figure) for t in timelines)


def ratio(simulated: float, measured: float) -> float | None:
    return None if measured == 0 else round(simulated / measured, 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "threads"), default="gloo")
    parser.add_argument("--stack", choices=tuple(MESH_SHAPES), default="dp2xpp2",
                        help="dp2xpp2: the MLP under shard_params(pipeline(1f1b)) (default); tp2: TinyGPT at "
                             "tp=2 with sequence parallel (--hidden its width, --layers its blocks, --batch rows "
                             f"of {TP_SEQ} tokens)")
    parser.add_argument("--hidden", type=int, default=512, help="MLP width (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--batch", type=int, default=256, help="global batch rows (default 256)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches (default 4)")
    parser.add_argument("--steps", type=int, default=30, help="recorded steps, >= 2: half calibrate (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--comm", choices=("run", "benchmark"), default="run",
                        help="fit communication from the calibration steps' waits (default) or from the "
                             "collectives benchmark (--collectives FILE, else a short probe)")
    parser.add_argument("--collectives", help="JSON lines of benchmarks/collectives.py to fit communication from")
    parser.add_argument("--statistic", choices=("mean", "median"), default="mean",
                        help="what an action's measured durations calibrate to (default mean)")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores the ranks share, in calibration and simulation (default: this machine's; "
                             "0: a core per rank)")
    parser.add_argument("--draw", help="write ASCII, Chrome trace and (with matplotlib) Gantt files here")
    add_out_flag(parser)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first half calibrates, the second is compared")
    cfg = Config(args.hidden, args.layers, args.batch, args.microbatches, args.steps, args.warmup, args.stack)
    mesh = cfg.mesh
    composed, params, batches = build(cfg)
    plan = composed.plan(mesh, params, batches[0])

    note(f"# {args.warmup + args.steps} steps of {cfg.stack} on {args.backend}")
    per_rank = run_ranks(args.backend, rank_main, mesh.size, cfg)
    steps = [[per_rank[r][i] for r in range(mesh.size)] for i in range(args.steps)]
    half = args.steps // 2
    cores = args.cores or None
    costs = PlanCosts.fit(plan, steps[:half], statistic=args.statistic, cores=cores)
    if args.comm == "run":  # what the first half's waits show
        comm = CommModel.fit(measured_transfers(plan, steps[:half], costs))
    elif args.collectives:
        rows = [json.loads(line) for line in Path(args.collectives).read_text().splitlines() if line.strip()]
        comm = CommModel.from_benchmark(rows, backend=args.backend)
    else:
        note(f"# probing collectives on {args.backend} (world 2)")
        comm = CommModel.from_benchmark(probe_collectives(args.backend), backend=args.backend)
    comm, unfitted = comm.covering(plan)
    if unfitted:
        note(f"# no calibration step waited for {unfitted}: simulated as free")
    costs = dataclasses.replace(costs, comm=comm)
    measured = [PlanTimeline.from_measured(plan, step) for step in steps[half:]]
    # The prediction: each calibration step's own action costs simulated (costs.of_step), the
    # median of those; and, for comparison, one simulation at the averaged costs.
    per_step = [simulate(plan, costs.of_step(plan, step)) for step in steps[:half]]
    averaged = simulate(plan, costs)
    no_comm = [simulate(plan, dataclasses.replace(costs.of_step(plan, step), comm=CommModel())) for step in steps[:half]]
    one_core_each = dataclasses.replace(PlanCosts.fit(plan, steps[:half], statistic=args.statistic), comm=comm)
    own_cores = [simulate(plan, one_core_each.of_step(plan, step)) for step in steps[:half]]

    shape = {"stack": cfg.stack, "hidden": cfg.hidden, "layers": cfg.layers, "batch": cfg.batch,
             "microbatches": cfg.microbatches,
             "steps": cfg.steps, "backend": args.backend,
             "statistic": args.statistic, "cores_modelled": cores, "comm_from": args.comm}
    with json_lines(args.out) as emit:
        emit({"bench": "plan_timeline", "kind": "calibration", **shape,
              "alpha_s": dict(comm.alpha), "beta_s_per_byte": dict(comm.beta), "unfitted_ops": list(unfitted),
              "compute_ms": {f"{k}/{s}": round(v * 1e3, 4) for (k, s), v in costs.stage.items()},
              "update_ms": {r: round(v * 1e3, 4) for (k, r), v in costs.rank.items() if k == "update"}})
        row: dict[str, Any] = {"bench": "plan_timeline", "kind": "compare", **shape}
        for figure, key in (("makespan", "step_s"), ("bubble_fraction", "bubble"), ("comm_wait", "comm_wait_s")):
            got, want = median_of(measured, figure), median_of(per_step, figure)
            one = statistics.fmean(averaged.comm_wait) if figure == "comm_wait" else getattr(averaged, figure)
            name = key.removesuffix("_s")
            row |= {f"measured_{key}": round(got, 6), f"simulated_{key}": round(want, 6),
                    f"{name}_ratio": ratio(want, got), f"averaged_costs_{key}": round(one, 6),
                    f"averaged_costs_{name}_ratio": ratio(one, got)}
        # Two checks on the prediction: each calibration step simulated at its own costs against
        # that same step (the model alone, no step-to-step change), and how far the calibration
        # half's measured steps were from the compared half's (the machine's drift).
        calibration = [PlanTimeline.from_measured(plan, step) for step in steps[:half]]
        for figure, key in (("makespan", "step"), ("bubble_fraction", "bubble")):
            row[f"replay_{key}_ratio"] = round(statistics.median(
                getattr(sim, figure) / getattr(real, figure) for sim, real in zip(per_step, calibration, strict=True)
                if getattr(real, figure) > 0), 3)
            row[f"halves_{key}_ratio"] = ratio(median_of(calibration, figure), median_of(measured, figure))
        row["simulated_no_comm_step_s"] = round(median_of(no_comm, "makespan"), 6)
        row["simulated_core_per_rank_step_s"] = round(median_of(own_cores, "makespan"), 6)
        row["simulated_core_per_rank_bubble"] = round(median_of(own_cores, "bubble_fraction"), 6)
        row["within_15pct"] = all(abs(median_of(per_step, figure) / median_of(measured, figure) - 1) <= 0.15
                                  for figure in ("makespan", "bubble_fraction"))
        emit(row | environment(keys=("cores", "loadavg_1m", "torch")))
    if args.draw:
        middle = sorted(per_step, key=lambda t: t.makespan)[len(per_step) // 2]  # the median simulated step
        draw(Path(args.draw), middle, sorted(measured, key=lambda t: t.makespan)[len(measured) // 2])


def draw(folder: Path, simulated: PlanTimeline, measured: PlanTimeline) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, timeline in (("simulated", simulated), ("measured", measured)):
        (folder / f"{name}.txt").write_text(ascii_timeline(timeline) + "\n")
        write_chrome_trace(timeline, folder / f"{name}.json")
        try:
            gantt(timeline, folder / f"{name}.png")
        except ImportError as err:
            note(f"# no Gantt chart: {err}")
    note(f"# drawings in {folder}")


if __name__ == "__main__":
    sys.exit(main())
