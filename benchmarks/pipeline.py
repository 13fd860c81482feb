"""sw.pipeline (GPipe, 1F1B, interleaved 1F1B) against torch.distributed.pipelining, on gloo processes.

Run it from the repository root:

    python benchmarks/pipeline.py                      # defaults: 1-2 minutes on 2 cores
    python benchmarks/pipeline.py --steps 20 --warmup 3 --worlds 2 --models gpt --out pipe.jsonl
    python benchmarks/pipeline.py --models gpt --worlds 2 --profile ours:1f1b   # + a cProfile of rank 0
    python benchmarks/pipeline.py --models mlp --worlds 2 --mlp-hidden 16       # the per-step overhead

What is measured
----------------
Models: ``mlp`` is 8 x (Linear(512, 512), GELU) with an MSE regression loss,
functionalized as a Sequential (16 layers: each Linear and each GELU is one;
``--mlp-hidden 16`` makes it 8 x (Linear(16, 16), GELU), where what is left is mostly
each library's per-step overhead);
``gpt`` is ``TinyGPT(vocab=1024, d_model=256, n_heads=4, n_layers=4,
seq_len=128, tie_weights=False)`` with cross-entropy, functionalized with
``units=["tok_emb", "blocks", "head"]``: 6 layers ``tok_emb, blocks.0 ..
blocks.3, head``, where ``blocks.0`` also adds the position embedding and
``head`` also applies ``ln_f`` (the glue joins the next unit). The head is
untied (``tie_weights=False``) so that both libraries run the same model:
torch.distributed.pipelining has no weights tied across stages (sw.pipeline
keeps them tied; tests/transforms/test_pipeline_step.py).

Schedules and stages: ``gpipe`` and ``1f1b`` run one stage per rank;
``interleaved_1f1b`` two (virtual) stages per rank, stage ``s`` on rank
``s % world`` (both libraries place them so). The layers are cut once, by
sw.pipeline's default balance (parameter counts), and that cut is given to
ours as an explicit ``partition=`` and used to build torch's stages: each torch
``PipelineStage`` wraps an ``nn.Sequential`` of the very same modules (small
wrappers add the position embedding to ``blocks.0`` and ``ln_f`` to
``head``), so both sides compute the same thing per stage. A split with more
stages than layers (GPT, 6 layers, at world 4 interleaved: 8 stages) is
reported as ``skipped``.

Variants, per schedule, all with AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight decay 0.01), the same initial weights, global batches and micro-batches:

* ``ours``: ``sw.pipeline(train_step, "pp", schedule, microbatches, stages=,
  partition=, trace=True)`` with ``sw.optim.adamw``; every rank is given the
  global batch. Every rank gets the global loss and gradient norm of every step
  (one all-reduce, and a pass over the gradients for the norm).
* ``ours_quiet``: the same step with ``.with_metrics(())``: it reports nothing,
  so it sums nothing across ranks and computes no norm, which is the work torch's
  schedules do (they keep the losses on the last stage's rank). It has no loss
  to check; ``params_equal_to_ours`` says instead whether its parameters ended
  bitwise equal to ``ours``'s on every rank (the same updates).
* ``torch``: ``PipelineStage(submodule, stage_index, num_stages, cpu)`` and
  ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` with the
  loss as ``loss_fn`` (``scale_grads=True``: the mean over micro-batches, as
  ours), ``step(x)`` on rank 0 and ``step(target=y, losses=...)`` on the last
  rank (``return_outputs=False``), then ``torch.optim.AdamW`` on the rank's
  stage parameters.

Every world runs in one :class:`~shardwise.collectives.processes.ProcessPool`
(gloo, one process per rank, ``torch.set_num_threads(1)`` in each). Inside a
rank all variants are built and stepped round-robin (step i of every variant,
then step i + 1 ...), so they share the same machine conditions. Each step
starts after a ``dist.barrier()``.

How to read the output
----------------------
One JSON object per (model, world, schedule, impl) on stdout (and in ``--out``):

* ``median_step_s``: median over the ``steps`` timed steps (after ``warmup``
  untimed ones) of the slowest rank's wall time for that step (optimizer
  included). ``ratio_to_torch``: that median divided by torch's for the same
  schedule (> 1: slower than torch). ``paired_ratio_to_torch``: the median over
  rounds of (this step / torch's step in the same round); the two ran back to
  back, so load that drifts during the run cancels.
* ``first_loss``: the loss of the first step (mean over micro-batches);
  ``first_loss_rel_diff_vs_torch`` (ours) compares it with torch's, and
  ``max_rel_loss_diff`` compares every step (warm-up included) with a
  single-process torch run of the whole model on the whole batch. float32:
  expect ~1e-6, not 0.
* from every rank's compute events of the step, on one clock (ours: the runtime
  trace, ``metrics["trace"]``; torch: each ``PipelineStage``'s
  ``forward_one_chunk`` / ``backward_one_chunk``, timed by wrapping those two
  methods on the stage objects; each span includes the library's own
  bookkeeping around the compute, the messages do not): ``bubble_measured`` is
  ``Timeline.from_measured(schedule, events).bubble_fraction``, the idle share
  of the ranks' time between the first compute and the last (median over the
  timed steps; waiting for messages counts as idle). ``bubble_sim_unit`` is
  ``simulate(schedule).bubble_fraction`` (F = 1, B = 2, no comm);
  ``bubble_sim_kind_costs`` simulates with the measured mean F and B;
  ``bubble_sim_stage_costs`` with the measured mean per (stage, kind), so
  unbalanced stages count; ``bubble_sim_stage_costs_comm`` also charges every
  cross-rank dependency the measured ``handover_ms`` (below). ``mean_op_ms``
  gives the mean F and B; ``trace_makespan_s`` (measured) against
  ``sim_makespan_s`` (stage costs, no comm) and ``sim_makespan_comm_s`` shows
  how much of the step is spent outside the computes (messages, Python).
  ``handover_ms``: median time from the end of a compute on one rank to the
  start of the compute on another rank that was idle waiting for its result
  (send + transfer + receive of one activation or gradient); ``local_gap_ms``:
  median time between two computes of a rank whose inputs were already there
  (its own sends, receives and bookkeeping in between).
* ``minor_faults_per_step``: per rank, the median number of minor page faults
  of a timed step (``getrusage``; the step's fresh memory the allocator had to
  get from the OS again). At a few MB per step each thousand costs about 1 ms here,
  so it explains part of the step-time differences between variants.
* ``cpu_ms_per_step``: per rank, the median CPU time (``time.process_time``, all
  the rank's threads) of a timed step. With more ranks than cores the ranks
  share the CPU, so the step time follows the total CPU time as much as the
  critical path.
* ``step_peak_mib`` (with ``--malloc live`` only): per rank, the median over the timed steps of the
  most the step held above the RSS it started with (VmHWM, reset before the step), glibc giving freed
  memory back at once: what the schedule holds at its most (activations, transfers, gradients, the
  update's temporaries), the parameters and optimizer state at rest left out.
* ``malloc``: ``default``, ``live`` (see ``step_peak_mib``), or ``steady`` with ``--malloc steady``, which starts the
  ranks with glibc's mmap and trim thresholds fixed (``_common.STEADY_MALLOC``).
  By default glibc moves them with the process's history, and a step may refault
  memory an earlier step freed; which library pays depends on where both
  libraries' buffers lie in the heap they share (see ``minor_faults_per_step``).
* ``cores``: ``os.cpu_count()``; ``loadavg_1m`` the machine's load when the
  line was written. With ``world > cores`` the ranks oversubscribe the CPU:
  step times and measured bubbles then include time a rank was descheduled.
* ``skipped``: present (with the reason) instead of timings when a variant
  could not be built.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    GPT_UNITS,
    MLP_HIDDEN,
    add_batch_flags,
    add_malloc_flag,
    add_out_flag,
    add_run_flags,
    environment,
    loss_fn_of,
    make_batches,
    malloc_now,
    max_rel_diff,
    median_of_max,
    minor_faults,
    note,
    paired_ratio_median,
    profile_steps,
    reference_losses,
    rel_diff,
    reset_peak_rss,
    round_robin,
    run_on_ranks,
    seeded_model,
    slowest_per_step,
    sw_adamw,
    sweep,
    torch_adamw,
)
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.memory import status_bytes
from shardwise.testing.models import TinyGPT
from shardwise.transforms.pipeline import Costs, Timeline, get_schedule, simulate

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v")
DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
IMPLS = ("ours", "ours_quiet", "torch")
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zb_v": 2}
# torch's schedule each of ours is measured against: the same one, except ZB-H1, which torch does
# not have for one stage per rank: its 1F1B, which ZB-H1 reorders (the same activations held).
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                   "zb_h1": "Schedule1F1B", "zb_v": "ScheduleZBVZeroBubble"}
# Which of our schedules torch's ops are, for its bubble figures (its 1F1B where ours is ZB-H1).
TORCH_OPS_AS = {"zb_h1": "1f1b"}


@dataclass(frozen=True)
class Config:
    """One (model, world) run; travels to every rank."""

    model: str
    world: int
    steps: int
    warmup: int
    batch: int  # global batch (MLP rows, GPT sequences)
    microbatches: int
    schedules: tuple[str, ...]
    seed: int = 0
    mlp_hidden: int = MLP_HIDDEN  # the MLP's width: small widths leave mostly the per-step overhead
    profile: str | None = None  # "impl:schedule" to cProfile after the timed steps
    profile_rank: int = 0
    profile_steps: int = 5
    impls: tuple[str, ...] = IMPLS


def variant_name(impl: str, schedule: str) -> str:
    return f"{impl}:{schedule}"


# -- models, data (shared with shard_params.py: _common) ----------------------------------------
def build_model(cfg: Config) -> nn.Module:
    """The model with its seeded initial weights (identical in every process).

    GPT's head is untied: torch.distributed.pipelining cannot tie it to the embedding across stages.
    """
    return seeded_model(cfg.model, cfg.seed, tie_weights=False, mlp_hidden=cfg.mlp_hidden)


def batches_of(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``warmup + steps`` global batches (inputs, targets), the same in every process."""
    return make_batches(cfg.model, cfg.batch, cfg.warmup + cfg.steps, cfg.seed, mlp_hidden=cfg.mlp_hidden)


