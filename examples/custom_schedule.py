"""A pipeline schedule written by hand: validate it, simulate it, draw it, run it, check it.

    python examples/custom_schedule.py --png custom_schedule.png

A schedule is plain text, one line of actions per rank (``0F1``: the forward
of stage 0 on microbatch 1; ``B`` a full backward). The one below is 1F1B with
one more warm-up forward on rank 0: the simulator shows what that buys (nothing
here: the same bubble) and costs (one more activation held on rank 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import shardwise as sw
from shardwise.schedules import (
    Schedule,
    ScheduleError,
    ascii_timeline,
    gantt,
    get_schedule,
    simulate,
)
from shardwise.testing.models import mlp

CUSTOM = """
# 2 ranks, 4 microbatches
rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
"""

# Rank 1 starts with microbatch 1 while rank 0 waits for the backward of microbatch 0: a deadlock.
DEADLOCKED = """
rank 0: 0F0 0B0 0F1 0B1
rank 1: 1F1 1B1 1F0 1B0
"""


def compare(custom: Schedule) -> None:
    """The custom schedule beside the built-ins of the same shape, as the simulator sees them."""
    for schedule in (custom, get_schedule("1f1b", 2, 2, 4), get_schedule("gpipe", 2, 2, 4)):
        timeline = simulate(schedule)
        print(f"{schedule.name:>6}: bubble {timeline.bubble_fraction:.1%}, "
              f"activations held per rank {list(timeline.peak_activations)}")


def problem(seed: int = 0) -> tuple[sw.Step, dict, list]:
    """A float64 MLP's single-device step, its parameters and batches of 8 (4 microbatches of 2)."""
    torch.manual_seed(seed)
    chain, params = sw.functionalize(mlp([6, 32, 32, 32, 3]).double())
    reference = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.05, momentum=0.9))
    batches = [(torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)) for _ in range(4)]
    return reference, params, batches


def train(step: sw.Step, params: dict, batches: list, steps: int) -> list[float]:
    """The SPMD program: the pipelined step over ``steps`` steps; rank 0 shows progress."""
    mesh = sw.Mesh(pp=2)
    state = step.init(params, mesh)
    losses = []
    for i in tqdm(range(steps), desc="train", unit="step", disable=mesh.rank != 0):
        state, metrics = step(state, batches[i % len(batches)])
        losses.append(float(metrics["loss"]))
    return losses


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default in its help."""


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--png", type=Path, default=Path("custom_schedule.png"), help="where to draw the schedule")
    parser.add_argument("--steps", type=int, default=50, help="training steps after the check")
    args = parser.parse_args(argv)

    custom = Schedule.parse(CUSTOM, name="custom")
    sw.schedules.validate(custom)  # raises ScheduleError naming the rank, action and rule
    print(custom, "", ascii_timeline(simulate(custom)), sep="\n")
    compare(custom)
    print(f"drew {gantt(simulate(custom), args.png)}")
    try:
        sw.schedules.validate(Schedule.parse(DEADLOCKED))
    except ScheduleError as err:
        print(f"refused, as it should be: {err}")
    else:
        raise SystemExit("the deadlocked schedule was accepted")

    reference, params, batches = problem()
    step = sw.pipeline(reference, "pp", schedule=custom, microbatches=4)
    print(sw.testing.assert_equivalent(step, reference, sw.Mesh(pp=2), batches, params))
    losses = sw.launch(train, world=2, args=(step, params, batches, args.steps))[0]
    cycle = len(batches)  # mean over one pass through the batches: single batches differ a lot
    print(f"mean loss over the batches {sum(losses[:cycle]) / cycle:.4f} -> {sum(losses[-cycle:]) / cycle:.4f} "
          f"after {len(losses)} steps")
    return losses


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
