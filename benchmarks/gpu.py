"""Checks for a machine with a CUDA device: do the transforms run there, and how fast is bf16?

Run it from the repository root, on a machine with a CUDA device:

    python benchmarks/gpu.py                       # about 2 minutes on one H200
    python benchmarks/gpu.py --out gpu.jsonl --steps 30
    python benchmarks/gpu.py --device cpu --quick  # the same code paths on the CPU (a dry run)

CI has no GPU, so none of this runs in the test suite (the suite's
``tests/transforms/test_default_device.py`` catches, on the CPU, the tensors a
transform would make on the wrong device). One JSON object per check on
stdout (and in ``--out``).

What is checked
---------------
``"kind": "equivalence"``: ``sw.testing.assert_equivalent`` with parameters and
batches on the device, ranks as threads of this process sharing it:
``shard_params`` stage 1/2/3 (MLP and GPT, float64), every built-in pipeline
schedule over ``pp=2`` (MLP, float64), a GPT pipeline, tensor parallel off an accelerator (tp 2
with and without sequence parallel, dp 2 x tp 2 with ZeRO-3; TinyGPT, float64: on one, thread
ranks cannot run it, see ``processes``), the README's
composition of all four transforms on ``dp=2 x pp=2`` (bf16 compute), fp16 with
dynamic loss scaling under ``shard_params`` and full remat under it. ``ok`` is
true when the distributed step matched its reference and every tensor of the
state and metrics after a step is on the parameters' device (0-d CPU tensors
aside: step counters and host-known metrics); otherwise ``error`` holds the
exception and the innermost frames.

``"kind": "process_group"``: a child process sets up ``torch.distributed`` by
hand at world 1 (``nccl`` and ``cpu:gloo,cuda:nccl`` on a GPU, ``gloo`` on the
CPU): ``psum`` and ``all_gather`` on the device, then ``shard_params`` stage 3
and a 1F1B pipeline (``pp=1``) against the single-device step. World 1 because
NCCL refuses two ranks on one GPU.

``"kind": "processes"``: two gloo processes sharing the device, the MLP's
parameters and batches on it (float64): four pipeline schedules, whose
messages are staged through the CPU (gloo's point to point moves CPU tensors),
and ZeRO-3; TinyGPT under tensor parallel (tp 2, with and without sequence
parallel, and under full remat), context parallel (ring and Ulysses, cp 2) and an MoE under expert
parallel (ep 2), whose collectives run inside the backward, which torch runs on
the device's own autograd thread; each against the single-device step on the
device (``rtol`` 1e-12).

``"kind": "speed"``: each ``--gpt`` in one process, the same weights and
batches for every variant, stepped round-robin, AdamW everywhere:

* ``torch:f32``: the ``nn.Module`` with ``torch.optim.AdamW``;
* ``torch:bf16_autocast``: the same under ``torch.autocast(bfloat16)`` (matmuls
  in bf16; LayerNorm, softmax and the residual stream in fp32);
* ``torch:bf16_pure``: what ``mixed_precision("compute=bf16,output=f32")`` computes, written
  in torch: a bf16 copy of the module runs forward and backward, its gradients
  are cast to fp32 for the fp32 master weights' AdamW;
* ``ours:f32``: ``sw.train_step(..., metrics=("loss",))`` (torch's loop computes no gradient
  norm either); ``ours:bf16``: ``sw.mixed_precision(step, "compute=bf16,output=f32")``, which
  also checks every gradient for a non-finite value and reads that flag on the host (a step
  with one is skipped; torch's pure bf16 loop checks nothing); ``ours:zero3_dp1_f32``:
  ``sw.shard_params(step, "dp", stage=3)`` on one rank.

``median_step_s`` is the median of ``--steps`` timed steps (synchronized before
and after), ``ratio_to_torch`` divides it by ``torch:f32``'s for fp32 variants
and by ``torch:bf16_pure``'s for ours:bf16 (the same arithmetic);
``ratio_to_autocast`` by ``torch:bf16_autocast``'s. ``peak_memory_bytes`` is
``torch.cuda.max_memory_allocated`` over a step, ``tflops`` counts 6 x
parameters x tokens plus attention. ``losses`` lists the loss of every step:
variants with the same arithmetic should track each other.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.nn.functional as F
from _common import emit, environment, lm_loss, note

import shardwise as sw
from shardwise.collectives.backends.processes import _free_port  # the launcher's own port probe
from shardwise.testing.equivalence import compare_histories, record_history
from shardwise.testing.models import Block, MoEBlock, TinyGPT, mlp

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v")
Check = Callable[[], dict[str, Any]]


def _frames(tb: Any) -> list[str]:
    return [f"{f.filename.split('shardwise/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(tb)[-4:]]


def error_row(exc: BaseException) -> dict[str, Any]:
    row: dict[str, Any] = {
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}"[:2000],
        "where": _frames(exc.__traceback__),
    }
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        row["cause"] = f"{type(cause).__name__}: {cause}"[:2000]
        row["cause_where"] = _frames(cause.__traceback__)
    return row


def run_check(name: str, kind: str, fn: Check) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        row = {"ok": True, **fn()}
    except Exception as exc:  # every failure is reported; the next check still runs
        row = error_row(exc)
    return {"kind": kind, "check": name, **row, "seconds": round(time.perf_counter() - started, 2)}


# -- equivalence on the device, ranks as threads ------------------------------------------------
Case = tuple[sw.Chain, Any, list[Any]]


def mlp_case(device: torch.device, dtype: torch.dtype, seed: int = 0) -> Case:
    torch.manual_seed(seed)
    chain, params = sw.functionalize(mlp([12, 32, 32, 32, 32, 6]).to(device, dtype))
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [
        (
            torch.randn(16, 12, generator=gen, dtype=dtype).to(device),
            torch.randn(16, 6, generator=gen, dtype=dtype).to(device),
        )
        for _ in range(3)
    ]
    return chain, params, batches


def mlp_problem(device: torch.device) -> tuple[sw.Step, Any, list[Any]]:
    """The float64 MLP's step (SGD with momentum, clipped to norm 1), parameters and batches."""
    chain, params, batches = mlp_case(device, torch.float64)
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=1.0), params, batches