# -- torch's side of the same split --------------------------------------------------------
class TokenEmbedding(nn.Module):
    """GPT layer ``tok_emb``."""

    def __init__(self, tok_emb: nn.Embedding) -> None:
        super().__init__()
        self.tok_emb = tok_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx)


class FirstBlock(nn.Module):
    """GPT layer ``blocks.0``: the position embedding (glue) then the first block."""

    def __init__(self, pos_emb: nn.Parameter, block: nn.Module) -> None:
        super().__init__()
        self.pos_emb = pos_emb
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x + self.pos_emb[:, : x.size(1)])


class Head(nn.Module):
    """GPT layer ``head``: ``ln_f`` (glue) then the output projection."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f = ln_f
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def torch_layers(cfg: Config, model: nn.Module) -> dict[str, nn.Module]:
    """One nn.Module per layer of our chain, by the chain's layer names, computing the same thing."""
    if cfg.model == "mlp":
        assert isinstance(model, nn.Sequential)
        return {str(i): child for i, child in enumerate(model)}
    assert isinstance(model, TinyGPT)
    layers: dict[str, nn.Module] = {"tok_emb": TokenEmbedding(model.tok_emb)}
    for i, block in enumerate(model.blocks):
        layers[f"blocks.{i}"] = FirstBlock(model.pos_emb, block) if i == 0 else block
    layers["head"] = Head(model.ln_f, model.head)
    return layers


