"""A step's backward may run on a thread of its own: on CUDA it does.

torch's autograd engine runs the backward nodes of a device's tensors on one thread per device, not on
the thread that called ``backward``. Python's context variables (the current mesh and backend, the
Plan's prediction) are not there: a Python thread starts in an empty context, as that one does. The
layers' collectives whose backward (or remat recomputation) finds its group by axis name (tensor
parallel's; a gradient summed over an axis: sequence, context and expert parallel's) take it from
their forward's context (``in_layer.ForwardContext``); without it each case here fails as the GPU
did. Here every backward the engine is asked for runs on a new thread, which is what CUDA does to
them, on the CPU: on gloo processes, as ranks on GPUs run (thread ranks share that one device
thread: there a collective inside the backward is refused, tests/collectives/test_mesh_and_threads.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine import torch_api
from shardwise.testing.models import Block, TinyGPT

pytestmark = pytest.mark.gloo

VOCAB, SEQ, BATCH = 64, 8, 4


def _on_a_thread_of_its_own(run: Callable[..., Any], ran: list[int]) -> Callable[..., Any]:
    def on_its_thread(*args: Any, **kwargs: Any) -> Any:
        out: dict[str, Any] = {}

        def target() -> None:
            ran.append(threading.get_ident())
            try:
                out["value"] = run(*args, **kwargs)
            except BaseException as exc:  # raised again on the caller's thread
                out["error"] = exc

        thread = threading.Thread(target=target, name="autograd-device-thread-stand-in", daemon=True)
        thread.start()
        thread.join(120)
        if thread.is_alive():
            raise TimeoutError("the backward on a thread of its own did not end in 120 s")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    return on_its_thread


@contextlib.contextmanager
def _backward_elsewhere() -> Iterator[list[int]]:
    """Within: every backward the engine is asked for runs on a new thread; yields those threads."""
    ran: list[int] = []
    engine, backward = torch_api._ENGINE_RUN_BACKWARD, torch.autograd.backward
    if engine is not None:
        torch_api._ENGINE_RUN_BACKWARD = _on_a_thread_of_its_own(engine, ran)
    torch.autograd.backward = _on_a_thread_of_its_own(backward, ran)
    try:
        yield ran
    finally:  # the pool's processes run other tests after this one
        torch_api._ENGINE_RUN_BACKWARD, torch.autograd.backward = engine, backward


def _problem() -> tuple[sw.Step, Any, list[Any]]:
    """TinyGPT split per block, float64, its vocabulary-parallel loss (benchmarks/gpu.py's case)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = TinyGPT(vocab=VOCAB, d_model=32, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=Block)
    step = sw.train_step(chain, lambda o, y: sw.tp.vocab_parallel_cross_entropy(o, y),
                         sw.optim.sgd(0.1, momentum=0.9), clip_norm=1.0)
    batches = [(torch.randint(VOCAB, (BATCH, SEQ), generator=gen), torch.randint(VOCAB, (BATCH, SEQ), generator=gen))
               for _ in range(2)]
    return step, params, batches


def _distributed(case: str) -> tuple[sw.Step, sw.Mesh]:
    step, _, _ = _problem()
    tp = sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(), sequence_parallel="blocks.*")
    if case == "tp4-sp":
        return tp, sw.Mesh(tp=4)
    return sw.shard_params(tp, "dp", 3), sw.Mesh(dp=2, tp=2)


def _run_rank(case: str) -> tuple[list[Any], int]:
    step, mesh = _distributed(case)
    _, params, batches = _problem()
    with _backward_elsewhere() as ran:
        history = sw.testing.record_history(step, step.init(params, mesh), batches)
    return history, len(set(ran))


@pytest.mark.parametrize("case", ["tp4-sp", "dp2xtp2-zero3"])
def test_tensor_parallel_is_the_single_device_step_when_its_backward_runs_on_another_thread(
        case: str, gloo4: Any) -> None:
    """Tensor parallel's sums and gathers in backward (sequence parallel's too, and the norms' weights'
    gradients summed over the axis), alone and under ZeRO-3."""
    got = gloo4.run(_run_rank, case)
    assert all(threads > 0 for _, threads in got), "no backward ran on a thread of its own: nothing was tested"
    step, params, batches = _problem()
    expected = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories([history for history, _ in got], expected, rtol=1e-12)


