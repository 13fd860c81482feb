"""HSDP against flat ZeRO-3 on paper: a Llama-shaped model's Plans over 8 nodes x 8 ranks, simulated
with a two-level CommModel (fast within a node, slow across).

Run it from the repository root:

    python benchmarks/hsdp.py                                  # 7B and 70B shapes, network 1x and 10x slower
    python benchmarks/hsdp.py --models 7b --ratios 1 4 10 --seqs 1 4 --out hsdp.jsonl
    python benchmarks/hsdp.py --tiny                           # a seconds-long smoke run (the tests' size)

What is computed
----------------
An unmodified Hugging Face ``LlamaForCausalLM`` is built on the meta device (no memory), split
per ``LlamaDecoderLayer`` and made a step with AdamW under ``mixed_precision("compute=bf16,
reduce=bf16")`` (fp32 master weights, bf16 gathers and gradient reductions). Two layouts of the
same ``--nodes x --ranks-per-node`` ranks, ZeRO-3 both, one reduction in flight (the GPU default):

* ``flat``: ``shard_params(step, "dp", 3)`` over ``Mesh(dp=nodes x ranks_per_node)``: every
  gather and reduce-scatter spans every node;
* ``hsdp``: ``shard_params(step, "dp", 3, replicate="node")`` over ``Mesh(node=nodes,
  dp=ranks_per_node)``: gathers and reduce-scatters within a node, the gradient shards'
  all-reduce across nodes.

Each Plan is simulated (``sw.simulate``) with ``CommModel.two_level(intra=link(--intra-gbps),
inter=link(--intra-gbps / ratio), ranks_per_node)``: a ring over a group priced at its slowest
link, one link per rank each way (one NIC per GPU, as an 8-GPU H100 node's), latency
``--intra-latency`` / ``--inter-latency`` per ring step. Compute from a FLOP count at
``--flops`` per second (a GPU's sustained rate, e.g. 40% of an H100's 989 bf16 TFLOP/s): a
layer's forward ``2 x (its matmul parameters) x tokens + 4 x tokens^2 x hidden`` (attention's
scores and values, no causal saving), its backward twice that; the update reads and writes
AdamW's state: 28 bytes per shard element at ``--hbm-gbps``. ``tokens`` is ``--seqs``
sequences of ``--seq`` tokens per rank.

Output: one JSON line per (model, seqs, ratio, layout): ``step_s`` (the simulated makespan),
``compute_s`` (rank 0's compute), ``slow_link_bytes`` (what rank 0 sends over links between
nodes in one step: each collective's input bytes times its ring's factor, for the groups that
span nodes), ``model_state_bytes`` (the Plan's params + grads + opt_state, rank 0) and
``peak_bytes`` (the Plan's peak, activations kept for backward included), and the speed-up of
HSDP over flat (``hsdp_speedup``, on the hsdp row) and its memory cost (``hsdp_state_ratio``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

import shardwise as sw
from shardwise.plan import CommModel, PlanCosts

SHAPES = {  # LlamaConfig fields of the two published shapes
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256},
}


def build(shape: str) -> tuple[sw.Step, Any, int]:
    """The meta model's step (AdamW, bf16 compute and reductions), its parameters and its hidden size."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(**SHAPES[shape])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    example = torch.zeros((1, 8), dtype=torch.long)
    chain, params = sw.functionalize(model, units=LlamaDecoderLayer, example_input=example)

    def loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
        return sw.tp.vocab_parallel_cross_entropy(out.logits, labels)

    step = sw.mixed_precision(sw.train_step(chain, loss, sw.optim.adamw(3e-4)), "compute=bf16,reduce=bf16")
    return step, params, config.hidden_size


def layer_costs(step: sw.Step, params: Any, tokens: int, hidden: int, flops: float) -> dict[tuple[str, str], float]:
    """Seconds of each layer's forward and backward from its FLOPs (see the module docstring)."""
    out: dict[tuple[str, str], float] = {}
    for layer in step.chain.names:
        matmul = sum(t.numel() for name, t in params[layer].items() if t.dim() == 2 and "embed_tokens" not in name)
        attention = 4 * tokens * tokens * hidden if any("self_attn" in name for name in params[layer]) else 0
        forward = (2 * matmul * tokens + attention) / flops
        out[("forward", layer)], out[("backward", layer)] = forward, 2 * forward
    return out