# -- the variants, as seen from one rank ---------------------------------------------------
class Ours:
    """sw.pipeline with one schedule; gets the global batch; records the runtime trace.

    ``quiet``: the same step reporting no metrics (``with_metrics(())``): no global loss or
    gradient norm, so no all-reduce and no norm, the same work as torch's schedules.
    """

    def __init__(self, cfg: Config, schedule: str, *, quiet: bool = False) -> None:
        units = GPT_UNITS if cfg.model == "gpt" else None
        chain, params = sw.functionalize(build_model(cfg), units=units)
        step = sw.train_step(chain, loss_fn_of(cfg.model), sw_adamw())
        stages = cfg.world * VIRTUAL_STAGES[schedule]
        mesh = sw.Mesh(pp=cfg.world)
        # Our default cut (balanced parameter counts), made explicit so torch can use the same one.
        balanced = sw.pipeline(step, "pp", schedule, cfg.microbatches, stages=stages).layout(mesh, params)
        self.stages: tuple[tuple[str, ...], ...] = balanced.placement.stages
        self.stage_rank: tuple[int, ...] = balanced.placement.stage_rank
        self.step_fn = sw.pipeline(step, "pp", schedule, cfg.microbatches, stages=stages,
                                   partition=[len(s) for s in self.stages], trace=True)
        if quiet:
            self.step_fn = self.step_fn.with_metrics(())
        self.state = self.step_fn.init(params, mesh)
        self.events: list[list[tuple[int, str, float, float]]] = []  # per step, this rank's compute events
        self.param_count = sum(t.numel() for layer in self.state.params.values() for t in layer.values())

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        self.state, metrics = self.step_fn(self.state, batch)
        self.events.append(list(metrics["trace"]))
        return metrics["loss"].detach() if "loss" in metrics else None


