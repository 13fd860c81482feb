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
ranks' setting, ``LIVE_MALLOC``, in a pool of this module's own), and in the measured part glibc
writes every block as it hands it out (``M_PERTURB``), so that a buffer is resident from its
allocation, as the Plan counts it, not from when its pages are first written. An all-gather's
result is allocated at its issue and filled by the exchange's thread as the peers' parts come: on
a loaded machine a peer is late, and the prefetched unit's 16 MiB were 4-11 MiB resident at the
refill where ZeRO-3's peak is (zero3_acc2_once measured 3-6% under the Plan, on one rank at a time;
test_a_gather_in_flight_counts_whole_while_its_peers_are_late makes a peer late on purpose).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives import all_gather_async
from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.backends.shared_memory_exchange import transport_bytes
from shardwise.testing.memory import LIVE_MALLOC, PeakRSS

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
# lm_*: a language model whose logits and cross-entropy's tensors (16 MiB each a rank) outweigh its blocks'
# activations; the Plan once left out the chain's output, the loss's own and the output's gradient (0.64 of
# the measured peak at one rank, a TinyGPT of an 8192-word vocabulary) and summed the activations with the
# gradients and the update's allocations, which come after them (1.19x). lm_pipeline_*: its micro-batches' transfers
# (0.5 MiB each way a micro-batch) were not counted, and held by the run beyond their use (GPipe's middle ranks 0.92 of
# the measured peak, and 0.97-0.98 while an earlier step's sends, held to this step's first, hid some of it); _x16: 16
# micro-batches, each receive posted a few before its wait, not all at the first (a middle rank held 2 x 16 buffers).
STACKS = ("pipeline", "pipeline_inplace", "pipeline_zero3", "pipeline_zero3_once", "tensor_parallel",
          "tensor_parallel_inplace", "tensor_parallel_bf16", "zero1", "zero1_bf16", "zero2_bf16", "zero2_acc2_bf16",
          "zero3_bf16", "zero3_acc2", "zero3_acc2_once", "lm_zero3", "lm_zero2_remat", "lm_pipeline_gpipe",
          "lm_pipeline_1f1b_x16")
# Measured too, and held to the Plan from below and to 3% above (test_a_relus_result_and_its_gradient_are_counted).
NOT_UNDER = ("relu_plain",)
# lm_pipeline_zb_h1: a zero-bubble input pass records, per micro-batch, the gradients its weight pass starts from
# (16 MiB of logits' gradient on the last stage), held from that I to its W (test_zero_bubble_records_...).
ZERO_BUBBLE = ("lm_pipeline_zb_h1",)
# relu_plain: Linear, ReLU, Linear with 16 MiB activations, a step of its own on every rank: the ReLU keeps its
# result (the next Linear's input) to its own backward, which reads the gradient of that result too.
RELU_WIDTH, RELU_HIDDEN, RELU_ROWS = 512, 4096, 1024
LM_VOCAB, LM_WIDTH, LM_SEQ, LM_ROWS = 4096, 128, 64, 16  # per rank: 16 x 64 x 4096 float32 logits, 16 MiB
# An all-gather whose peers issue it late: rank 0's result, 16 MiB, is allocated at the issue and
# only its own quarter written until they come.
LATE_GATHER_BYTES, LATE_S = 16 << 20, 0.5


def _model(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())][:-1])


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _lm_stack(name: str) -> tuple[sw.Step, dict[str, Any], tuple[torch.Tensor, torch.Tensor], sw.Mesh]:
    from shardwise.testing.models import Block, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=LM_VOCAB, d_model=LM_WIDTH, n_heads=4, n_layers=4, seq_len=LM_SEQ)  # 3 MiB
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, _cross_entropy, sw.optim.adamw(1e-3))
    if name.startswith("lm_pipeline_"):  # the last stage keeps each micro-batch's log-softmax to its backward
        schedule, _, more = name.removeprefix("lm_pipeline_").partition("_x")
        microbatches = int(more or 4)
        step, mesh = sw.pipeline(step, "pp", schedule, microbatches=microbatches), sw.Mesh(pp=WORLD)
        rows = microbatches * LM_ROWS
    else:
        if name.endswith("_remat"):  # the head recomputes its logits in its backward
            step = sw.remat(step, policy=sw.policies.nothing_saveable, layers="all")
        step, mesh, rows = sw.shard_params(step, "dp", stage=int(name[7])), sw.Mesh(dp=WORLD), WORLD * LM_ROWS
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, LM_VOCAB, (rows, LM_SEQ + 1), generator=gen)
    return step, params, (tokens[:, :-1], tokens[:, 1:]), mesh


