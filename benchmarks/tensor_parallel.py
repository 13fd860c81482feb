"""tensor_parallel against torch's own DTensor tensor parallel, side by side on gloo processes.

Run it from the repository root:

    python benchmarks/tensor_parallel.py                        # defaults: about 3 minutes on 2 cores
    python benchmarks/tensor_parallel.py --steps 30 --warmup 3 --worlds 2,4 --sp off,on --out tp.jsonl
    python benchmarks/tensor_parallel.py --worlds 2 --sp on --profile ours   # + a cProfile of rank 0 (stderr)

What is measured
----------------
Model: a Hugging Face ``LlamaForCausalLM`` built from a config (random init, seeded, no
download): ``--hidden 256``, ``--layers 4``, ``--heads 8``, ``--kv-heads 4`` (grouped-query
attention), ``--intermediate 688``, ``--vocab 1024``, sequences of ``--seq 128`` tokens,
``--batch 8`` sequences, SDPA attention, untied head, next-token cross-entropy. Every rank
builds it from the same seed, so both variants start from the same weights.

Variants, float32, SGD (lr 0.01, momentum 0.9), the same global batch on every rank:

* ``ours``: ``sw.tensor_parallel(step, "tp", sw.tp.llama_plan(), sequence_parallel=LLAMA_BLOCKS
  or None)`` over ``sw.functionalize(model, units=LlamaDecoderLayer)``, ``sw.optim.sgd``; the
  loss is ``sw.tp.vocab_parallel_cross_entropy`` (the head leaves the logits split). The step's
  metrics are only the loss (no gradient norm, which torch does not compute either).
* ``torch``: ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D CPU
  ``DeviceMesh`` (gloo) with torchtitan's Llama plan on the same module names: q/k/v and
  gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``, the embedding ``RowwiseParallel``
  (vocabulary split), ``lm_head`` ``ColwiseParallel`` with ``Shard(-1)`` logits and the loss
  under ``loss_parallel()``; with sequence parallel: the norms ``SequenceParallel``, attention
  and MLP inputs ``PrepareModuleInput`` (``Shard(1)`` to ``Replicate``), o/down and the
  embedding output ``Shard(1)``, the residual stream a ``DTensor`` sharded on the sequence;
  without it, attention and MLP take their input through ``PrepareModuleInput`` (``Replicate``
  to ``Replicate``), so the gradients q, k, v (gate, up) give it are all-reduced once, not once
  per projection. ``torch.optim.SGD`` (same hyper-parameters) on the DTensor parameters.

Every tp size runs in one :class:`~shardwise.collectives.processes.ProcessPool` (gloo, one
process per rank, ``torch.set_num_threads(1)``); both sequence-parallel settings run in it, one
after the other. Inside a rank both variants are built and stepped round-robin (step i of
each, the order rotating, then step i + 1), each step after a ``dist.barrier()``.

How to read the output
----------------------
One JSON object per (tp, sequence_parallel, variant):

* ``median_step_s``: median over the timed steps (after ``warmup``) of the slowest rank's
  step; ``ratio_to_torch`` = ours / torch's median (> 1: slower than torch);
  ``paired_ratio_to_torch``: the median over steps of ours / torch's in the same round.
* ``param_bytes_per_rank``: bytes of the parameters one rank holds (largest over ranks);
  ours: ``tree_nbytes(state.params)`` (and ``plan_param_bytes_per_rank``, the Plan's figure);
  torch: the local shards of the DTensor parameters plus the plain (replicated) ones.
* ``sent_bytes_per_step``: bytes one rank sends in one step (largest over ranks), counted
  with one accounting for both (``shardwise.collectives.ledger.algorithm_sent_bytes``: ring
  all-reduce ``2 B (n-1)/n``, all-gather ``(n-1) B``, reduce-scatter ``B (n-1)/n``). Ours
  from ``sw.collectives.comm_ledger()`` over the last warm-up step; torch from every functional
  collective DTensor issues in that step, seen by a ``TorchDispatchMode`` (forward and
  backward: the sizes of the tensors handed to gloo). ``sent_bytes_by_op``: rank 0's per op
  (``psum`` = all-reduce, ``all_gather``, ``psum_scatter`` = reduce-scatter): count, input
  bytes, sent bytes. ``uncounted_ops`` (torch, only when there are any): c10d ops seen that
  are not one of those collectives, so their bytes are missing from the count.
  Ours also gives ``plan_matches_ledger``: the Plan's listed input bytes per (axis, op)
  equal what the ledger recorded.
* ``max_abs_loss_diff``, ``final_loss_diff``: ours against torch's loss, step by step, from
  the same initial weights and batches (float32; the same maths in a different order of
  summation, so expect ~1e-6, not 0); ``final_loss``.
* ``cores``, ``loadavg_1m``: the machine; at tp 4 on 2 cores the ranks share cores.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    POOL_TIMEOUT_S,
    add_malloc_flag,
    add_out_flag,
    add_worlds_flag,
    environment,
    json_lines,
    malloc_mode,
    median_of_max,
    note,
    paired_ratio_median,
    profile_steps,
    round_robin,
    run_on_ranks,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.collectives.ledger import algorithm_sent_bytes
from shardwise.engine.layout.state import tree_nbytes
from shardwise.transforms.tensor_parallel import LLAMA_BLOCKS

VARIANTS = ("ours", "torch")
LR, MOMENTUM = 0.01, 0.9
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Config:
    """One (tp, sequence_parallel) run; travels to every rank."""

    tp: int
    sequence_parallel: bool
    steps: int
    warmup: int
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 688
    vocab: int = 1024
    seq: int = 128
    batch: int = 8
    seed: int = 0
    profile: str | None = None  # a variant to cProfile on rank 0 after the timed steps
    profile_steps: int = 5


# -- model and data ------------------------------------------------------------------------
def build_model(cfg: Config) -> nn.Module:
    """The seeded tiny Llama (identical in every process)."""
    import transformers

    options: dict[str, Any] = {"attn_implementation": "sdpa"}  # a PretrainedConfig keyword its stubs omit
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, **options,
    )
    torch.manual_seed(cfg.seed)
    return transformers.LlamaForCausalLM(config)


def decoder_layer_class() -> type[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def batches_of(cfg: Config) -> list[Batch]:
    """``warmup + steps`` global batches (input ids, next-token targets), the same in every process."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    out = []
    for _ in range(cfg.warmup + cfg.steps):
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position (torch's side; under ``loss_parallel``)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def ours_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """The same loss on our side: the head's logits stay split over tp."""
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


# -- ours --------------------------------------------------------------------------------------
class Ours:
    """``sw.tensor_parallel`` with the ready Llama plan."""

    def __init__(self, cfg: Config) -> None:
        model = build_model(cfg)
        example = batches_of(cfg)[0]
        chain, params = sw.functionalize(model, units=decoder_layer_class(), example_input=example[0])
        step = sw.train_step(chain, ours_loss, sw.optim.sgd(LR, momentum=MOMENTUM, inplace=True), metrics=("loss",))
        blocks = LLAMA_BLOCKS if cfg.sequence_parallel else None
        self.step_fn = sw.tensor_parallel(step, "tp", sw.tp.llama_plan(), sequence_parallel=blocks)
        mesh = sw.Mesh(tp=cfg.tp)
        self.plan = self.step_fn.plan(mesh, params, example)
        self.state = self.step_fn.init(params, mesh)

    def step(self, batch: Batch) -> torch.Tensor:
        self.state, metrics = self.step_fn(self.state, batch)
        return metrics["loss"].detach()

    def param_bytes(self) -> int:
        return tree_nbytes(self.state.params)


# -- torch's DTensor tensor parallel ------------------------------------------------------------
def torch_plan(sequence_parallel: bool) -> dict[str, Any]:
    """torchtitan's Llama plan (``parallelize_llama``'s ``apply_tp``) on Hugging Face's module names.

    Differences from torchtitan forced by Hugging Face's code: the embedding's output stays a
    ``DTensor`` under sequence parallel (``use_local_output=False``), because ``LlamaModel``
    derives the positions, the rotary tables and the causal mask from its shape (a local
    tensor would have a sequence ``tp`` times too short); so does the residual stream (the
    o/down projections' outputs), since a ``DTensor`` and a plain tensor cannot be added.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    layers = "model.layers.*"
    plan: dict[str, Any] = {
        f"{layers}.self_attn.q_proj": ColwiseParallel(),
        f"{layers}.self_attn.k_proj": ColwiseParallel(),
        f"{layers}.self_attn.v_proj": ColwiseParallel(),
        f"{layers}.mlp.gate_proj": ColwiseParallel(),
        f"{layers}.mlp.up_proj": ColwiseParallel(),
    }
    if not sequence_parallel:
        # The attention's and the MLP's input enter as one replicated DTensor, so the gradients
        # that q, k, v (gate, up) give it are summed locally and all-reduced once (Megatron's f),
        # not once per projection, as a plain ColwiseParallel on each would.
        enter_once = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan.update({
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            f"{layers}.self_attn": enter_once,
            f"{layers}.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            f"{layers}.self_attn.o_proj": RowwiseParallel(),
            f"{layers}.mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
        return plan
    plan.update({
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        f"{layers}.input_layernorm": SequenceParallel(),
        f"{layers}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        f"{layers}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        f"{layers}.post_attention_layernorm": SequenceParallel(),
        f"{layers}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{layers}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    return plan


class TorchTP:
    """The same model under ``parallelize_module``; the loss and its backward under ``loss_parallel``."""

    def __init__(self, cfg: Config) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (cfg.tp,), mesh_dim_names=("tp",))
        self.model = parallelize_module(build_model(cfg), mesh, torch_plan(cfg.sequence_parallel))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)

    def step(self, batch: Batch) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = lm_loss(self.model(input_ids=x).logits, y)
            loss.backward()
        self.opt.step()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return loss.detach()

    def param_bytes(self) -> int:
        total = 0
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
        return total


# -- torch's collectives, counted as our ledger counts ------------------------------------------
def _funcol_ops() -> dict[Any, str]:
    """The functional collectives DTensor issues, by our op names."""
    native = torch.ops._c10d_functional
    return {
        native.all_reduce.default: "psum",
        native.all_gather_into_tensor.default: "all_gather",
        native.reduce_scatter_tensor.default: "psum_scatter",
        native.all_to_all_single.default: "all_to_all",
    }


NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # c10d_functional ops that move nothing


class CollectiveCounter(TorchDispatchMode):
    """Every functional collective run inside (forward and backward), with the bytes this rank
    sends under the same ring accounting as our ledger; any other c10d op is listed apart."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.ops = _funcol_ops()
        self.sent: dict[str, list[int]] = {}  # op -> [count, input bytes, sent bytes]
        self.uncounted: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run and lower to the collectives, which come back here
        kwargs = kwargs or {}
        op = self.ops.get(func)
        if op is not None:
            tensor = args[0]
            sent = algorithm_sent_bytes(op, numel=tensor.numel(), itemsize=tensor.element_size(),
                                        group_size=self.world, index=self.rank)
            entry = self.sent.setdefault(op, [0, 0, 0])
            entry[0] += 1
            entry[1] += tensor.numel() * tensor.element_size()
            entry[2] += sent
        elif getattr(func, "namespace", "") in ("c10d", "_c10d_functional") and not any(
                name in str(func) for name in NOT_COLLECTIVES):
            self.uncounted.add(str(func))
        return func(*args, **kwargs)


# -- what runs on every rank ----------------------------------------------------------------------
def bench_rank(cfg: Config) -> dict[str, Any]:
    """Build both variants, step them round-robin; timings, losses, bytes."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = batches_of(cfg)
    runners: dict[str, Ours | TorchTP] = {"ours": Ours(cfg), "torch": TorchTP(cfg)}
    wire: dict[str, dict[str, list[int]]] = {}
    uncounted: list[str] = []
    ledger_in: dict[str, int] = {}

    def step(name: str, i: int, batch: Batch) -> torch.Tensor:
        runner = runners[name]
        if i != cfg.warmup - 1:  # the last warm-up step is the counted one
            return runner.step(batch)
        if isinstance(runner, Ours):
            with sw.collectives.comm_ledger() as ledger:
                loss = runner.step(batch)
            wire[name] = {f"{axis}:{op}": [s.count, s.nbytes, s.sent_bytes_per_rank.get(rank, 0)]
                          for (axis, op), s in ledger.summary().items()}
            ledger_in.update({key: counts[1] for key, counts in wire[name].items()})
            return loss
        with CollectiveCounter(rank, world) as counter:
            loss = runner.step(batch)
        wire[name] = {f"tp:{op}": counts for op, counts in counter.sent.items()}
        uncounted.extend(sorted(counter.uncounted))
        return loss

    times, losses = round_robin(runners, batches, cfg.warmup, step)
    ours = runners["ours"]
    assert isinstance(ours, Ours)
    plan_in = {f"{axis}:{op}": per_rank[rank] for (axis, op), per_rank in ours.plan.comm_bytes().items() if per_rank[rank]}
    result: dict[str, Any] = {
        "times": times,
        "losses": {name: [float(loss) for loss in ls] for name, ls in losses.items()},
        "param_bytes": {name: r.param_bytes() for name, r in runners.items()},
        "plan_param_bytes": plan_param_bytes(ours.plan, rank),
        "wire": wire,
        "plan_matches_ledger": plan_in == ledger_in,
        "torch_uncounted_ops": uncounted,
    }
    if cfg.profile in runners:
        result["profile"] = profile_steps(runners[cfg.profile].step, batches, cfg.profile_steps, rank == 0,
                                          [("tottime", (30,)), ("cumulative", (40,))])
    return result


def plan_param_bytes(plan: Any, rank: int) -> int | None:
    """The Plan's parameter bytes of ``rank`` (None where the Plan has no such figure)."""
    per_rank = plan.memory.get("params")
    return None if per_rank is None else int(per_rank[rank])


# -- the parent: run, aggregate, print -----------------------------------------------------------
def rows_for(cfg: Config, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One output object per variant, aggregated over ranks."""
    base = {
        "bench": "tensor_parallel",
        "model": f"llama(h={cfg.hidden}, layers={cfg.layers}, heads={cfg.heads}/{cfg.kv_heads}, "
                 f"vocab={cfg.vocab}, seq={cfg.seq})",
        "tp": cfg.tp,
        "sequence_parallel": cfg.sequence_parallel,
        "global_batch": cfg.batch,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        **environment(threads_per_rank=1),
    }
    times = {name: [r["times"][name] for r in per_rank] for name in VARIANTS}
    medians = {name: median_of_max(times[name]) for name in VARIANTS}
    ours_losses, torch_losses = per_rank[0]["losses"]["ours"], per_rank[0]["losses"]["torch"]
    diffs = [abs(a - b) for a, b in zip(ours_losses, torch_losses, strict=True)]
    rows = []
    for name in VARIANTS:
        wire = [r["wire"][name] for r in per_rank]
        row = {
            **base,
            "variant": name,
            "median_step_s": round(medians[name], 5),
            "ratio_to_torch": round(medians[name] / medians["torch"], 3),
            "paired_ratio_to_torch": round(paired_ratio_median(times[name], times["torch"]), 3),
            "param_bytes_per_rank": max(r["param_bytes"][name] for r in per_rank),
            "sent_bytes_per_step": max(sum(c[2] for c in w.values()) for w in wire),
            "sent_bytes_by_op": {op: {"count": c[0], "in_bytes": c[1], "sent_bytes": c[2]}
                                 for op, c in sorted(wire[0].items())},
            "max_abs_loss_diff": float(f"{max(diffs):.3g}"),
            "final_loss_diff": float(f"{diffs[-1]:.3g}"),
            "final_loss": round((ours_losses if name == "ours" else torch_losses)[-1], 6),
        }
        if name == "ours":
            row["plan_param_bytes_per_rank"] = max((r["plan_param_bytes"] or 0) for r in per_rank) or None
            row["plan_matches_ledger"] = all(r["plan_matches_ledger"] for r in per_rank)
        else:
            uncounted = sorted({op for r in per_rank for op in r["torch_uncounted_ops"]})
            if uncounted:
                row["uncounted_ops"] = uncounted
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, >= 1; the last is counted")
    add_worlds_flag(parser)
    parser.add_argument("--sp", default="off,on", help="sequence parallel settings to run: off, on (default both)")
    for field, default in (("hidden", 256), ("layers", 4), ("heads", 8), ("kv-heads", 4), ("intermediate", 688),
                           ("vocab", 1024), ("seq", 128), ("batch", 8)):
        parser.add_argument(f"--{field}", type=int, default=default, help=f"model / batch size (default {default})")
    parser.add_argument("--profile", choices=VARIANTS, help="cProfile this variant on rank 0 (to stderr)")
    parser.add_argument("--profile-steps", type=int, default=5)
    add_malloc_flag(parser)
    add_out_flag(parser)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--steps and --warmup must be >= 1 (the last warm-up step is the counted one)")
    sp = args.sp.split(",")
    if not sp or any(s not in ("off", "on") for s in sp):
        parser.error(f"--sp {args.sp!r}: a comma-separated list of off and on")
    return args


def configs(args: argparse.Namespace, tp: int) -> Iterator[Config]:
    for sp in args.sp.split(","):
        yield Config(tp, sp == "on", args.steps, args.warmup, hidden=args.hidden, layers=args.layers,
                     heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
                     seq=args.seq, batch=args.batch, profile=args.profile, profile_steps=args.profile_steps)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    with json_lines(args.out) as emit, malloc_mode(args.malloc):
        for tp in (int(w) for w in args.worlds.split(",")):
            with ProcessPool(tp, timeout=POOL_TIMEOUT_S) as pool:
                for cfg in configs(args, tp):
                    label = f"tp {tp}, sequence parallel {'on' if cfg.sequence_parallel else 'off'}"
                    per_rank = run_on_ranks(pool, bench_rank, cfg, label=label)
                    if per_rank[0].get("profile"):
                        note(f"--- cProfile of {args.profile}, {label}, rank 0 ---\n" + per_rank[0]["profile"])
                    for row in rows_for(cfg, per_rank):
                        emit(row)
                        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