class TorchPipe:
    """torch.distributed.pipelining on the same stages; rank 0 feeds inputs, the last rank the targets."""

    def __init__(self, cfg: Config, schedule: str, stages: tuple[tuple[str, ...], ...],
                 stage_rank: tuple[int, ...]) -> None:
        from torch.distributed import pipelining

        rank = dist.get_rank()
        pieces = torch_layers(cfg, build_model(cfg))
        mine = [s for s in range(len(stages)) if stage_rank[s] == rank]  # our placement (loop, or ZB-V's V)
        self.modules = [nn.Sequential(*(pieces[name] for name in stages[s])) for s in mine]
        pipe_stages = [
            pipelining.PipelineStage(module, s, len(stages), torch.device("cpu"))
            for module, s in zip(self.modules, mine, strict=True)
        ]
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        loss_fn = loss_fn_of(cfg.model)
        if VIRTUAL_STAGES[schedule] > 1:
            self.schedule = cls(pipe_stages, cfg.microbatches, loss_fn=loss_fn)
        else:
            (only,) = pipe_stages
            self.schedule = cls(only, cfg.microbatches, loss_fn=loss_fn)
        self.opt = torch_adamw([p for m in self.modules for p in m.parameters()])
        # Each compute timed as ours are, to compare op times and hand-overs (see the docstring).
        self.events: list[list[tuple[int, str, float, float]]] = []  # per step, this rank's compute events
        for pipe_stage in pipe_stages:
            self._time_computes(pipe_stage, rank)
        self.first = 0 in mine
        self.last = len(stages) - 1 in mine
        self.param_count = sum(p.numel() for m in self.modules for p in m.parameters())

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        x, y = batch
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        self.events.append([])
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.opt.step()
        # Freed here, not at the next step's start: between steps neither library holds gradients, so that a
        # step's peak above its starting RSS (``step_peak_mib``) counts torch's as it counts ours.
        self.opt.zero_grad(set_to_none=True)
        return torch.stack([loss.detach() for loss in losses]).mean() if self.last else None

    def _time_computes(self, pipe_stage: Any, rank: int) -> None:
        """Record (rank, "<stage>F<mb>" or "<stage>B<mb>", start, end) for each of the stage's
        forwards and backwards ("I" and "W" where a zero-bubble schedule splits a backward), by
        wrapping the public methods the schedules call on it."""
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
            method = getattr(pipe_stage, name)

            def timed_compute(chunk: int, *args: Any, _method: Any = method, _kind: str = kind, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = _method(chunk, *args, **kwargs)
                # backward_one_chunk(..., full_backward=False) computes the input's gradient alone: an I.
                op = "I" if _kind == "B" and kwargs.get("full_backward", True) is False else _kind
                self.events[-1].append((rank, f"{pipe_stage.stage_index}{op}{chunk}", start, time.perf_counter()))
                return out

            setattr(pipe_stage, name, timed_compute)


Runner = Ours | TorchPipe


def build_runners(cfg: Config) -> tuple[dict[str, Runner], dict[str, str], dict[str, Any]]:
    """Every variant of this (model, world), or the reason it could not be built."""
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    stages_of: dict[str, Any] = {}
    for schedule in cfg.schedules:
        ours_name, torch_name = variant_name("ours", schedule), variant_name("torch", schedule)
        try:  # refusals are the same on every rank: nothing was issued yet
            ours = Ours(cfg, schedule)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            skipped[ours_name] = skipped[variant_name("ours_quiet", schedule)] = reason
            skipped[torch_name] = f"no common split (sw.pipeline refused it: {reason})"
            continue
        if "ours" in cfg.impls:
            runners[ours_name] = ours
        if "ours_quiet" in cfg.impls:
            runners[variant_name("ours_quiet", schedule)] = Ours(cfg, schedule, quiet=True)
        stages_of[schedule] = ours.stages
        if "torch" not in cfg.impls:
            continue
        try:
            runners[torch_name] = TorchPipe(cfg, schedule, ours.stages, ours.stage_rank)
        except Exception as exc:
            skipped[torch_name] = f"{type(exc).__name__}: {exc}"
        else:
            if runners[torch_name].param_count != ours.param_count:  # the same layers on this rank
                raise AssertionError(f"{schedule}: torch holds {runners[torch_name].param_count} parameters "
                                     f"on rank {dist.get_rank()}, ours {ours.param_count}")
    return runners, skipped, stages_of


# -- what runs on every rank ----------------------------------------------------------------
def bench_rank(cfg: Config) -> dict[str, Any]:
    """Build every variant, step them round-robin, return per-variant timings, losses and traces."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    batches = batches_of(cfg)
    runners, skipped, stages_of = build_runners(cfg)
    faults: dict[str, list[int]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)

    peaks: dict[str, list[int]] = defaultdict(list)
    live = malloc_now() == "live"  # (the figure follows live memory only there; elsewhere not measured)

    def counted_step(name: str, i: int, batch: Any) -> Any:
        before, cpu_before = minor_faults(), time.process_time()
        if live:
            resident = reset_peak_rss()
        out = runners[name].step(batch)
        if i >= cfg.warmup:
            faults[name].append(minor_faults() - before)
            cpu[name].append(time.process_time() - cpu_before)
            if live:
                peaks[name].append(status_bytes("VmHWM") - resident)
        return out

    times, outputs = round_robin(runners, batches, cfg.warmup, counted_step)
    # Torch's loss exists only on the last stage's rank (None elsewhere).
    losses = {name: [loss.item() for loss in out if loss is not None] for name, out in outputs.items()}
    result: dict[str, Any] = {
        "times": times,
        "faults": dict(faults),
        "cpu": dict(cpu),
        "peaks": dict(peaks),
        "losses": losses,
        "events": {name: r.events[cfg.warmup:] for name, r in runners.items()},
        "skipped": skipped,
        "stages": stages_of,
        "quiet_same_params": {schedule: same_params(runners, schedule) for schedule in stages_of},
    }
    if cfg.profile in runners:
        result["profile"] = profile_steps(runners[cfg.profile].step, batches, cfg.profile_steps,
                                          rank == min(cfg.profile_rank, cfg.world - 1),
                                          [("tottime", (30,)), ("cumulative", (40,))])
    return result


def same_params(runners: dict[str, Runner], schedule: str) -> bool | None:
    """Whether the quiet step left this rank's parameters bitwise equal to the reporting one's
    (the same updates on the same batches; ``None`` unless both ran)."""
    loud, quiet = runners.get(variant_name("ours", schedule)), runners.get(variant_name("ours_quiet", schedule))
    if not isinstance(loud, Ours) or not isinstance(quiet, Ours):
        return None
    mine, theirs = loud.state.params, quiet.state.params
    return all(torch.equal(t, theirs[layer][k]) for layer, tensors in mine.items() for k, t in tensors.items())


# -- the parent: bubbles, rows, printing ---------------------------------------------------------
def bubble_figures(cfg: Config, schedule_name: str, stages: int, per_step: list[list[tuple]]) -> dict[str, Any]:
    """Measured bubble (median over steps) against the simulator's, with unit and measured costs."""
    schedule = get_schedule(schedule_name, cfg.world, stages, cfg.microbatches)
    expected = sorted(str(op) for ops in schedule.ranks for op in ops)
    for events in per_step:  # every op of the schedule timed once, or the figures would mislead
        if sorted(op for _, op, _, _ in events) != expected:
            raise AssertionError(f"{schedule_name}: the timed computes of a step are not the schedule's ops")
    timelines = [Timeline.from_measured(schedule, events) for events in per_step]
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_stage: dict[tuple[int, str], list[float]] = defaultdict(list)
    for timeline in timelines:
        for row in timeline.ranks:
            for slot in row:
                by_kind[slot.op.kind].append(slot.end - slot.start)
                by_stage[(slot.op.stage, slot.op.kind)].append(slot.end - slot.start)
    kind_means = {k: statistics.fmean(v) for k, v in by_kind.items()}
    stage_means = {k: statistics.fmean(v) for k, v in by_stage.items()}
    handover, local_gap = gaps(schedule, timelines)
    kind_sim = simulate(schedule, Costs.from_mapping(kind_means))
    stage_sim = simulate(schedule, Costs(per_stage=stage_means))
    comm = statistics.median(handover) if handover else 0.0
    comm_sim = simulate(schedule, Costs(per_stage=stage_means, comm=max(comm, 0.0)))
    return {
        "bubble_measured": round(statistics.median(t.bubble_fraction for t in timelines), 4),
        "bubble_sim_unit": round(simulate(schedule).bubble_fraction, 4),
        "bubble_sim_kind_costs": round(kind_sim.bubble_fraction, 4),
        "bubble_sim_stage_costs": round(stage_sim.bubble_fraction, 4),
        "bubble_sim_stage_costs_comm": round(comm_sim.bubble_fraction, 4),
        "mean_op_ms": {k: round(v * 1e3, 3) for k, v in sorted(kind_means.items())},
        "trace_makespan_s": round(statistics.median(t.makespan for t in timelines), 5),
        "sim_makespan_s": round(stage_sim.makespan, 5),
        "sim_makespan_comm_s": round(comm_sim.makespan, 5),
        "handover_ms": round(statistics.median(handover) * 1e3, 3) if handover else None,
        "local_gap_ms": round(statistics.median(local_gap) * 1e3, 3) if local_gap else None,
    }


def gaps(schedule: Any, timelines: list[Timeline]) -> tuple[list[float], list[float]]:
    """Idle time before a compute, split by its cause.

    ``handover``: the rank was idle when the input it waited for (its latest
    dependency, computed on another rank) finished; from then to the start is
    the cost of handing the value over (send, transfer, receive). ``local``:
    the inputs were ready before the rank's previous compute ended; the gap is
    the rank's own work between two computes (sends, receives, bookkeeping).
    """
    handover: list[float] = []
    local: list[float] = []
    for timeline in timelines:
        end = {slot.op: slot.end for row in timeline.ranks for slot in row}
        for rank, row in enumerate(timeline.ranks):
            for k, slot in enumerate(row):
                deps = [d for d in schedule.dependencies(slot.op) if d in end]
                ready_op = max(deps, key=end.__getitem__, default=None)
                ready = end[ready_op] if ready_op is not None else float("-inf")
                previous = row[k - 1].end if k else float("-inf")
                if ready_op is not None and schedule.placement[ready_op.stage] != rank and ready >= previous:
                    handover.append(slot.start - ready)
                elif k:
                    local.append(slot.start - previous)
    return handover, local


def rows_for(cfg: Config, per_rank: list[dict[str, Any]], ref: list[float]) -> list[dict[str, Any]]:
    """One output object per (schedule, impl), aggregated over ranks."""
    base = {
        "bench": "pipeline",
        "model": cfg.model,
        "world": cfg.world,
        "microbatches": cfg.microbatches,
        "global_batch": cfg.batch,
        **({"mlp_hidden": cfg.mlp_hidden} if cfg.model == "mlp" else {}),
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "optimizer": "adamw",
        **environment(threads_per_rank=1),
    }
    first = per_rank[0]
    medians = {name: median_of_max(r["times"][name] for r in per_rank) for name in first["times"]}
    # The loss: ours has the global loss on every rank; torch's only on the last rank; ours_quiet none.
    losses = {name: next((r["losses"][name] for r in per_rank if r["losses"][name]), None) for name in first["times"]}
    rows = []
    for schedule in cfg.schedules:
        for impl in cfg.impls:
            name = variant_name(impl, schedule)
            row: dict[str, Any] = {**base, "schedule": schedule, "impl": impl,
                                   "stages": cfg.world * VIRTUAL_STAGES[schedule]}
            if name in first["skipped"]:
                rows.append({**row, "skipped": first["skipped"][name]})
                continue
            torch_name = variant_name("torch", schedule)
            reference = medians.get(torch_name)
            row |= {
                "partition": [list(s) for s in first["stages"][schedule]],
                "median_step_s": round(medians[name], 5),
                "min_step_s": round(min(slowest_per_step(r["times"][name] for r in per_rank)), 5),
                "minor_faults_per_step": [int(statistics.median(r["faults"][name])) for r in per_rank],
                "cpu_ms_per_step": [round(1e3 * statistics.median(r["cpu"][name]), 2) for r in per_rank],
                **({"step_peak_mib": [round(statistics.median(r["peaks"][name]) / 2**20, 2) for r in per_rank]}
                   if first["peaks"] else {}),
                "ratio_to_torch": round(medians[name] / reference, 3) if reference else None,
                "paired_ratio_to_torch": round(paired_ratio_median(
                    [r["times"][name] for r in per_rank], [r["times"][torch_name] for r in per_rank]
                ), 3) if reference else None,
            }
            found = losses[name]
            if found is not None:
                row |= {
                    "first_loss": round(found[0], 6),
                    "max_rel_loss_diff": max_rel_diff(found, ref),
                    "final_loss": round(found[-1], 5),
                }
            else:  # quiet: checked instead against the reporting step's parameters on every rank
                checks = [r["quiet_same_params"][schedule] for r in per_rank]
                row["params_equal_to_ours"] = None if None in checks else all(checks)
            if impl.startswith("ours") and found is not None and losses.get(torch_name) is not None:
                row["first_loss_rel_diff_vs_torch"] = rel_diff(found[0], losses[torch_name][0])
            steps = zip(*(r["events"][name] for r in per_rank), strict=True)
            # torch's ops are its own schedule's (1F1B's where ours is ZB-H1)
            ops_of = TORCH_OPS_AS.get(schedule, schedule) if impl == "torch" else schedule
            row |= bubble_figures(
                cfg, ops_of, row["stages"], [[e for events in step for e in events] for step in steps]
            )
            rows.append(row)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, steps=10, warmup=3)
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                        help=f"comma-separated, of {', '.join(SCHEDULES)} (default {', '.join(DEFAULT_SCHEDULES)})")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="micro-batches per step, a multiple of every world for interleaved_1f1b (default 4)")
    add_batch_flags(parser)
    parser.add_argument("--mlp-hidden", type=int, default=MLP_HIDDEN,
                        help=f"the MLP's width (default {MLP_HIDDEN}); a small one, say 16, leaves mostly each "
                             "library's per-step overhead: messages, bookkeeping, the optimizer's calls")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated, of {', '.join(IMPLS)} (default all); ours_quiet is ours "
                             "reporting no metrics, the same work as torch's schedules")
    parser.add_argument("--profile", metavar="IMPL:SCHEDULE",
                        help="cProfile this variant (e.g. ours:1f1b) on --profile-rank after the timed steps")
    parser.add_argument("--profile-rank", type=int, default=0)
    parser.add_argument("--profile-steps", type=int, default=5)
    add_malloc_flag(parser)
    add_out_flag(parser)
    args = parser.parse_args(argv)
    if args.mlp_hidden < 1:
        parser.error(f"--mlp-hidden {args.mlp_hidden}: the MLP needs a positive width")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step infers torch's stage shapes)")
    args.schedules = picked(parser, "--schedules", args.schedules, SCHEDULES)
    args.impls = picked(parser, "--impls", args.impls, IMPLS)
    if args.profile and args.profile.partition(":")[::2] not in {(i, s) for i in IMPLS for s in SCHEDULES}:
        parser.error(f"--profile {args.profile!r}: use IMPL:SCHEDULE, e.g. ours:1f1b or torch:gpipe")
    for batch in (args.mlp_batch, args.gpt_batch):
        if batch % args.microbatches:
            parser.error(f"batch {batch} does not divide into {args.microbatches} micro-batches")
    return args