def _stack(name: str, width: int) -> tuple[sw.Step, dict[str, Any], tuple[torch.Tensor, torch.Tensor], sw.Mesh]:
    if name.startswith("lm_"):
        return _lm_stack(name)
    if name == "relu_plain":
        torch.manual_seed(0)
        chain, params = sw.functionalize(
            nn.Sequential(nn.Linear(RELU_WIDTH, RELU_HIDDEN), nn.ReLU(), nn.Linear(RELU_HIDDEN, RELU_WIDTH)))
        step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
        gen = torch.Generator().manual_seed(0)
        batch = (torch.randn(RELU_ROWS, RELU_WIDTH, generator=gen), torch.randn(RELU_ROWS, RELU_WIDTH, generator=gen))
        return step, params, batch, sw.Mesh(dp=WORLD)
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


def _already_held(step: sw.Step, mesh: sw.Mesh) -> int:
    """What the Plan counts that an earlier run in this process left resident (so the measurement,
    from this run's RSS, cannot see it): the shared-memory slots of the exchange over this stack's
    data-parallel group, if one is open already (ZeRO's; as test_meta_init_memory.py). Another
    group's (dp 2 of a pipeline's stack, before dp 4) is in neither: resident before, not this Plan's.
    Nor are they a step's that does not shard its parameters over dp (relu_plain's: a step of its own on
    every rank, which exchanges nothing and whose Plan counts no slots): taken off its Plan, they hid that
    Plan's 8 MiB over the measured peak (its first Linear's gradient counted before it was made)."""
    if "dp" not in mesh.axis_names or step.sharding_spec is None:
        return 0
    members = mesh.group_ranks("dp", mesh.rank)
    group = getattr(current_backend(), "_exchange_groups", {}).get(members)
    return 0 if group is None or group.shared is None else transport_bytes(len(members))


# glibc's mallopt parameters (malloc.h). The ranks set LIVE_MALLOC's thresholds with mallopt, not in
# their environment: ranks whose environment differs from the fork server's are spawned (torch imported
# again, about 2 s of CPU each), and glibc reads the environment only at start.
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}
_M_PERTURB = -6
_PERTURB_BYTE = 0xA5  # any but 0, which turns it off


def _mallopt(param: int, value: int) -> None:
    if ctypes.CDLL(None).mallopt(param, value) != 1:
        raise OSError(f"mallopt({param}, {value}) failed: the memory measured would not follow what is allocated")


def _live_malloc() -> None:
    """LIVE_MALLOC in this process from now on (the blocks freed from now on go back at once)."""
    for key, value in LIVE_MALLOC.items():
        if key not in _MALLOPT:
            raise KeyError(f"LIVE_MALLOC's {key} has no mallopt parameter here: add it to _MALLOPT")
        _mallopt(_MALLOPT[key], int(value))


@contextlib.contextmanager
def _resident_from_allocation() -> Iterator[None]:
    """Within: glibc fills each block it hands out, so its pages are resident from its allocation, not
    from their first write (an all-gather's result, written by the exchange's thread as the peers'
    parts come, in a schedule of their making)."""
    _mallopt(_M_PERTURB, _PERTURB_BYTE)
    try:
        yield
    finally:
        _mallopt(_M_PERTURB, 0)


def _warm_up(name: str, width: int) -> tuple[sw.Step, dict[str, Any], tuple[torch.Tensor, torch.Tensor], sw.Mesh]:
    """A step of stack ``name`` on the same model (see the module docstring): nothing is measured. The
    stack is returned for ``_measure``, whose steps then skip the first call's checks (a step built again
    ran them again: half of this module's time, and not what the Plan counts)."""
    stack = _stack(name, width)
    step, params, batch, mesh = stack
    _, metrics = step(step.init(params, mesh), batch)
    assert torch.isfinite(metrics["loss"])
    return stack


