"""Expert-parallel MoE layer: shardwise's ``moe_dispatch_combine`` against FairScale's ``MOELayer`` with the
same experts, forward + backward, on gloo processes; and the single-device layer for reference.

Run it from the repository root:

    python benchmarks/expert_parallel.py                          # E=8, top-2, hidden 256, ffn 512, ep 2 and 4
    python benchmarks/expert_parallel.py --worlds 2 --steps 5 --out ep.jsonl

What is measured
----------------
``TopKMoE(hidden, ffn, experts, top_k=2)`` (``shardwise.testing.models``: Mixtral's softmax-top-2 router
renormalized, SwiGLU experts in fused 3-D weights), seeded, the same on every rank; each of ``ep`` ranks
(one gloo process, ``torch.set_num_threads(1)``) holds ``--tokens`` tokens of its own and ``E/ep``
experts. A step: the layer's forward on the rank's tokens and ``autograd.grad`` of the output against a
fixed upstream gradient, to the tokens, the router weight and the rank's expert weights. Variants:

* ``shardwise``: router linear, then ``moe_dispatch_combine(capacity_factor=None)``: nothing dropped.
* ``shardwise_cap1``: the same with ``capacity_factor=1.0``: capacity ``2 x tokens / E`` per rank and
  expert, FairScale's ``Top2Gate`` capacity, with the same drop order (first choices in token order,
  then second choices).
* ``fairscale``: ``fairscale.nn.moe.MOELayer(Top2Gate(hidden, E), local experts)`` as it ships: its
  gate picks the second expert with Gumbel noise (random each step) and its capacity is fixed at
  ``2 x tokens / E`` (no argument changes it), so its output is not the deterministic top-2 layer's.
* ``fairscale_nodrop``: the same ``MOELayer`` with :class:`ExactTop2Gate`, written here: Top2Gate's own
  gating without the noise, with the capacity given: the smallest that drops nothing on this batch
  (every rank's largest per-expert count, agreed before timing). Its output must equal shardwise's.

The local experts of the FairScale variants are views of the same fused weights (:class:`FusedExpert`).
Timing as in the other benchmarks (round-robin in the same processes, the slowest rank per step,
``ratio_to_fairscale`` over ``fairscale``'s median, ``paired_ratio_to_fairscale`` the median of the
per-round ratios). Bytes per step on the busiest rank: shardwise from ``sw.comm_ledger()`` (the count
all-gather, four all-to-alls and the auxiliary loss's psum) beside ``formula_sent_bytes``
(``moe_all_to_all_bytes`` x 2 passes + ``moe_count_exchange_bytes`` + the psum of ``E`` float32, with
the slots the step used); FairScale's by wrapping
``dist.all_to_all_single``, which its ``_AllToAll`` calls (``(ep - 1)/ep`` of each input).
``max_abs_diff_to_single_device``: output and token-gradient difference from ``TopKMoE`` on the rank's
tokens. ``dropped_fraction``: assignments dropped. The ``single_device`` line times ``TopKMoE`` (its
loop over experts) on the global batch (``ep x tokens``) in one process with one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    add_out_flag,
    add_worlds_flag,
    environment,
    json_lines,
    note,
    paired_ratio_median,
    round_robin,
)
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.processes import ProcessPool
from shardwise.testing.models import TopKMoE
from shardwise.transforms.expert_parallel import (
    moe_all_to_all_bytes,
    moe_count_exchange_bytes,
    moe_dispatch_combine,
    shard_experts,
)

VARIANTS = ("shardwise", "shardwise_cap1", "fairscale", "fairscale_nodrop")
REFERENCE = "fairscale"
TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Config:
    world: int
    experts: int = 8
    hidden: int = 256
    ffn: int = 512
    tokens: int = 2048  # per rank
    top_k: int = 2
    steps: int = 5
    warmup: int = 1


def problem(cfg: Config) -> tuple[TopKMoE, torch.Tensor, torch.Tensor]:
    """The layer, every rank's tokens and the upstream gradient, seeded: the same in every process."""
    torch.manual_seed(0)
    moe = TopKMoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.world * cfg.tokens, cfg.hidden, generator=gen)
    return moe, x, torch.randn(x.shape, generator=gen)