def picked(parser: argparse.ArgumentParser, flag: str, value: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """The comma-separated names of ``value``, in ``known``'s order; an unknown one is a usage error."""
    names = set(value.split(","))
    if names - set(known):
        parser.error(f"{flag}: unknown {sorted(names - set(known))}; choose from {', '.join(known)}")
    return tuple(name for name in known if name in names)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    schedules, impls = args.schedules, args.impls
    refs: dict[str, list[float]] = {}

    def measure(pool: ProcessPool, world: int, model: str, batch: int) -> list[dict[str, Any]]:
        cfg = Config(model, world, args.steps, args.warmup, batch, args.microbatches, schedules,
                     mlp_hidden=args.mlp_hidden, profile=args.profile, profile_rank=args.profile_rank,
                     profile_steps=args.profile_steps, impls=impls)
        if model not in refs:  # the reference does not depend on the world
            refs[model] = reference_losses(build_model(cfg), loss_fn_of(model), batches_of(cfg))
        per_rank = run_on_ranks(pool, bench_rank, cfg, label=f"{model}, world {world}")
        profile = per_rank[min(args.profile_rank, world - 1)].get("profile")
        if profile:
            note(f"--- cProfile of {args.profile}, {model}, world {world}, rank {args.profile_rank} ---\n{profile}")
        return rows_for(cfg, per_rank, refs[model])

    return sweep(args, measure)


if __name__ == "__main__":
    main()