def _measure(
    stack: tuple[sw.Step, dict[str, Any], tuple[torch.Tensor, torch.Tensor], sw.Mesh], steps: int = 1,
) -> tuple[int, int]:
    """(this rank's measured peak, what the Plan counts that it cannot see: ``_already_held``) over
    ``steps`` steps of the warmed-up ``stack`` from a fresh state (one: the step that makes the optimizer's state
    beside the parameters, as every later one does; every stack's peaks with two and with three steps were within
    this test's 3% too, which holds both ways, for 14 s and 24 s more of the suite's gloo worker)."""
    step, params, batch, mesh = stack
    held = _already_held(step, mesh)
    with _resident_from_allocation():
        meter = PeakRSS()
        state = step.init(params, mesh)
        for _ in range(steps):
            state, metrics = step(state, batch)
        measured = meter.peak()
    assert torch.isfinite(metrics["loss"])
    return measured, held


def _plan_peaks(name: str, width: int) -> tuple[int, ...]:
    """The Plan's peak of every rank (a run on fake tensors: one rank makes it for all)."""
    step, params, batch, mesh = _stack(name, width)
    return tuple(step.plan(mesh, params, batch).memory["peak"])


def _gather_with_late_peers() -> int:
    """Rank 0's measured memory just after it issued a ``LATE_GATHER_BYTES`` all-gather, its peers
    issuing theirs ``LATE_S`` later (as under a loaded machine's schedule)."""
    mesh = sw.Mesh(dp=WORLD)
    x = torch.ones(LATE_GATHER_BYTES // WORLD // 4)
    all_gather_async(x, "dp", tiled=True, mesh=mesh).wait()  # the exchange set up (open already after ZeRO's)
    if mesh.rank != 0:
        time.sleep(LATE_S)
    with _resident_from_allocation():
        meter = PeakRSS()
        handle = all_gather_async(x, "dp", tiled=True, mesh=mesh)
        seen = meter.peak()
        gathered = handle.wait()
    assert gathered.numel() * 4 == LATE_GATHER_BYTES
    return seen



def _rank() -> dict[str, Any]:
    """Per stack, this rank's (measured peak, already held); the Plan's peaks of every rank for the
    stacks this rank plans (every ``WORLD``-th, so that no rank waits long for another); and
    ``_gather_with_late_peers``."""
    _live_malloc()
    rank = sw.Mesh(dp=WORLD).rank
    measured: dict[str, tuple[int, int]] = {}
    plans: dict[str, tuple[int, ...]] = {}
    for i, name in enumerate(STACKS + NOT_UNDER + ZERO_BUBBLE):
        width = PIPELINE_WIDTH if name.startswith("pipeline") else TP_WIDTH
        stack = _warm_up(name, width)
        if not measured:
            # What the imports and the first step made lives to the end: kept out of every later
            # collection, PeakRSS's full collection takes milliseconds instead of tenths of a second
            # (300,000 objects). Frozen objects that become garbage are never freed: resident before
            # and after every measured part, outside what it measures.
            gc.collect()
            gc.freeze()
        measured[name] = _measure(stack)
        del stack
        if i % WORLD == rank:
            plans[name] = _plan_peaks(name, width)
    return {"measured": measured, "plans": plans, "late_gather": _gather_with_late_peers()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Per rank, ``_rank()``'s, from one run of ranks of their own: on the suite's shared
    ``live_malloc_gloo4`` ranks, after the other memory tests ran there, tensor parallel and the
    in-place pipeline measured 3-5% above the Plan (what those runs left in the processes shows in
    this one's peak above its starting RSS)."""
    from shardwise.collectives.backends.processes import ProcessPool

    with ProcessPool(WORLD, timeout=240.0) as pool:
        result: list[dict[str, Any]] = pool.run(_rank)
    return result


@pytest.mark.parametrize("stack", STACKS)
def test_the_plan_predicts_each_ranks_peak(runs: list[dict[str, Any]], stack: str) -> None:
    """Within 3% of the measured peak (65-240 MiB per rank; measured 0.988-1.0 of the Plan's).

    The Plan counts what the forward keeps beside the update's allocations, where it is freed
    already (up to 1% here), and the gradients whole from the first backward on; what the
    measurement sees besides (gloo's buffers, Python's objects) is under 1 MiB. Before the Plan
    counted the update's allocations it said 0.44-0.54 of the measured peak with the functional
    AdamW (0.47 under bf16 compute), 0.80 of the pipeline's with the in-place one (its temporaries,
    and a later micro-batch's gradient before it is added in, are a stage's parameter bytes), 0.95
    of tensor parallel's; 0.80 of ZeRO-1's and 0.94 of ZeRO-3's under bf16 compute; 0.94 of a
    pipeline's under ZeRO-3 with 4 micro-batches, 1.13 with one reduction after the last."""
    plan = next(rank["plans"][stack] for rank in runs if stack in rank["plans"])
    for r, rank in enumerate(runs):
        measured, held = rank["measured"][stack]
        predicted = plan[r] - held
        assert abs(predicted - measured) < 0.03 * measured, (
            f"{stack}: rank {r} measured {measured / 2**20:.1f} MiB, the Plan says {predicted / 2**20:.1f} MiB")


def test_a_gather_in_flight_counts_whole_while_its_peers_are_late(runs: list[dict[str, Any]]) -> None:
    """The Plan counts an all-gather's result from its issue; the measurement must too, however late
    the peers' parts come: without ``_resident_from_allocation`` rank 0 measured its own part only
    (4 of 16 MiB) while its peers slept, and zero3_acc2_once 3-6% under the Plan on a loaded machine."""
    seen = runs[0]["late_gather"]
    assert seen >= LATE_GATHER_BYTES, (
        f"{seen / 2**20:.1f} MiB resident just after issuing a {LATE_GATHER_BYTES / 2**20:.0f} MiB all-gather")


@pytest.mark.parametrize("stack", NOT_UNDER)
def test_a_relus_result_and_its_gradient_are_counted(runs: list[dict[str, Any]], stack: str) -> None:
    """The Plan is not under the measured peak where a ReLU between two Linears keeps its result to its own
    backward, beside the gradient of that result (the Plan said 0.77 of it, counting the result only to the
    second Linear's backward and the gradient nowhere), nor over it by a gradient not yet made: without
    shard_params it counted every gradient from the first backward on, the first Linear's (8 MiB) at the
    ReLU's backward, where the peak is (1.11x the measured peak here, 1.13x a one-device BERT's). Each layer's
    gradients count from its own backward now: within 3% (1.00-1.01)."""
    _not_under(runs, stack, over=1.03)


def _not_under(runs: list[dict[str, Any]], stack: str, over: float) -> None:
    """Every rank's Plan at least 0.97 of its measured peak and at most ``over`` times it."""
    plan = next(rank["plans"][stack] for rank in runs if stack in rank["plans"])
    for r, rank in enumerate(runs):
        measured, held = rank["measured"][stack]
        predicted = plan[r] - held
        assert 0.97 * measured <= predicted <= over * measured, (
            f"{stack}: rank {r} measured {measured / 2**20:.1f} MiB, the Plan says {predicted / 2**20:.1f} MiB")


@pytest.mark.parametrize("stack", ZERO_BUBBLE)
def test_zero_bubble_records_are_held_from_the_input_pass_to_the_weight_pass(runs: list[dict[str, Any]],
                                                                            stack: str) -> None:
    """The Plan held a zero-bubble input pass's records from the forward on, and counted the output's gradient
    among them beside the loss's own at the I: 1.18x the measured peak of zb_h1's last rank (1.23-1.31x zb_v's).
    They are made at the I and held to the W now: 0.99-1.06 here, 1.09 on zb_h1's last rank of two (its loss's graph,
    held to the W, counted at its most there), so this holds it from below and to 15% above."""
    _not_under(runs, stack, over=1.15)