def test_the_plan_of_a_tensor_parallel_step_is_the_same_when_its_backward_runs_on_another_thread() -> None:
    """The Plan predicts each layer's collectives on fake tensors, backward included (the transposes,
    a norm weight's gradient summed): they are recorded into the forward's prediction wherever the
    backward runs."""
    step, params, batches = _problem()
    tp = sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(), sequence_parallel="blocks.*")
    mesh = sw.Mesh(tp=4)
    here = tp.plan(mesh, params, batches[0])
    with _backward_elsewhere() as ran:
        elsewhere = tp.plan(mesh, params, batches[0])
    assert ran, "no backward ran on a thread of its own: nothing was tested"
    assert str(elsewhere) == str(here)
    assert sum(1 for line in str(here).splitlines() if "backward" in line) > 0


def _cp_problem() -> tuple[sw.Step, Any, list[Any]]:
    """TinyGPT d16 whose sequence is cut over ``cp`` (tests/transforms/context_parallel's case)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, lambda o, y: torch.nn.functional.cross_entropy(o.flatten(0, 1), y.flatten()),
                         sw.optim.sgd(0.1, momentum=0.9))
    ids = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(2)]
    return step, params, [(i[:, :-1], i[:, 1:]) for i in ids]


def _cp_rank(attention: str) -> tuple[list[Any], int]:
    step, params, batches = _cp_problem()
    cp = sw.context_parallel(step, "cp", attention=attention)
    with _backward_elsewhere() as ran:
        history = sw.testing.record_history(cp, cp.init(params, sw.Mesh(cp=2)), batches)
    return history, len(set(ran))


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_context_parallel_is_the_single_device_step_when_its_backward_runs_on_another_thread(
        attention: str, gloo2: Any) -> None:
    """Ring attention's passes and Ulysses' all-to-alls in backward, and the gradients of the weights
    every rank holds summed over the sequence's shares."""
    got = gloo2.run(_cp_rank, attention)
    assert all(threads > 0 for _, threads in got), "no backward ran on a thread of its own: nothing was tested"
    step, params, batches = _cp_problem()
    expected = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories([history for history, _ in got], expected, rtol=1e-12)


def _moe_problem() -> tuple[sw.Step, Any, list[Any]]:
    """Two MoE blocks of four experts (top 2, then top 1) between Linears (tests/transforms/expert_parallel's)."""
    from shardwise.testing.models import MoEBlock

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), MoEBlock(8, 2, 4, 4, 2), MoEBlock(8, 2, 4, 4, 1),
                                torch.nn.Linear(8, 3)).double()
    chain, params = sw.functionalize(model)
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(8, 4, n, generator=gen, dtype=torch.float64) for n in (6, 3)) for _ in range(2)]
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def _ep_rank() -> tuple[list[Any], int]:
    step, params, batches = _moe_problem()
    ep = sw.expert_parallel(step, "ep")
    with _backward_elsewhere() as ran:
        history = sw.testing.record_history(ep, ep.init(params, sw.Mesh(ep=2)), batches)
    return history, len(set(ran))


def test_expert_parallel_is_the_single_device_step_when_its_backward_runs_on_another_thread(gloo2: Any) -> None:
    """The dispatch's and the combine's all-to-alls transposed in backward, the replicated weights'
    gradients summed over the batch's shares."""
    got = gloo2.run(_ep_rank)
    assert all(threads > 0 for _, threads in got), "no backward ran on a thread of its own: nothing was tested"
    step, params, batches = _moe_problem()
    expected = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories([history for history, _ in got], expected, rtol=1e-12)


def _remat_tp_rank() -> tuple[list[Any], int]:
    step, params, batches = _problem()
    tp = sw.tensor_parallel(sw.remat(step, policy=sw.policies.nothing_saveable), "tp", sw.tp.tiny_gpt_plan(),
                            sequence_parallel="blocks.*")
    with _backward_elsewhere() as ran:
        history = sw.testing.record_history(tp, tp.init(params, sw.Mesh(tp=4)), batches)
    return history, len(set(ran))


def test_a_remat_region_recomputed_on_another_thread_finds_its_forwards_mesh(gloo4: Any) -> None:
    """Tensor parallel under full remat: the blocks' forwards, collectives and all, run again inside the
    backward (torch's checkpoint recomputes as autograd unpacks what it saved), on its thread."""
    got = gloo4.run(_remat_tp_rank)
    assert all(threads > 0 for _, threads in got), "no backward ran on a thread of its own: nothing was tested"
    step, params, batches = _problem()
    expected = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories([history for history, _ in got], expected, rtol=1e-12)
