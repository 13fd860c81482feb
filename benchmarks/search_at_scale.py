"""``sw.search`` for a Llama-3-70B-shaped model on 512 ranks of 80 GB, on one CPU, on paper.

Run it from the repository root:

    python benchmarks/search_at_scale.py                  # the 70B shape, 80 layers
    python benchmarks/search_at_scale.py --layers 4       # the same path, fast

What is searched
----------------
An unmodified Hugging Face ``LlamaForCausalLM`` of the Llama-3-70B shape (hidden 8192, 80
layers, 64 query and 8 key/value heads, intermediate 28672, vocabulary 128256: 70.6e9
parameters) built under ``torch.device("meta")``, split per ``LlamaDecoderLayer``, AdamW, a
global batch of ``--sequences`` sequences of ``--seq`` tokens. The space: every ``dp x pp x
tp`` of ``--world`` ranks with tp at most 8 (the 8 key/value heads, one node of NVLink), ZeRO 1
and 3 over dp, 1F1B with 8, 16 or 32 micro-batches, remat off or
``nothing_saveable``, bf16 compute with fp32 master weights (``SPACE``). Compute costs from
FLOPs (``--flops`` per second per rank, 400e12: an H100's bf16 dense peak of ~990e12 at the
40% MFU torchtitan and Megatron report for 70B); communication a two-level ring model, NVLink
within a node of 8 (``--nvlink`` bytes/s per rank) and the network across nodes (``--network``).

Each candidate is bounded by arithmetic first (``shardwise/plan_search/bounds.py``: lower bounds
on its peak memory and its step time); only those that can still be among the ``--top``
fastest are planned and simulated (the simulation walks one data-parallel replica:
``replicas.py``). Output: one JSON line with the wall time, the process's peak RSS (VmHWM,
interpreter and imports included), the CPU seconds of the process (``cpu_s``: on a shared
machine, what the wall time would be with a core of its own), how many candidates were refused by compose, by the memory
bound, by the Plan's memory, how many were planned and how many left out by the time bound,
and the ranked layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from shardwise.plan_search import Space

PRECISION = "params=f32,compute=bf16,output=f32"
SPACE = Space(zero_stages=(1, 3), schedules=("1f1b",), microbatches=(8, 16, 32),
              remat=(None, "nothing_saveable"), precision=(PRECISION,), max_tp=8)


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def llama_step(layers: int, seq: int) -> tuple[Any, Any]:
    """The meta-built Llama-3-70B-shaped step with ``layers`` decoder layers, and its parameters."""
    import torch
    import transformers as T
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import shardwise as sw

    config = T.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                           num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                           max_position_embeddings=max(seq, 8))
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    example = torch.zeros((1, 8), dtype=torch.long)  # the split is recorded on it
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=example)

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)

    return sw.train_step(chain, loss, sw.optim.adamw(3e-4)), params


def comm_model(nvlink: float, network: float) -> Any:
    import shardwise as sw

    return sw.plan.CommModel.two_level(intra=sw.plan.CommModel.link(nvlink, 5e-6),
                                       inter=sw.plan.CommModel.link(network, 2e-5), ranks_per_node=8)


def run(layers: int = 80, world: int = 512, memory: str = "80GB", sequences: int = 256, seq: int = 4096,
        flops: float = 400e12, nvlink: float = 150e9, network: float = 25e9, top: int = 5,
        space: Space = SPACE) -> dict[str, Any]:
    """Build, search and time; the JSON row (``result``: the SearchResult itself, not serialised)."""
    import torch

    import shardwise as sw
    from shardwise.plan_search import FlopCompute, params_per_layer

    start, cpu = time.perf_counter(), time.process_time()
    step, params = llama_step(layers, seq)
    built = time.perf_counter()
    ids = torch.zeros((sequences, seq), dtype=torch.long)
    compute = FlopCompute(params_per_layer(step, params), flops, sequences, seq)
    found = sw.search(step, params, (ids, ids), world=world, memory_per_rank=memory, comm=comm_model(nvlink, network),
                      compute=compute, tp_plan=sw.tp.llama_plan(), space=space, top=top)
    done = time.perf_counter()
    stages = found.refusals_by_reason()
    n_params = sum(t.numel() for layer in params.values() for t in layer.values())
    return {
        "benchmark": "search_at_scale", "parameters": n_params, "layers": layers, "world": world,
        "memory_per_rank": memory, "tokens_per_step": sequences * seq,
        "candidates": len(list(space.candidates(world))), "build_s": round(built - start, 2),
        "search_s": round(done - built, 2), "wall_s": round(done - start, 2),
        "cpu_s": round(time.process_time() - cpu, 2), "peak_rss_bytes": _vm("VmHWM"),
        "refused": {f"{stage}: {why}": n for (stage, why), n in stages.items()},
        # Planned in full: what fits, what the Plan's own peak or the simulation refused (the
        # lowering's refusals of a batch cut fail before any planning, in milliseconds).
        "planned": found.fitting + sum(n for (stage, why), n in stages.items()
                                       if stage in ("memory", "simulate") and not why.startswith("a lower bound")),
        "refused_by_lowering": sum(n for (stage, _), n in stages.items() if stage == "plan"),
        "fitting_planned": found.fitting, "bounded": found.bounded, "bounded_above_s": found.bounded_above,
        "ranked": [{"stack": str(p.candidate), "time_s": round(p.time, 4), "peak_gb": round(p.memory / 1e9, 2),
                    "bytes_per_axis_gb": {a: round(n / 1e9, 2) for a, n in p.bytes_per_axis.items()}}
                   for p in found.ranked],
        "cores": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__,
        "result": found,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--world", type=int, default=512)
    parser.add_argument("--memory", default="80GB")
    parser.add_argument("--sequences", type=int, default=256, help="sequences per step (global batch)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--flops", type=float, default=400e12, help="FLOP/s per rank")
    parser.add_argument("--nvlink", type=float, default=150e9, help="bytes/s per rank within a node")
    parser.add_argument("--network", type=float, default=25e9, help="bytes/s per rank across nodes")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--table", action="store_true", help="also print the table")
    args = parser.parse_args(argv)
    row = run(args.layers, args.world, args.memory, args.sequences, args.seq, args.flops, args.nvlink,
              args.network, args.top)
    found = row.pop("result")
    print(json.dumps(row), flush=True)
    if args.table:
        print(found.table())


if __name__ == "__main__":
    main()
