"""The same steps on two checkouts of shardwise, alternating fresh processes: CPU time per step.

A refactoring's "behaviour and speed unchanged" (issue 26) is a paired comparison of two trees. On a
shared machine wall time moves with the load; the CPU time a rank's thread spends per step (one torch
thread per rank, ``time.thread_time``) moves far less, so it is the figure compared, wall time beside it.

    python benchmarks/before_after.py --trees /path/to/old/checkout . --rounds 5 --steps 20

Each round runs every config on each tree in its own process (``PYTHONPATH`` = the tree), so the
imports are the tree's own; it prints one JSON line per run, then a summary line per config: the
median over rounds of new/old (the last tree over the first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("gpt1", "mlp1", "gptz3", "mlppp")  # one device, one device, ZeRO-3 dp 2, 1F1B pp 2 (thread ranks)


def run_config(cfg: str, steps: int) -> dict[str, float | str]:
    """One config on the shardwise this process imports: CPU and wall seconds per step (after 3 warm-up)."""
    import torch

    torch.set_num_threads(1)
    import shardwise as sw
    from shardwise.testing.models import TinyGPT, mlp

    torch.manual_seed(0)
    if cfg.startswith("gpt"):
        model = TinyGPT(vocab=256, d_model=128, n_heads=4, n_layers=4, seq_len=64)
        chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

        batches = [(torch.randint(256, (8, 64)), torch.randint(256, (8, 64))) for _ in range(4)]
    else:
        chain, params = sw.functionalize(mlp([256] * 9))
        loss = torch.nn.functional.mse_loss  # type: ignore[assignment]
        batches = [(torch.randn(32, 256), torch.randn(32, 256)) for _ in range(4)]
    step = sw.train_step(chain, loss, sw.optim.sgd(0.01, momentum=0.9))
    fn, mesh = step, None
    if cfg.endswith("z3"):
        fn, mesh = sw.shard_params(step, "dp", stage=3), sw.Mesh(dp=2)
    elif cfg.endswith("pp"):
        fn, mesh = sw.pipeline(step, "pp", schedule="1f1b", microbatches=4), sw.Mesh(pp=2)

    def rank() -> tuple[float, float]:
        state = fn.init(params, mesh) if mesh is not None else fn.init(params)
        for i in range(3):
            state, _ = fn(state, batches[i % 4])
        cpu, wall = time.thread_time(), time.perf_counter()
        for i in range(steps):
            state, metrics = fn(state, batches[i % 4])
        float(metrics["loss"])
        return (time.thread_time() - cpu) / steps, (time.perf_counter() - wall) / steps

    out = [rank()] if mesh is None else sw.launch(rank, world=mesh.size)
    return {"cfg": cfg, "cpu": sum(o[0] for o in out) / len(out), "wall": max(o[1] for o in out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts' root folders")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: run this config here
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_config(args.one, args.steps)))
        return
    if not args.trees:
        parser.error("--trees OLD NEW: the two checkouts to compare")
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    ratios: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for cfg in configs:
            got = []
            for tree in args.trees:
                env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                done = subprocess.run([sys.executable, __file__, "--one", cfg, "--steps", str(args.steps)],
                                      env=env, capture_output=True, text=True, timeout=600, check=True)
                res = json.loads(done.stdout.strip().splitlines()[-1])
                got.append(res)
                print(json.dumps({"round": r, "tree": tree, "load": os.getloadavg()[0], **res}), flush=True)
            ratios[cfg].append(got[1]["cpu"] / got[0]["cpu"])
    for cfg, values in ratios.items():
        print(json.dumps({"cfg": cfg, "cpu_ratio_new_over_old_median": statistics.median(values),
                          "ratios": [round(v, 3) for v in values]}))


if __name__ == "__main__":
    main()