def slow_link_bytes(plan: sw.plan.Plan, model: CommModel, rank: int = 0) -> int:
    """Bytes ``rank`` sends over links between nodes in one step (a ring's per-rank traffic)."""
    factor = {"all_gather": lambda n: n - 1, "psum_scatter": lambda n: (n - 1) / n, "psum": lambda n: 2 * (n - 1) / n}
    total = 0.0
    for action in plan.for_rank(rank):
        if action.op in factor and action.axis is not None:
            group = plan.mesh.group_ranks(action.axis, rank)
            if model.level(group) is model.inter:
                total += factor[action.op](len(group)) * action.nbytes
    return int(total)


def layouts(step: sw.Step, nodes: int, per_node: int) -> dict[str, tuple[sw.Step, sw.Mesh]]:
    return {
        "flat": (sw.shard_params(step, "dp", 3, reduce_in_flight=1), sw.Mesh(dp=nodes * per_node)),
        "hsdp": (sw.shard_params(step, "dp", 3, reduce_in_flight=1, replicate="node"),
                 sw.Mesh(node=nodes, dp=per_node)),
    }


def rows(args: argparse.Namespace) -> Iterable[dict[str, Any]]:
    for shape in args.models:
        t0 = time.perf_counter()
        step, params, hidden = build(shape)
        note(f"{shape}: functionalized in {time.perf_counter() - t0:.1f} s")
        for seqs in args.seqs:
            tokens = seqs * args.seq
            world = args.nodes * args.ranks_per_node
            ids = torch.zeros((world * seqs, args.seq), dtype=torch.long)
            plans = {}
            for name, (stepped, mesh) in layouts(step, args.nodes, args.ranks_per_node).items():
                t0 = time.perf_counter()
                plans[name] = stepped.plan(mesh, params, (ids, ids))
                note(f"{shape}, {seqs} x {args.seq} tokens, {name}: planned in {time.perf_counter() - t0:.1f} s")
            compute = layer_costs(step, params, tokens, hidden, args.flops)
            for ratio in args.ratios:
                comm = CommModel.two_level(
                    intra=CommModel.link(args.intra_gbps * 1e9, args.intra_latency),
                    inter=CommModel.link(args.intra_gbps * 1e9 / ratio, args.inter_latency),
                    ranks_per_node=args.ranks_per_node,
                )
                found: dict[str, dict[str, Any]] = {}
                for name, plan in plans.items():
                    shard_elements = plan.memory["grads"][0] // 4  # the fp32 gradient shards AdamW updates
                    costs = PlanCosts(layer=compute, kind={"update": 28 * shard_elements / (args.hbm_gbps * 1e9)},
                                      comm=comm, unit_us=1e6)
                    timeline = sw.simulate(plan, costs)
                    memory = plan.memory
                    found[name] = {
                        "bench": "hsdp", "model": shape, "layout": name, "mesh": repr(plan.mesh),
                        "tokens_per_rank": tokens, "inter_slower": ratio, "intra_GBps": args.intra_gbps,
                        "step_s": float(f"{timeline.makespan:.4g}"),
                        "compute_s": float(f"{sum(s.end - s.start for s in timeline.ranks[0] if s.compute):.4g}"),
                        "slow_link_bytes": slow_link_bytes(plan, comm),
                        "model_state_bytes": sum(memory[k][0] for k in ("params", "grads", "opt_state")),
                        "peak_bytes": memory["peak"][0],
                    }
                found["hsdp"]["hsdp_speedup"] = round(found["flat"]["step_s"] / found["hsdp"]["step_s"], 3)
                found["hsdp"]["hsdp_state_ratio"] = round(
                    found["hsdp"]["model_state_bytes"] / found["flat"]["model_state_bytes"], 3)
                yield from found.values()


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["7b", "70b"])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4], help="sequences per rank (default 1 4)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 10.0],
                        help="how many times slower the links between nodes are (default 1 10)")
    parser.add_argument("--intra-gbps", type=float, default=400.0, help="GB/s per rank within a node (default 400)")
    parser.add_argument("--intra-latency", type=float, default=5e-6, help="seconds per ring step within a node")
    parser.add_argument("--inter-latency", type=float, default=1e-5, help="seconds per ring step across nodes")
    parser.add_argument("--flops", type=float, default=4e14, help="sustained FLOP/s per rank (default 4e14)")
    parser.add_argument("--hbm-gbps", type=float, default=3000.0, help="memory GB/s for the update (default 3000)")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on 2 nodes x 2 ranks: a smoke run")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.models, args.nodes, args.ranks_per_node, args.seq, args.seqs = ["tiny"], 2, 2, 16, [1]
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 (written line by line, closed below)
    try:
        for row in rows(args):
            line = json.dumps(row)
            print(line, flush=True)
            if out is not None:
                print(line, file=out, flush=True)
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
