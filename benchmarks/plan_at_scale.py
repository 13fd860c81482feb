"""A Llama-3-70B-shaped Plan on paper: ``functionalize`` and ``step.plan`` at 512 ranks, on one CPU.

Run it from the repository root:

    python benchmarks/plan_at_scale.py                        # both stacks, the 70B shape
    python benchmarks/plan_at_scale.py --layers 16 --hidden 1024 --out plan.jsonl

What is measured
----------------
An unmodified Hugging Face ``LlamaForCausalLM`` from ``LlamaConfig(hidden_size=8192,
intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
vocab_size=128256)`` (70.6e9 parameters) is built under ``torch.device("meta")`` (no memory),
split per ``LlamaDecoderLayer`` by ``sw.functionalize`` (an example of 1 x 8 tokens) and planned
with AdamW and a batch of ``--seq`` tokens per sequence:

* ``zero3``: ``shard_params(stage=3)`` over ``Mesh(dp=512)``, one sequence per rank;
* ``3d``: ``tensor_parallel(llama_plan(), sequence_parallel)``, ``pipeline(1f1b, 8 micro-batches)``,
  ``shard_params(stage=3)``, ``mixed_precision("params=f32,compute=bf16,output=f32")`` over
  ``Mesh(dp=8, pp=8, tp=8)``, one sequence per micro-batch.

Each stack runs in a process of its own, so its high-water mark is its own: ``peak_rss_bytes`` is
the process's VmHWM (interpreter, torch and transformers included), ``baseline_rss_bytes`` its
VmRSS after the imports. Wall seconds: ``build_s`` (the meta model), ``functionalize_s``,
``plan_s`` (``step.plan(mesh, params, batch)``).

Output: one JSON line per stack with the Plan's memory figures for rank 0 and the largest over
ranks (``rank0``, ``max``: params, grads, opt_state, gathered_peak, reduce_buffers, comm_buffers,
kept_for_backward, peak), and the published estimates beside them: ``formula_model_state_bytes``
= 16 bytes per parameter (fp32 master + fp32 grad + two fp32 Adam moments; the ZeRO paper counts
2 + 2 + 12 for mixed precision) divided by the shard count (dp for ZeRO-3 alone, dp x pp x tp for
3-D), and ``formula_activation_bytes``: Korthikanti et al. 2022, per layer s*b*h*(34 + 5*a*s/h)
bytes without recompute, divided by t under tensor + sequence parallel, times the layers a rank
holds and, under 1F1B, the micro-batches in flight on the first stage (pp).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

STACKS = ("zero3", "3d")
FIGURES = ("params", "grads", "opt_state", "gathered_peak", "reduce_buffers", "comm_buffers",
           "kept_for_backward", "peak")


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(stack: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, functionalize and plan one stack in this process; the JSON row."""
    import torch
    import transformers as T
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import shardwise as sw
    from shardwise.transforms.tensor_parallel import LLAMA_BLOCKS

    baseline = _vm("VmRSS")
    config = T.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 8),
    )
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    t1 = time.perf_counter()
    example = torch.zeros((1, 8), dtype=torch.long)  # the split is recorded on it
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=example)
    t2 = time.perf_counter()

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)

    step = sw.train_step(chain, loss, sw.optim.adamw(3e-4))
    if stack == "zero3":
        mesh = sw.Mesh(dp=args.ranks)
        step = sw.shard_params(step, "dp", stage=3)
        sequences, shards, t, pp, layers_held = args.ranks, args.ranks, 1, 1, args.layers
    else:
        side = round(args.ranks ** (1 / 3))
        mesh = sw.Mesh(dp=side, pp=side, tp=side)
        step = sw.tensor_parallel(step, "tp", sw.tp.llama_plan(), sequence_parallel=LLAMA_BLOCKS)
        step = sw.pipeline(step, "pp", "1f1b", microbatches=args.microbatches)
        step = sw.shard_params(step, "dp", stage=3)
        step = sw.mixed_precision(step, "params=f32,compute=bf16,output=f32")
        sequences, shards, t, pp, layers_held = side * args.microbatches, side ** 3, side, side, args.layers // side
    ids = torch.zeros((sequences, args.seq), dtype=torch.long)
    plan = step.plan(mesh, params, (ids, ids))
    t3 = time.perf_counter()
    n_params = sum(p.numel() for d in params.values() for p in d.values())
    s, b, h, a = args.seq, 1, args.hidden, args.heads
    per_layer = s * b * h * (34 + 5 * a * s / h) / t
    in_flight = min(pp, args.microbatches) if stack == "3d" else 1
    return {
        "benchmark": "plan_at_scale", "model": f"LlamaForCausalLM h{args.hidden} L{args.layers} "
        f"heads {args.heads}/{args.kv_heads} vocab {args.vocab}", "parameters": n_params,
        "stack": stack, "mesh": dict(mesh.shape), "tokens_per_microbatch": s * b,
        "build_s": round(t1 - t0, 2), "functionalize_s": round(t2 - t1, 2), "plan_s": round(t3 - t2, 2),
        "baseline_rss_bytes": baseline, "peak_rss_bytes": _vm("VmHWM"),
        "rank0": {k: plan.memory[k][0] for k in FIGURES if k in plan.memory},
        "max": {k: max(plan.memory[k]) for k in FIGURES if k in plan.memory},
        "formula_model_state_bytes": 16 * n_params // shards,
        "formula_activation_bytes": int(per_layer * layers_held * in_flight),
        "cores": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated of {STACKS}")
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--intermediate", type=int, default=28672)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (one sequence per micro-batch)")
    parser.add_argument("--ranks", type=int, default=512, help="world size; a cube for the 3d stack")
    parser.add_argument("--microbatches", type=int, default=8, help="1F1B micro-batches of the 3d stack")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one stack in this process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args)), flush=True)
        return
    rows = []
    for stack in args.stacks.split(","):
        if stack not in STACKS:
            parser.error(f"--stacks: unknown stack {stack!r}; choose from {STACKS}")
        child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", stack]
        done = subprocess.run(child, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{stack}: the measuring process failed:\n{done.stderr[-4000:]}")
        row = done.stdout.strip().splitlines()[-1]
        print(row, flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
