"""Runs a sharded rank's actions: gathers, frees, reductions around the engine's executor.

The engine's :class:`Executor` does forward, loss and backward per layer; this
runtime owns what sharding adds. Gathered units live in ``params_view`` (the
executor reads parameters from it, so a layer whose unit is not gathered fails
loudly), gradients accumulate in one dict shared by the micro-batches, and
every collective goes through the async collectives so it is overlapped and
recorded in the ledger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ...collectives.ops import all_gather_async, psum, psum_scatter_async
from ...engine._storage import free_storage, owns_storage, refill_storage
from ...engine.chain import Chain
from ...engine.executor import Executor, LossFn
from ...engine.flat import UnitLayout
from ...engine.metrics import EXCHANGE_METRICS, NOTHING_SUMMED, MetricExchange, Summed
from ...engine.plan import BACKWARD, FORWARD, LOSS, UPDATE, Action
from .lowering import (
    FREE,
    GATHER,
    GATHER_PARAMS,
    REDUCE_METRICS,
    REDUCE_SCATTER,
    WAIT_GATHER,
    WAIT_PARAMS,
    WAIT_REDUCE,
)


@dataclass
class ShardRuntime:
    """One rank's step: ``run(actions)`` leaves gradient shards and the summed metric values."""

    chain: Chain
    loss_fn: LossFn
    mesh: Mesh
    axis: str
    layouts: Mapping[str, UnitLayout]
    shards: Mapping[str, torch.Tensor]  # this rank's master parameter shards, by unit
    full_params: Mapping[str, Mapping[str, torch.Tensor]] | None  # stage 1/2: replicated params
    microbatches: Sequence[tuple[Any, Any]]
    loss_scale: float  # seeds every micro-batch's backward (1/(N k) times the precision loss scale)
    grad_scale: float = 1.0  # the precision loss scale, divided out of the reduced gradients
    gather_from: Mapping[str, torch.Tensor] | None = None  # compute-dtype shards to gather (mixed precision)
    reduce_dtype: torch.dtype | None = None  # dtype gradients travel in (mixed precision)
    # What the ranks sum after the backward (the step's metrics, the norm to clip by, the finite flag).
    exchange: MetricExchange = EXCHANGE_METRICS
    summed: Summed = NOTHING_SUMMED
    params_view: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    grads: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    grad_shards: dict[str, torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    gathered_bytes: int = 0
    peak_gathered_bytes: int = 0
    _pending_gathers: dict[str, Any] = field(default_factory=dict)
    _pending_reduces: dict[str, Any] = field(default_factory=dict)
    _executors: dict[int, Executor] = field(default_factory=dict)
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # each unit's gathered flat buffer
    _in_flight_bytes: int = 0
    new_shards: dict[str, torch.Tensor] = field(default_factory=dict)  # after the update
    new_full_params: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage 1/2

    def __post_init__(self) -> None:
        if self.full_params is not None:
            self.params_view = {k: dict(v) for k, v in self.full_params.items()}
        # Layers without parameters still need an (empty) entry to read from.
        for name in self.chain.names:
            if name not in self.layouts:
                self.params_view.setdefault(name, {})

    # -- dispatch ---------------------------------------------------------------
    def run(self, actions: Sequence[Action], update: Any) -> None:
        handlers = {
            GATHER: self.gather,
            WAIT_GATHER: self.wait_gather,
            FREE: self.free,
            REDUCE_SCATTER: self.reduce_scatter,
            WAIT_REDUCE: self.wait_reduce,
            REDUCE_METRICS: self.reduce_metrics,
            UPDATE: update,
            GATHER_PARAMS: self.gather_params,
            WAIT_PARAMS: self.wait_params,
        }
        for action in actions:
            if action.kind in (FORWARD, LOSS, BACKWARD):
                executor = self._executor(action.microbatch or 0)
                {FORWARD: executor.forward, LOSS: executor.compute_loss, BACKWARD: executor.backward}[
                    action.kind
                ](action)
                if action.kind == LOSS and executor.loss is not None:
                    self.losses.append(executor.loss)
            elif action.kind in handlers:
                handlers[action.kind](action)
            else:
                raise ValueError(f"shard_params runtime has no handler for action {action}")

    def _executor(self, mb: int) -> Executor:
        if mb not in self._executors:
            inputs, targets = self.microbatches[mb]
            self._executors[mb] = Executor(
                self.chain, self.loss_fn, self.params_view, inputs, targets,
                loss_scale=self.loss_scale, grads=self.grads,
            )
        return self._executors[mb]

    # -- parameters ---------------------------------------------------------------
    def gather(self, action: Action) -> None:
        unit = _unit(action)
        source = self.shards if self.gather_from is None else self.gather_from
        self._pending_gathers[unit] = all_gather_async(source[unit], self.axis, tiled=True, mesh=self.mesh)
        self._in_flight_bytes += self.layouts[unit].padded_nbytes
        self._note_memory()

    def wait_gather(self, action: Action) -> None:
        """Make a unit's parameters usable. A unit gathered before in this step is refilled in place:
        its earlier forward's autograd graph holds views of that same storage (as FSDP does)."""
        unit = _unit(action)
        flat = self._pending_gathers.pop(unit).wait()
        self._in_flight_bytes -= self.layouts[unit].padded_nbytes
        buffer = self._buffers.get(unit)
        if buffer is None:
            buffer = flat if owns_storage(flat) else flat.clone()
            self._buffers[unit] = buffer
        else:
            refill_storage(buffer, flat)
        del flat
        self.params_view[unit] = self.layouts[unit].unflatten(buffer)
        self._note_memory()

    def free(self, action: Action) -> None:
        """Drop a unit's parameters for real: the storage is released even though the autograd graph
        of its forward still holds views of it; it is refilled before that backward runs."""
        unit = _unit(action)
        if self.params_view.pop(unit, None) is None:
            raise RuntimeError(f"free({unit}) of a unit that is not gathered")
        free_storage(self._buffers[unit])
        self._note_memory()

    def _note_memory(self) -> None:
        """Gathered bytes actually allocated now (live buffer storage plus gathers in flight)."""
        live = sum(b.untyped_storage().nbytes() for b in self._buffers.values()) + self._in_flight_bytes
        self.gathered_bytes = live
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    # -- gradients ------------------------------------------------------------------
    def reduce_scatter(self, action: Action) -> None:
        unit = _unit(action)
        layout = self.layouts[unit]
        flat = layout.flatten_grads(self.grads.pop(unit, {}), self.shards[unit].device)
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        self._pending_reduces[unit] = psum_scatter_async(flat, self.axis, tiled=True, mesh=self.mesh)

    def wait_reduce(self, action: Action) -> None:
        unit = _unit(action)
        shard = self._pending_reduces.pop(unit).wait().to(self.shards[unit].dtype)
        self.grad_shards[unit] = shard if self.grad_scale == 1.0 else shard / self.grad_scale

    def reduce_metrics(self, action: Action) -> None:
        """One small all-reduce of what the step exchanges: the loss sum, the squared norm of every
        gradient shard and, under mixed precision, how many ranks saw a non-finite gradient (all
        skip a bad step together). Nothing, when nothing is asked for."""
        if not self.losses:
            raise RuntimeError("reduce_metrics before any loss")
        dtype = torch.float64 if any(s.dtype == torch.float64 for s in self.grad_shards.values()) else torch.float32
        device = self.losses[0].device
        local = self.exchange.local(self.losses, list(self.grad_shards.values()), dtype, device)
        self.summed = self.exchange.unpack(None if local is None else psum(local, self.axis, mesh=self.mesh))

    # -- stage 1/2: rebuild the replicated parameters after the update ----------------
    def gather_params(self, action: Action) -> None:
        unit = _unit(action)
        self._pending_gathers[unit] = all_gather_async(self.new_shards[unit], self.axis, tiled=True, mesh=self.mesh)

    def wait_params(self, action: Action) -> None:
        unit = _unit(action)
        flat = self._pending_gathers.pop(unit).wait()
        self.new_full_params[unit] = {k: v.clone() for k, v in self.layouts[unit].unflatten(flat).items()}


def _unit(action: Action) -> str:
    if action.layer is None:
        raise ValueError(f"action {action} needs a unit")
    return action.layer
