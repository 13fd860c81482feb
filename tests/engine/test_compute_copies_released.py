"""A precision policy's compute copies live only as long as a step reads them.

ZeRO-1/2 and the stacks without shard_params cast every parameter a rank holds into a compute copy at
the step's start. They held every copy to the step's end (the executor's dict of them, the leaves
detached from them and the bound layers): under bf16 that is half the parameters' bytes beside the
gradient shards the reduce-scatters make and the update's allocations. ZeRO-2 + bf16 peaked 94 MiB
above ZeRO-2 in float32 on benchmarks/memory.py's 200 MB model (606 against 512 MiB a rank, world 2).
Now a unit's copy goes at its bucket's reduce-scatter, when its gradients are final, and any left at
``finish_grads``. ZeRO-3 cast every shard at the step's start and held the copies to its end; it now
casts each unit's shard as its all-gather is issued and frees the copy at the wait. Weak references
to the copies say when they are really freed (not only dropped from a dict).

Under a policy that narrows (bf16 from f32) ZeRO-1/2 now hold shards at rest, as ZeRO-3 does, and
gather each unit in the compute dtype before its first forward: that gathered unit is the compute
copy, freed after its last backward. The cast copies of whole parameters are left to policies that
do not narrow (here one that widens: bf16 stored, f32 computed).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.plan.actions import FINISH_GRADS, REDUCE_SCATTER, WAIT_GATHER
from shardwise.engine.run import executor
from shardwise.testing.models import mlp

POLICY = "params=f32,compute=bf16,output=bf16"
WIDENING = "params=bf16,compute=f32,output=f32"  # ZeRO-1/2 keep whole parameters, and cast copies of them
LAYERS = {"0", "2", "4", "6"}  # the Linear layers of mlp([8, 16, 16, 16, 4])
_thread = threading.local()  # ``see(executor, action)`` of the thread's step being watched


@pytest.fixture(autouse=True)
def _watched_actions() -> Iterator[None]:
    """Executor._call calls the running thread's ``_thread.see`` after each action, where it is set
    (patched once for the test: rank threads share the class)."""
    original = executor.Executor._call

    def traced(self: Any, handler: Any, action: Any) -> None:
        original(self, handler, action)
        see = getattr(_thread, "see", None)
        if see is not None:
            see(self, action)

    executor.Executor._call = traced  # type: ignore[method-assign]
    try:
        yield
    finally:
        executor.Executor._call = original  # type: ignore[method-assign]


def _step(stage: int | None, policy: str = POLICY) -> tuple[sw.Step, dict[str, Any], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([8, 16, 16, 16, 4]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-3, inplace=True))
    if stage is not None:  # (ZeRO-1/2: a bucket per layer; ZeRO-3 reduces a unit at a time)
        step = sw.shard_params(step, "dp", stage=stage, bucket_mb=1e-6 if stage < 3 else None)
    return sw.mixed_precision(step, policy), params, (torch.randn(8, 8), torch.randn(8, 4))


def _second_step(step: sw.Step, params: dict[str, Any], batch: Any, mesh: sw.Mesh | None,
                 see: Callable[[Any, Any], None]) -> None:
    """Two steps on this rank, ``see`` watching the second's actions (the first sets things up)."""
    state = step.init(params, mesh)
    state, _ = step(state, batch)
    _thread.see = see
    try:
        step(state, batch)
    finally:
        _thread.see = None


def _copies_alive(step: sw.Step, params: dict[str, Any], batch: Any, mesh: sw.Mesh | None,
                  compute: torch.dtype = torch.bfloat16) -> list[tuple[Any, set[str]]]:
    """After each action of this rank's second step: (the action, the layers whose compute copy (of
    dtype ``compute``) is alive)."""
    refs: dict[str, list[weakref.ref[torch.Tensor]]] = {}
    seen: list[tuple[Any, set[str]]] = []

    def see(ex: Any, action: Any) -> None:
        if not refs:  # the copies the step made, taken after its first action
            for layer, tensors in ex.source.compute.items():
                refs[layer] = [weakref.ref(t) for t in tensors.values() if t.dtype == compute]
        seen.append((action, {layer for layer, rs in refs.items() if any(r() is not None for r in rs)}))

    _second_step(step, params, batch, mesh, see)
    return seen


