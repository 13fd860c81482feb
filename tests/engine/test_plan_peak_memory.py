"""The Plan's peak of stacks without shard_params (a pipeline, tensor parallel, under mixed precision),
and of ZeRO-1 and ZeRO-3 where it missed what the step makes, against the peak each rank measures
(tests/plan_search/test_search.py: a search keeps to its budget by that peak).

Without shard_params the Plan once counted the state at rest, the gradients and what the forward
keeps, and nothing the step makes besides: an out-of-place AdamW's new parameters and moments beside
the old ones and its temporaries (4 x the rank's parameters here), an in-place one's temporaries,
a precision policy's compute copies and the gradients cast to the master dtype. It said half of the
measured peak for the functional AdamW, and sw.search returned a pipeline over its budget. Under
ZeRO-1 it counted the functional AdamW's new shards and moments at the update only, not beside the
updated parameters the all-gathers bring after it, and under ZeRO-3 no compute copy of the shards.
ZeRO-3 now casts each unit's shard as its all-gather is issued and frees the copy at the wait (it
cast every shard at the step's start and held them to its end, 8 MiB a rank here): the Plan counts
the copies in flight, so a step holding them all again measures 8 MiB above the Plan (checked).
ZeRO-1/2 under bf16 compute held the compute copy of every layer to the step's end, through the
reduce-scatters; each went then at its bucket's reduce-scatter, and the Plan counted it so. Now they
hold float32 shards at rest and gather each layer in bf16 before its first forward, freed after its
last backward (with two micro-batches, kept across both): the Plan counts them as ZeRO-3's gathers.

Peak memory is the kernel's high-water mark (VmHWM) of each rank process above its RSS when the
measured part starts, after a warm-up step of the same stack on the same model: imports, one-time
setup, and what torch's CPU kernels keep of their own once they ran on these shapes (not tensors,
which is all the Plan counts: 2.4 MiB after a float32 Linear(2048, 512) and its transpose ran
forward and backward, 7.2 MiB in bfloat16, resident after every tensor was freed) are not the
step's. glibc's mmap and trim thresholds are fixed at 128 KiB in the ranks so
that freed tensors go back at once and RSS follows live memory (the suite's ``live_malloc_gloo4``
ranks' setting, in a pool of this module's own).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.backends.shared_memory_exchange import transport_bytes
from shardwise.testing.memory import PeakRSS

pytestmark = pytest.mark.gloo

WORLD = 4
# One Linear(2048) per pipeline stage (16 MiB each): an in-place AdamW's temporaries are a parameter's
# bytes, big enough to tell apart from what the measurement sees beside the Plan.
PIPELINE_WIDTH, PIPELINE_LAYERS = 2048, 4
# Column- then row-wise pairs: each rank holds a quarter of every weight (4 MiB of each of 4).
TP_WIDTH, TP_LAYERS = 2048, 4
# zero3_acc2: two micro-batches, each reduced (the default); zero3_acc2_once: reduced once after the
# last, every unit's full gradient held from the first micro-batch's backward (the Plan said 0.87x a
# Llama's bytes a rank there, against 1.81x measured, when it counted only the next unit's).
# pipeline_zero3: dp 2 x pp 2, 1f1b over 4 micro-batches, each stage's two units gathered through them
# and each micro-batch's gradients reduced (the default): a later micro-batch's share is made beside the
# earlier ones' while the units are gathered (the Plan was one unit's shard, 6%, under). _once: reduced
# after the last, a stage's backward adding one unit's new gradient at a time into the held ones (the
# Plan counted both units' at once, 13% over).
STACKS = ("pipeline", "pipeline_inplace", "pipeline_zero3", "pipeline_zero3_once", "tensor_parallel",
          "tensor_parallel_inplace", "tensor_parallel_bf16", "zero1", "zero1_bf16", "zero2_bf16", "zero2_acc2_bf16",
          "zero3_bf16", "zero3_acc2", "zero3_acc2_once")


def _model(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())][:-1])


def _stack(name: str, width: int) -> tuple[sw.Step, dict[str, Any], tuple[torch.Tensor, torch.Tensor], sw.Mesh]:
    layers = PIPELINE_LAYERS if name.startswith("pipeline") else TP_LAYERS
    with torch.device("meta"):
        model = _model(width, layers)
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-3, inplace=name.endswith("_inplace")))
    if name.startswith("pipeline_zero3"):
        once = {"reduce_each_microbatch": False} if name.endswith("_once") else {}
        step = sw.shard_params(sw.pipeline(step, "pp", "1f1b", microbatches=4), "dp", 3, **once)
        mesh = sw.Mesh(dp=2, pp=2)
    elif name.startswith("pipeline"):
        step, mesh = sw.pipeline(step, "pp", "1f1b", microbatches=WORLD), sw.Mesh(pp=WORLD)
    elif name.startswith("zero"):
        accumulation = 2 if "_acc2" in name else 1
        once = {"reduce_each_microbatch": False} if name.endswith("_once") else {}
        step = sw.shard_params(step, "dp", stage=int(name[4]), accumulation=accumulation, **once)
        mesh = sw.Mesh(dp=WORLD)
    else:
        plan = {str(2 * i): sw.tp.Colwise() if i % 2 == 0 else sw.tp.Rowwise() for i in range(layers)}
        step, mesh = sw.tensor_parallel(step, "tp", plan), sw.Mesh(tp=WORLD)
    if name.endswith("_bf16"):
        step = sw.mixed_precision(step, "params=f32,compute=bf16", loss_scale="dynamic")
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(8 * WORLD, width, generator=gen), torch.randn(8 * WORLD, width, generator=gen))
    return step, params, batch, mesh


def _already_held(mesh: sw.Mesh) -> int:
    """What the Plan counts that an earlier run in this process left resident (so the measurement,
    from this run's RSS, cannot see it): the shared-memory slots of the exchange over this stack's
    data-parallel group, if one is open already (ZeRO's; as test_meta_init_memory.py). Another
    group's (dp 2 of a pipeline's stack, before dp 4) is in neither: resident before, not this Plan's."""
    if "dp" not in mesh.axis_names:
        return 0
    members = mesh.group_ranks("dp", mesh.rank)
    group = getattr(current_backend(), "_exchange_groups", {}).get(members)
    return 0 if group is None or group.shared is None else transport_bytes(len(members))


def _train(name: str, width: int, steps: int = 2, plan: bool = True) -> tuple[int, int]:
    """(this rank's measured peak, the Plan's; 0 without ``plan``) over ``steps`` steps of stack ``name`` (two:
    every stack's peaks with three were within this test's 3% too, for 10 s more of the suite's gloo worker)."""
    step, params, batch, mesh = _stack(name, width)
    held = _already_held(mesh)
    meter = PeakRSS()
    state = step.init(params, mesh)
    for _ in range(steps):
        state, metrics = step(state, batch)
    assert torch.isfinite(metrics["loss"])
    measured = meter.peak()
    return measured, step.plan(mesh, params, batch).memory["peak"][mesh.rank] - held if plan else 0


def _rank() -> dict[str, tuple[int, int]]:
    out = {}
    for name in STACKS:
        width = PIPELINE_WIDTH if name.startswith("pipeline") else TP_WIDTH
        # Warm-up: a step of the same stack on the same model (see the docstring); its Plan (a run on fake
        # tensors, about half of the warm-up's time) is not needed.
        _train(name, width, steps=1, plan=False)
        out[name] = _train(name, width)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, tuple[int, int]]]:
    """Per rank and stack, (measured peak, the Plan's peak), from one run of ranks of their own: on the
    suite's shared ``live_malloc_gloo4`` ranks, after the other memory tests ran there, tensor parallel
    and the in-place pipeline measured 3-5% above the Plan (what those runs left in the processes
    shows in this one's peak above its starting RSS)."""
    from shardwise.collectives.backends.processes import ProcessPool
    from shardwise.testing.memory import LIVE_MALLOC

    with pytest.MonkeyPatch.context() as patch, ProcessPool(WORLD, timeout=240.0) as pool:
        for key, value in LIVE_MALLOC.items():  # in the ranks' environment when they start
            patch.setenv(key, value)
        result: list[dict[str, tuple[int, int]]] = pool.run(_rank)
    return result