def gpt_case(device: torch.device, dtype: torch.dtype, seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16).to(device, dtype)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(3):
        tokens = torch.randint(64, (8, 17), generator=gen).to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return chain, params, batches


def tp_gpt_problem(device: torch.device) -> tuple[sw.Step, Any, list[Any]]:
    """TinyGPT split per block (units=Block: the attention's widths come from its projections), its
    vocabulary-parallel loss, float64 on ``device``."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16).to(device, torch.float64)
    chain, params = sw.functionalize(model, units=Block)
    _, _, batches = gpt_case(device, torch.float64)
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o, y),
                         sw.optim.sgd(0.1, momentum=0.9), clip_norm=1.0)
    return step, params, batches


def tp_variant(step: sw.Step, sequence_parallel: bool, mesh: sw.Mesh) -> sw.Step:
    """Tensor parallel over ``tp`` (with sequence parallel), under ZeRO-3 where the mesh has ``dp``."""
    sp = "blocks.*" if sequence_parallel else None
    tp = sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(), sequence_parallel=sp)
    return sw.shard_params(tp, "dp", stage=3) if "dp" in mesh.axis_names else tp


def state_devices(step: Any, params: Any, mesh: sw.Mesh, batch: Any) -> list[str]:
    """The devices of the tensors in every rank's state and metrics after one step (sorted strings).

    0-d tensors on the CPU are left out: the optimizers' step counters, kept on
    the host as torch.optim keeps its ``step``, and metrics the host knew (the
    loss scale).
    """

    def main() -> set[str]:
        state = step.init(params, sw.Mesh(**mesh.shape))
        state, metrics = step(state, batch)
        leaves = optree.tree_leaves((state.params, state.opt_state, state.loss_scale, metrics))
        return {
            str(t.device)
            for t in leaves
            if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)
        }

    per_rank = sw.launch(main, mesh.size)
    return sorted(set().union(*per_rank))


def equivalence(step: Any, reference: Any, mesh: sw.Mesh, batches: list[Any], params: Any, **kw: Any) -> dict[str, Any]:
    report = sw.testing.assert_equivalent(step, reference, mesh, batches, params, **kw)
    devices = state_devices(step, params, mesh, batches[0])
    want = str(optree.tree_leaves(params)[0].device)
    if devices != [want]:
        raise AssertionError(f"state or metric tensors on {devices}, parameters on {want}")
    return {"report": str(report), "state_devices": devices}


def equivalence_checks(device: torch.device, quick: bool) -> list[tuple[str, Check]]:
    f64 = torch.float64
    sgd = sw.optim.sgd(0.1, momentum=0.9)
    checks: list[tuple[str, Check]] = []

    def shard(model: str, stage: int) -> dict[str, Any]:
        chain, params, batches = (mlp_case if model == "mlp" else gpt_case)(device, f64)
        step = sw.train_step(chain, F.mse_loss if model == "mlp" else lm_loss, sgd, clip_norm=1.0)
        return equivalence(sw.shard_params(step, "dp", stage=stage), step, sw.Mesh(dp=2), batches, params)

    for model in ("mlp", "gpt"):
        for stage in (1, 2, 3) if model == "mlp" or not quick else (3,):
            checks.append((f"shard_params:{model}:stage{stage}", lambda m=model, s=stage: shard(m, s)))

    def pipe(schedule: str) -> dict[str, Any]:
        step, params, batches = mlp_problem(device)
        return equivalence(sw.pipeline(step, "pp", schedule, microbatches=4), step, sw.Mesh(pp=2), batches, params)

    for schedule in SCHEDULES[:1] if quick else SCHEDULES:
        checks.append((f"pipeline:mlp:{schedule}", lambda s=schedule: pipe(s)))

    def pipe_gpt() -> dict[str, Any]:
        chain, params, batches = gpt_case(device, f64)
        step = sw.train_step(chain, lm_loss, sgd)
        return equivalence(sw.pipeline(step, "pp", "1f1b", microbatches=2), step, sw.Mesh(pp=2), batches, params)

    def composed() -> dict[str, Any]:  # the README's second example, on the device
        chain, params, batches = mlp_case(device, torch.float32)
        step = sw.train_step(chain, F.mse_loss, sgd)
        policy = "params=f32,compute=bf16,output=f32"
        both = sw.pipeline(sw.shard_params(step, "dp", stage=3), "pp", schedule="1f1b", microbatches=2)
        all4 = sw.mixed_precision(sw.remat(both, policy=sw.policies.dots_saveable), policy, loss_scale="dynamic")
        reference = sw.mixed_precision(step, policy, loss_scale="dynamic")
        return equivalence(all4, reference, sw.Mesh(dp=2, pp=2), batches, params, rtol=2**-6)

    def fp16_scaled() -> dict[str, Any]:
        chain, params, batches = gpt_case(device, torch.float32)
        # The loss in f32: an f16 loss cannot carry the loss scale (65536 > f16 max 65504).
        step = sw.mixed_precision(sw.train_step(chain, lm_loss, sgd), "compute=f16,output=f32", loss_scale="dynamic")
        return equivalence(sw.shard_params(step, "dp", stage=3), step, sw.Mesh(dp=2), batches, params, rtol=2**-8)

    def remat() -> dict[str, Any]:
        chain, params, batches = gpt_case(device, f64)
        step = sw.train_step(chain, lm_loss, sgd)
        rematted = sw.shard_params(sw.remat(step, policy=sw.policies.nothing_saveable), "dp", stage=3)
        return equivalence(rematted, step, sw.Mesh(dp=2), batches, params)

    def tensor_parallel(sequence_parallel: bool, mesh: sw.Mesh) -> dict[str, Any]:
        step, params, batches = tp_gpt_problem(device)
        return equivalence(tp_variant(step, sequence_parallel, mesh), step, mesh, batches, params)

    # On an accelerator thread ranks cannot run tensor parallel: its collectives run inside the
    # backward, which torch runs for every thread rank on the device's one thread (the threads backend
    # refuses them there). There these cases run as processes (process_checks).
    if device.type == "cpu" and not quick:  # the dry run keeps one case per code path: dp x tp below
        checks += [
            ("tensor_parallel:gpt:tp2", lambda: tensor_parallel(False, sw.Mesh(tp=2))),
            ("tensor_parallel:gpt:tp2:sequence_parallel", lambda: tensor_parallel(True, sw.Mesh(tp=2))),
        ]
    if device.type == "cpu":
        checks.append(("tensor_parallel:gpt:dp2xtp2:stage3", lambda: tensor_parallel(True, sw.Mesh(dp=2, tp=2))))
    checks += [
        ("pipeline:gpt:1f1b", pipe_gpt),
        ("composed:dp2xpp2:bf16:remat", composed),
        ("shard_params:gpt:stage3:fp16_dynamic_scale", fp16_scaled),
        ("remat:gpt:nothing_saveable:stage3", remat),
    ]
    return checks


# -- a hand-made process group at world 1, in a child process -----------------------------------
def process_group_child(backend: str, device_name: str) -> dict[str, Any]:
    """Runs in the child: init the group, collectives on the device, two steps against one device."""
    import torch.distributed as dist

    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        out: dict[str, Any] = {}
        mesh = sw.Mesh(dp=1)
        x = torch.arange(4.0, device=device)
        total = sw.collectives.psum(x, "dp", mesh=mesh)
        gathered = sw.collectives.all_gather(x, "dp", mesh=mesh)
        out["psum_device"], out["all_gather_device"] = str(total.device), str(gathered.device)
        if not torch.equal(total, x) or not torch.equal(gathered.reshape(-1), x):
            raise AssertionError(f"world-1 psum/all_gather changed the values: {total}, {gathered}")
        step, params, batches = mlp_problem(device)
        expected = record_history(step, step.init(params), batches)
        variants = (
            ("shard_params_stage3", sw.shard_params(step, "dp", stage=3), "dp"),
            ("pipeline_1f1b", sw.pipeline(step, "pp", "1f1b", 2), "pp"),
        )
        for name, distributed, axis in variants:
            got = record_history(distributed, distributed.init(params, sw.Mesh(**{axis: 1})), batches)
            out[name] = str(compare_histories([got], expected, rtol=1e-12))
        return out
    finally:
        dist.destroy_process_group()


def process_group_check(backend: str, device: torch.device) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--pg-child", backend, "--device", str(device)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child exited {done.returncode}: {done.stderr[-1500:]}")
    row = json.loads(lines[-1])
    if not row.pop("ok"):
        raise RuntimeError(f"{row.get('error')} at {row.get('where')} (cause {row.get('cause')})")
    return row


# -- ranks as processes on gloo, tensors on the device ------------------------------------------
PROCESS_VARIANTS = ("pipeline:gpipe", "pipeline:1f1b", "pipeline:interleaved_1f1b", "pipeline:zb_h1",
                    "shard_params:stage3", "tensor_parallel:tp2", "tensor_parallel:tp2_sequence_parallel",
                    "tensor_parallel:tp2_sequence_parallel_remat",
                    "context_parallel:ring", "context_parallel:ulysses", "expert_parallel:ep2")


def process_problem(name: str, device: torch.device) -> tuple[sw.Step, Any, list[Any]]:
    """The single-device step a variant distributes: TinyGPT for tensor and context parallel, else the MLP."""
    if name.startswith("tensor_parallel"):
        return tp_gpt_problem(device)
    if name.startswith("context_parallel"):
        chain, params, batches = gpt_case(device, torch.float64)
        return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches
    if name.startswith("expert_parallel"):
        return moe_problem(device)
    return mlp_problem(device)


def moe_problem(device: torch.device) -> tuple[sw.Step, Any, list[Any]]:
    """Two MoE blocks of four experts (top 2, then top 1) between Linears, float64 on ``device``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), MoEBlock(8, 2, 4, 4, 2), MoEBlock(8, 2, 4, 4, 1),
                                torch.nn.Linear(8, 3)).to(device, torch.float64)
    chain, params = sw.functionalize(model)
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(8, 4, n, generator=gen, dtype=torch.float64).to(device) for n in (6, 3))
               for _ in range(3)]
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def process_variant(name: str, step: Any) -> tuple[Any, sw.Mesh]:
    kind, what = name.split(":")
    if kind == "pipeline":
        return sw.pipeline(step, "pp", what, microbatches=4), sw.Mesh(pp=2)
    if kind == "tensor_parallel":  # its collectives run inside the backward, on the device's autograd thread
        if what.endswith("_remat"):  # and, recomputed there, the forward's too
            step = sw.remat(step, policy=sw.policies.nothing_saveable)
        return tp_variant(step, "sequence_parallel" in what, sw.Mesh(tp=2)), sw.Mesh(tp=2)
    if kind == "context_parallel":  # so do its attention's passes and its gradients' sums
        return sw.context_parallel(step, "cp", attention=what), sw.Mesh(cp=2)
    if kind == "expert_parallel":  # and its all-to-alls' transposes
        return sw.expert_parallel(step, "ep"), sw.Mesh(ep=2)
    return sw.shard_params(step, "dp", stage=int(what.removeprefix("stage"))), sw.Mesh(dp=2)