def test_zero2_frees_each_layers_compute_copy_at_its_reduce_scatter() -> None:
    step, params, batch = _step(stage=2, policy=WIDENING)

    def rank() -> None:
        seen = _copies_alive(step, params, batch, sw.Mesh(dp=2), torch.float32)
        assert seen[0][1] == LAYERS, seen[0]  # the copies were made, and are alive at the first action
        reduced: set[str] = set()
        for action, alive in seen:
            if action.kind == REDUCE_SCATTER:
                reduced |= set(action.units or (action.layer,))
            assert not alive & reduced, (action, alive, reduced)  # each freed at its reduce-scatter
            if action.kind == FINISH_GRADS:
                assert not alive, alive
        assert reduced == LAYERS

    sw.launch(rank, 2)


def test_without_shard_params_the_copies_go_at_finish_grads() -> None:
    step, params, batch = _step(stage=None)
    seen = _copies_alive(step, params, batch, None)
    kinds = [action.kind for action, _ in seen]
    finish = kinds.index(FINISH_GRADS)
    assert all(alive == LAYERS for _, alive in seen[:finish]), seen[:finish]
    assert not any(alive for _, alive in seen[finish:])  # the update runs without them


def test_zero3_casts_each_shard_at_its_gather_and_frees_it_at_the_wait() -> None:
    step, params, batch = _step(stage=3)

    def rank() -> None:
        in_flight: list[tuple[str, int]] = []

        def see(ex: Any, action: Any) -> None:
            assert all(t.dtype == torch.bfloat16 for t in ex._gather_inputs.values())
            in_flight.append((action.kind, len(ex._gather_inputs)))

        _second_step(step, params, batch, sw.Mesh(dp=2), see)
        assert max(n for _, n in in_flight) >= 1  # a cast copy is sent while a gather is in flight
        assert max(n for _, n in in_flight) <= 2  # this unit's, and the one prefetched: never all four
        assert in_flight[-1][1] == 0 and [n for kind, n in in_flight if kind == FINISH_GRADS] == [0]
        assert any(kind == WAIT_GATHER for kind, _ in in_flight)

    sw.launch(rank, 2)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_under_bf16_gathers_each_unit_and_frees_it_after_its_last_backward(stage: int) -> None:
    """A policy that narrows: no cast copy of whole parameters (the state holds f32 shards); each unit
    is gathered in bf16 (its shard cast as the gather is issued, the cast freed at the wait), read by
    its forward and backward, and freed after its last backward, before the gradients are reduced."""
    step, params, batch = _step(stage=stage)

    def rank() -> None:
        gathered: list[tuple[Any, set[str], int]] = []

        def see(ex: Any, action: Any) -> None:
            assert ex.source.compute is None  # nothing cast from whole parameters
            assert all(t.dtype == torch.bfloat16 for t in ex._gather_inputs.values())
            assert all(t.dtype == torch.bfloat16 for unit in ex._view.values() for t in unit.values())
            held = sum(b.untyped_storage().nbytes() for b in ex._buffers.values())
            gathered.append((action, set(ex._view), held))

        _second_step(step, params, batch, sw.Mesh(dp=2), see)
        kinds = [action.kind for action, _, _ in gathered]
        assert {action.layer for action, _, _ in gathered if action.kind == WAIT_GATHER} == LAYERS
        assert kinds.count(WAIT_GATHER) == len(LAYERS)  # once a step each
        for action, units, _ in gathered:
            if action.kind == REDUCE_SCATTER:  # freed before its gradient is reduced
                assert not units & set(action.units or (action.layer,)), (action, units)
        finish = kinds.index(FINISH_GRADS)
        assert not gathered[finish][1] and gathered[finish][2] == 0  # every unit freed for real
        assert max(len(units) for _, units, _ in gathered) == len(LAYERS)  # kept from forward to backward

    sw.launch(rank, 2)