@pytest.mark.parametrize("stack", STACKS)
def test_the_plan_predicts_each_ranks_peak(runs: list[dict[str, tuple[int, int]]], stack: str) -> None:
    """Within 3% of the measured peak (65-240 MiB per rank; measured 0.988-1.0 of the Plan's).

    The Plan counts what the forward keeps beside the update's allocations, where it is freed
    already (up to 1% here), and the gradients whole from the first backward on; what the
    measurement sees besides (gloo's buffers, Python's objects) is under 1 MiB. Before the Plan
    counted the update's allocations it said 0.44-0.54 of the measured peak with the functional
    AdamW (0.47 under bf16 compute), 0.80 of the pipeline's with the in-place one (its temporaries,
    and a later micro-batch's gradient before it is added in, are a stage's parameter bytes), 0.95
    of tensor parallel's; 0.80 of ZeRO-1's and 0.94 of ZeRO-3's under bf16 compute; 0.94 of a
    pipeline's under ZeRO-3 with 4 micro-batches, 1.13 with one reduction after the last."""
    for measured, predicted in (rank[stack] for rank in runs):
        assert abs(predicted - measured) < 0.03 * measured, (
            f"{stack}: measured {measured / 2**20:.1f} MiB, the Plan says {predicted / 2**20:.1f} MiB")