def process_rank(device_name: str, names: tuple[str, ...]) -> dict[str, Any]:
    """One gloo rank (a process): each variant's history on the device, moved to the CPU to travel back."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU: gloo, not NCCL, carries its tensors
    out: dict[str, Any] = {}
    for name in names:
        try:
            step, params, batches = process_problem(name, device)
            distributed, mesh = process_variant(name, step)
            history = record_history(distributed, distributed.init(params, mesh), batches)
            out[name] = optree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, history)
        except Exception as exc:  # reported per variant; the other variants still run
            out[name] = error_row(exc)
    return out


def process_checks(device: torch.device) -> list[dict[str, Any]]:
    """``PROCESS_VARIANTS`` on two gloo processes sharing ``device``, against one device."""
    expected = {}
    for name in PROCESS_VARIANTS:
        step, params, batches = process_problem(name, device)
        expected[name] = optree.tree_map(lambda t: t.cpu(), record_history(step, step.init(params), batches))
    started = time.perf_counter()
    try:
        per_rank = sw.launch(process_rank, 2, backend="processes", timeout=300.0, args=(str(device), PROCESS_VARIANTS))
    except Exception as exc:
        return [{"kind": "processes", "check": "launch", **error_row(exc)}]
    rows = []
    for name in PROCESS_VARIANTS:
        row: dict[str, Any] = {"kind": "processes", "check": name, "seconds": round(time.perf_counter() - started, 2)}
        errors = [r[name] for r in per_rank if isinstance(r[name], dict)]
        if errors:
            rows.append({**row, **errors[0]})
            continue
        try:
            report = compare_histories([r[name] for r in per_rank], expected[name], rtol=1e-12)
            rows.append({**row, "ok": True, "report": str(report)})
        except Exception as exc:
            rows.append({**row, **error_row(exc)})
    return rows


# -- speed: torch eager against ours, fp32 and bf16 ---------------------------------------------
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.999), 1e-8, 0.01


def gpt_flops(shape: dict[str, int], n_params: int, batch: int) -> float:
    tokens = batch * shape["seq_len"]
    attention = 12 * shape["n_layers"] * shape["d_model"] * shape["seq_len"] * tokens  # QK^T and AV, fwd+bwd
    return 6.0 * n_params * tokens + attention


def torch_step(base: torch.nn.Module, device: torch.device, mode: str) -> Callable[[Any], Any]:
    """One step of torch eager: ``mode`` is "f32", "bf16_autocast" or "bf16_pure" (see the docstring)."""
    master = copy.deepcopy(base)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    compute = copy.deepcopy(base).to(torch.bfloat16) if mode == "bf16_pure" else master

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        if mode == "bf16_pure":
            with torch.no_grad():
                for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                    c.copy_(m)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16_autocast"):
            logits = compute(x)
        loss = lm_loss(logits.float(), y)
        loss.backward()
        if mode == "bf16_pure":
            for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                m.grad = None if c.grad is None else c.grad.float()
                c.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def our_step(base: torch.nn.Module, device: torch.device, mode: str) -> Callable[[Any], Any]:
    """One step of ours: ``mode`` is "f32", "bf16" (mixed_precision) or "zero3" (shard_params on one rank)."""
    model = copy.deepcopy(base)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    optimizer = sw.optim.adamw(LR, BETAS, EPS, WEIGHT_DECAY, inplace=True)
    step: Any = sw.train_step(chain, lm_loss, optimizer, metrics=("loss",))
    if mode == "bf16":
        step = sw.mixed_precision(step, "compute=bf16,output=f32")
    if mode == "zero3":
        return one_rank_runner(sw.shard_params(step, "dp", stage=3), params)
    box = {"state": step.init(params)}

    def run(batch: Any) -> torch.Tensor:
        box["state"], metrics = step(box["state"], batch)
        return metrics["loss"]

    return run


def one_rank_runner(step: Any, params: Any) -> Callable[[Any], Any]:
    """A world-1 threads rank that lives across calls: each call runs one step on it; ``close`` ends it."""
    requests: queue.Queue[Any] = queue.Queue()
    replies: queue.Queue[Any] = queue.Queue()

    def main() -> None:
        state = step.init(params, sw.Mesh(dp=1))
        while (batch := requests.get()) is not None:
            try:
                state, metrics = step(state, batch)
                replies.put(metrics["loss"])
            except Exception as exc:
                replies.put(exc)
                return

    thread = threading.Thread(target=sw.launch, args=(main, 1), kwargs={"timeout": 600.0}, daemon=True)
    thread.start()

    def run(batch: Any) -> Any:
        requests.put(batch)
        reply = replies.get(timeout=600)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def close() -> None:
        requests.put(None)
        thread.join(60)

    run.close = close  # type: ignore[attr-defined]
    return run


def speed(device: torch.device, shape: dict[str, int], batch: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = TinyGPT(**shape).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        tokens = torch.randint(shape["vocab"], (batch, shape["seq_len"] + 1), generator=gen).to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    variants: dict[str, Callable[[Any], Any]] = {
        "torch:f32": torch_step(base, device, "f32"),
        "torch:bf16_autocast": torch_step(base, device, "bf16_autocast"),
        "torch:bf16_pure": torch_step(base, device, "bf16_pure"),
        "ours:f32": our_step(base, device, "f32"),
        "ours:bf16": our_step(base, device, "bf16"),
        "ours:zero3_dp1_f32": our_step(base, device, "zero3"),
    }
    cuda = device.type == "cuda"
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    peaks = dict.fromkeys(names, 0)
    losses: dict[str, list[float]] = {k: [] for k in names}
    try:
        for i in range(warmup + steps):
            data = batches[i % len(batches)]
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                loss = variants[name](data)
                if cuda:
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - start
                losses[name].append(round(float(loss), 5))
                if i >= warmup:
                    times[name].append(elapsed)
                    if cuda:
                        peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
    finally:
        for runner in variants.values():
            getattr(runner, "close", lambda: None)()
    flops = gpt_flops(shape, n_params, batch)
    median = {name: statistics.median(times[name]) for name in names}
    rows = []
    for name in names:
        same_math = "torch:bf16_pure" if "bf16" in name else "torch:f32"
        rows.append({
            "kind": "speed", "variant": name, "gpt": shape, "batch": batch, "params": n_params,
            "median_step_s": round(median[name], 5),
            "ratio_to_torch": round(median[name] / median[same_math], 3),
            "ratio_to_autocast": round(median[name] / median["torch:bf16_autocast"], 3),
            "tflops": round(flops / median[name] / 1e12, 1), "peak_memory_bytes": peaks[name],
            "losses": losses[name],
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per speed variant (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument(
        "--gpt", default="8192,1024,16,8,1024;1024,256,4,4,128",
        help="vocab,d_model,n_heads,n_layers,seq_len of each speed GPT, ';' between GPTs "
        "(default: one compute-bound GPT and the CPU benchmarks' small one)",
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per speed step (default 8)")
    parser.add_argument(
        "--quick", action="store_true", help="one equivalence case per code path (the CPU dry run) and a tiny speed GPT"
    )
    parser.add_argument("--only", default="equivalence,process_group,processes,speed", help="which kinds to run")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    parser.add_argument("--pg-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.pg_child:
        row = run_check(args.pg_child, "process_group", lambda: process_group_child(args.pg_child, args.device))
        print(json.dumps(row), flush=True)
        return
    env = environment(keys=("cores", "torch", "shardwise"))
    env["device"] = str(device)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    kinds = args.only.split(",")
    out = open(args.out, "w") if args.out else None  # noqa: SIM115 (closed below)
    try:
        if "equivalence" in kinds:
            for name, fn in equivalence_checks(device, args.quick):
                emit({**run_check(name, "equivalence", fn), **env}, out)
        if "process_group" in kinds:
            for backend in ("nccl", "cpu:gloo,cuda:nccl") if device.type == "cuda" else ("gloo",):
                row = run_check(backend, "process_group", lambda b=backend: process_group_check(b, device))
                emit({**row, **env}, out)
        if "processes" in kinds:
            for row in process_checks(device):
                emit({**row, **env}, out)
        if "speed" in kinds:
            keys = ("vocab", "d_model", "n_heads", "n_layers", "seq_len")
            shapes = [dict(zip(keys, map(int, gpt.split(",")), strict=True)) for gpt in args.gpt.split(";")]
            if args.quick:
                shapes = [{"vocab": 256, "d_model": 64, "n_heads": 2, "n_layers": 2, "seq_len": 32}]
            for shape in shapes:
                note(f"# speed: GPT {shape}, batch {args.batch}, {args.steps} steps")
                try:
                    for row in speed(device, shape, args.batch, args.steps, args.warmup):
                        emit({**row, **env}, out)
                except Exception as exc:
                    emit({"kind": "speed", "gpt": shape, **error_row(exc), **env}, out)
    finally:
        if out is not None:
            out.close()


if __name__ == "__main__":
    main()