class FusedExpert(nn.Module):
    """Expert ``e`` of fused weights, as FairScale's ``MOELayer`` calls an expert: on [..., hidden] rows."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down  # views of the rank's leaves: gradients reach them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


class ExactTop2Gate(nn.Module):
    """FairScale's ``top2gating`` without the Gumbel noise on the second choice, at a given ``capacity``.

    Returns what ``MOELayer`` expects: ``(l_aux, combine_weights [S, E, C], dispatch_mask)``. Top2Gate's
    order of slots: first choices in token order, then second choices after them (shardwise's rule too).
    """

    def __init__(self, weight: torch.Tensor, capacity: int) -> None:
        super().__init__()
        self.weight, self.capacity = weight, capacity

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gates = F.softmax(F.linear(x, self.weight), dim=1, dtype=torch.float)
        experts = gates.shape[1]
        top2 = gates.topk(2, dim=1).indices
        mask1, mask2 = (F.one_hot(top2[:, j], experts).to(gates.dtype) for j in (0, 1))
        loc1 = mask1.cumsum(0) - 1
        loc2 = mask2.cumsum(0) - 1 + mask1.sum(0, keepdim=True)
        mask1, mask2 = mask1 * (loc1 < self.capacity), mask2 * (loc2 < self.capacity)
        g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
        denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
        combine = torch.zeros(x.shape[0], experts, self.capacity, dtype=gates.dtype)
        for mask, loc, g in ((mask1, loc1, g1), (mask2, loc2, g2)):
            slot = F.one_hot((loc * mask).sum(1).long(), self.capacity).to(gates.dtype)
            combine = combine + (g / denom).unsqueeze(-1).mul(mask).unsqueeze(2) * slot.unsqueeze(1)
        l_aux = torch.mean(gates.mean(0) * mask1.mean(0))
        return l_aux, combine, combine.bool()


class AllToAllCounter:
    """Wraps ``dist.all_to_all_single`` in FairScale's module: bytes this rank sends, ``(n - 1)/n`` of each input."""

    def __init__(self) -> None:
        from fairscale.nn.moe import moe_layer

        self.module, self.original, self.sent = moe_layer.dist, moe_layer.dist.all_to_all_single, 0
        n = dist.get_world_size()

        def counting(output: torch.Tensor, inp: torch.Tensor, *args: Any, **kw: Any) -> Any:
            self.sent += inp.numel() * inp.element_size() * (n - 1) // n
            return self.original(output, inp, *args, **kw)

        moe_layer.dist = _DistWith(counting)


class _DistWith:
    """``torch.distributed`` with ``all_to_all_single`` replaced (FairScale reads it as ``dist.all_to_all_single``)."""

    def __init__(self, all_to_all_single: Any) -> None:
        self.all_to_all_single = all_to_all_single

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def rank_body(cfg: Config) -> dict[str, Any]:
    """On each rank: build every variant on the same weights, check them, time them, count their bytes."""
    from fairscale.nn.moe import MOELayer, Top2Gate

    torch.set_num_threads(1)
    moe, x, g_all = problem(cfg)
    with sw.Mesh(ep=cfg.world) as mesh:
        rows = slice(mesh.rank * cfg.tokens, (mesh.rank + 1) * cfg.tokens)
        mine, g = x[rows], g_all[rows]
        router = moe.gate.weight.detach().clone().requires_grad_()
        gate_up, down = (shard_experts(w.detach(), "ep").clone().requires_grad_()
                         for w in (moe.experts.gate_up_proj, moe.experts.down_proj))
        experts = nn.ModuleList(FusedExpert(gate_up[e], down[e]) for e in range(gate_up.shape[0]))
        top2 = Top2Gate(cfg.hidden, cfg.experts)
        del top2.wg.weight
        top2.wg.weight = router  # a plain attribute now: the same leaf, so its gradient lands on router
        counts = torch.bincount(torch.topk(mine @ router.detach().T, cfg.top_k).indices.flatten(), minlength=cfg.experts)
        nodrop = counts.max().clone()
        dist.all_reduce(nodrop, op=dist.ReduceOp.MAX)  # all_to_all needs one capacity on every rank
        layers = {"fairscale": MOELayer(top2, experts), "fairscale_nodrop": MOELayer(
            ExactTop2Gate(router, int(nodrop)), experts)}
        counter = AllToAllCounter()
        info: dict[str, dict[str, Any]] = {name: {} for name in VARIANTS}

        def forward(name: str, tokens: torch.Tensor) -> torch.Tensor:
            if name.startswith("fairscale"):
                # MOELayer wants (sequence, token, model) with the first dim a multiple of its local experts.
                return layers[name](tokens.view(len(experts), -1, cfg.hidden)).view_as(tokens)
            res = moe_dispatch_combine(tokens, tokens @ router.T, gate_up, down, "ep", top_k=cfg.top_k,
                                       capacity_factor=1.0 if name == "shardwise_cap1" else None)
            info[name].update(slots=res.slots, dropped=res.dropped)
            return res.output

        def one_step(name: str) -> list[torch.Tensor]:
            tokens = mine.clone().requires_grad_()
            out = forward(name, tokens)
            grads = torch.autograd.grad(out, (tokens, router, gate_up, down), g)
            return [out.detach(), grads[0]]

        times, _ = round_robin(VARIANTS, [None] * (cfg.warmup + cfg.steps), cfg.warmup, lambda n, i, b: one_step(n))
        with torch.no_grad():
            ref_out = moe(mine)
        ref_tokens = mine.clone().requires_grad_()
        ref_grad = torch.autograd.grad(moe(ref_tokens), ref_tokens, g)[0]
        for name in VARIANTS:
            counter.sent = 0
            with sw.comm_ledger() as ledger:
                out, g_tokens = one_step(name)
            info[name].update(ledger_sent=ledger.sent_bytes(), wrapped_sent=counter.sent,
                              diff=max(float((out - ref_out).abs().max()), float((g_tokens - ref_grad).abs().max())))
        # Top2Gate's own drop count on this batch: assignments past its capacity (2 x tokens / E).
        _, combine, _ = top2(mine)
        info["fairscale"]["dropped"] = int(cfg.top_k * cfg.tokens - combine.bool().sum())
        info["fairscale"]["slots"] = 2 * cfg.tokens // cfg.experts
        info["fairscale_nodrop"].update(dropped=0, slots=int(nodrop))
    return {"times": times, "info": info}


def formula_bytes(cfg: Config, name: str, slots: int) -> int:
    """Bytes one rank sends in a forward + backward, by formula: two all-to-alls each way (+ shardwise's counts)."""
    a2a = 2 * moe_all_to_all_bytes(num_experts=cfg.experts, slots=slots, hidden=cfg.hidden, itemsize=4, size=cfg.world)
    if not name.startswith("fairscale"):
        # shardwise also all-gathers the counts, and psums the E router-probability sums of the auxiliary
        # loss (ring all-reduce of E float32; forward only: the output's gradient does not reach it).
        a2a += moe_count_exchange_bytes(num_experts=cfg.experts, size=cfg.world)
        a2a += 2 * cfg.experts * 4 * (cfg.world - 1) // cfg.world
    return a2a


def single_device(cfg: Config) -> dict[str, Any]:
    """``TopKMoE`` forward + backward on the global batch, one process, one thread: the median step."""
    torch.set_num_threads(1)
    moe, x, g = problem(cfg)
    times = []
    for i in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        tokens = x.clone().requires_grad_()
        torch.autograd.grad(moe(tokens), (tokens, *moe.parameters()), g)
        if i >= cfg.warmup:
            times.append(time.perf_counter() - start)
    return {"median_step_s": round(statistics.median(times), 5)}


def rows_for(cfg: Config) -> list[dict[str, Any]]:
    base = {"bench": "expert_parallel", "ep": cfg.world, "experts": cfg.experts, "top_k": cfg.top_k,
            "hidden": cfg.hidden, "ffn": cfg.ffn, "tokens_per_rank": cfg.tokens, "dtype": "float32",
            "steps": cfg.steps}
    note(f"# ep {cfg.world}")
    with ProcessPool(cfg.world, timeout=TIMEOUT_S) as pool:
        per_rank = pool.run(rank_body, cfg)
    times = {name: [r["times"][name] for r in per_rank] for name in VARIANTS}
    slowest = {name: [max(s) for s in zip(*times[name], strict=True)] for name in VARIANTS}
    reference = statistics.median(slowest[REFERENCE])
    rows = []
    for name in VARIANTS:
        info = [r["info"][name] for r in per_rank]
        median = statistics.median(slowest[name])
        slots = max(i["slots"] for i in info)
        sent = "ledger_sent" if name.startswith("shardwise") else "wrapped_sent"
        dropped = sum(i["dropped"] for i in info) if name == "fairscale" else info[0]["dropped"]  # ours: global
        rows.append({**base, "variant": name, "median_step_s": round(median, 5),
                     "ratio_to_fairscale": round(median / reference, 3),
                     "paired_ratio_to_fairscale": round(paired_ratio_median(times[name], times[REFERENCE]), 3),
                     "sent_bytes_per_step": max(i[sent] for i in info), "slots": slots,
                     "formula_sent_bytes": formula_bytes(cfg, name, slots),
                     "dropped_fraction": round(dropped / (cfg.world * cfg.tokens * cfg.top_k), 4),
                     "max_abs_diff_to_single_device": max(i["diff"] for i in info),
                     **environment(threads_per_rank=1)})
    rows.append({**base, "variant": "single_device", "tokens": cfg.world * cfg.tokens, **single_device(cfg),
                 **environment(threads_per_rank=1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_worlds_flag(parser)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank (default 2048)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    add_out_flag(parser)
    args = parser.parse_args()
    with json_lines(args.out) as emit:
        for world in (int(w) for w in args.worlds.split(",")):
            cfg = Config(world, args.experts, args.hidden, args.ffn, args.tokens, steps=args.steps, warmup=args.warmup)
            for row in rows_for(cfg):
                emit(row)


if __name__ == "__main__":
    main()
