"""The executor's ZeRO actions: gather a unit's shards, free it, reduce-scatter its gradient,
and (stages 1-2) all-gather the updated shards into full parameters.

A unit is gathered into one flat buffer; ``free`` releases the buffer's memory
for real even though the autograd graph of the unit's forward still holds views
of it, and a later gather refills the same storage in place before that
backward runs (as FSDP does). A mixin of :class:`~shardwise.engine.run.executor.Executor`,
whose fields it uses.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ...collectives import Handle, all_gather_async, psum_async
from ...collectives.mesh import Mesh
from ...collectives.ops import all_gather_into_async, psum_scatter_rows_async
from ..layout.buckets import Bucket, bucket_of
from ..layout.in_flight import InFlightParams
from ..layout.sharding import FlatSharding
from ..plan.actions import Action
from ..torch_api import free_storage, owns_storage, refill_storage
from .wide_grads import WideGrads, narrower, overflowing_as

if TYPE_CHECKING:
    from .bindings import BoundStage
    from .param_source import ParamSource


class ZeroActions:
    """gather, wait_gather, free, reduce_scatter, wait_reduce, (HSDP) reduce_replicas, wait_replicas,
    gather_params, wait_params."""

    mesh: Mesh | None
    source: ParamSource
    master: Any
    held: Any
    new_master: Any
    new_held: Any
    device: torch.device
    _bound: dict[int, BoundStage]
    grad_scale: float
    reduce_dtypes: Any
    into_params: bool
    peak_gathered_bytes: int
    _view: dict[str, dict[str, torch.Tensor]]
    _buffers: dict[str, torch.Tensor]
    _unflattened: dict[str, dict[str, torch.Tensor]]  # views of each unit's buffer, by parameter
    _in_flight_bytes: int
    _held_bytes: int  # the bytes of the gathered units' buffers that hold storage now
    _pending: dict[tuple[str, str], Handle]
    _gather_inputs: dict[str, torch.Tensor]  # what each all-gather in flight sends, kept alive to its wait
    _grad_shards: dict[str, torch.Tensor]
    _reduced_shares: dict[str, torch.Tensor]
    _share_dtypes: dict[str, torch.dtype]
    _replica_input: dict[str, torch.Tensor]  # HSDP: reduce-scattered shards, to all-reduce over the replicas
    _leaves: dict[tuple[str, str], torch.Tensor]
    _wide: WideGrads | None
    params_in_flight: list[tuple[Bucket, Handle]]  # stages 1-2: the updated shards' all-gathers not waited for

    def _sharding(self) -> FlatSharding:
        if self.source.sharding is None:
            raise RuntimeError("a ZeRO action in a plan without sharding")
        return self.source.sharding

    def gather(self, action: Action) -> None:
        unit, sharding = action.require("layer"), self._sharding()
        assert action.axis is not None
        # Alive until the wait (snapshot=False: the backend may read it until then); a cast copy
        # under a precision policy, freed at the wait.
        sent = self._gather_inputs[unit] = self.source.gather_input(unit)
        self._pending[("gather", unit)] = all_gather_async(sent, action.axis, tiled=True, mesh=self.mesh,
                                                           snapshot=False)
        self._in_flight_bytes += sharding.units[unit].padded_numel * sent.element_size()
        self._note_memory()

    def wait_gather(self, action: Action) -> None:
        """Make a unit's parameters usable. A unit gathered before in this step is refilled in place:
        its earlier forward's autograd graph holds views of that same storage (as FSDP does)."""
        unit, sharding = action.require("layer"), self._sharding()
        flat = self._pending.pop(("gather", unit)).wait()
        del self._gather_inputs[unit]
        self._in_flight_bytes -= flat.numel() * flat.element_size()
        buffer = self._buffers.get(unit)
        if buffer is None:
            buffer = flat if owns_storage(flat) else flat.clone()
            self._buffers[unit] = buffer
            self._unflattened[unit] = sharding.units[unit].unflatten(buffer)
            self._held_bytes += buffer.untyped_storage().nbytes()
        else:  # the views made at the first gather see the same storage, refilled: made once a step
            before = buffer.untyped_storage().nbytes()
            refill_storage(buffer, flat)
            self._held_bytes += buffer.untyped_storage().nbytes() - before
        del flat
        self._view[unit] = self._unflattened[unit]
        self._note_memory()

    def free(self, action: Action) -> None:
        """Drop a unit's parameters for real: the storage is released even though the autograd graph
        of its forward still holds views of it; it is refilled before that backward runs."""
        unit = action.require("layer")
        if self._view.pop(unit, None) is None:
            raise RuntimeError(f"free({unit}) of a unit that is not gathered")
        buffer = self._buffers[unit]
        self._held_bytes -= buffer.untyped_storage().nbytes()
        free_storage(buffer)
        self._note_memory()

    def _note_memory(self) -> None:
        # Counted as the buffers are made, refilled and freed (not summed over them at each action).
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._held_bytes + self._in_flight_bytes)

    def _unit_grads(self, unit: str) -> dict[str, torch.Tensor]:
        """The accumulated local gradient of every parameter of ``unit`` (released from the leaves)."""
        out: dict[str, torch.Tensor] = {}
        for name in self._sharding().units[unit].names:
            leaf = self._leaves.get((unit, name))
            grad = self._wide.fold((unit, name), leaf) if self._wide is not None else (
                None if leaf is None else leaf.grad)
            if grad is not None:
                out[name] = grad
            if leaf is not None:
                leaf.grad = None
        return out

    def _release_compute(self, units: tuple[str, ...]) -> None:
        """ZeRO-1/2 under a precision policy that does not narrow (one that does holds shards, and
        frees each gathered unit at its ``free``): no later action of the step reads these units'
        parameters (their gradients are final), so their compute copies go, each freed after its
        unit's last backward instead of at the step's end (8 MiB a Linear(2048) in bf16). With them go
        what holds them: the leaves and the bound stages that use them (a stage computing after this
        would bind again, and find no copy: an error, not a gradient lost)."""
        compute, sharding = self.source.compute, self._sharding()
        if not self.source.copies or compute is None or sharding.holds_shards:
            return
        assert isinstance(compute, dict)
        released = {(unit, name) for unit in units for name in sharding.units[unit].names}
        for key in released:
            self._leaves.pop(key, None)
        for unit in units:
            compute.pop(unit, None)
        for s in [s for s, bound in self._bound.items() if not released.isdisjoint(bound.leaves)]:
            del self._bound[s]

    def _bucket(self, action: Action) -> Bucket:
        sharding = self._sharding()
        return bucket_of(tuple(sharding.units[u] for u in action.units or (action.require("layer"),)))

    def reduce_scatter(self, action: Action) -> None:
        """Issue the reduce-scatter of a unit's gradient, or of a bucket's: its rank-major rows of the
        units' gradients (padded), as slices of them. Through shared memory each slice is copied into
        the slot it is sent from; elsewhere they are concatenated into one buffer, reduced in place.
        The gradients are held until the wait, where the buffer was before."""
        unit = action.require("layer")
        assert action.axis is not None
        units = action.units or (unit,)
        # The dtype the gradients were made in (the leaves', the compute copies'): a micro-batches' sum in a wider
        # one (wide_grads.py) is not it, and what one device's backward would overflow is read against it.
        made = [leaf.dtype for u in units for name in self._sharding().units[u].names
                if (leaf := self._leaves.get((u, name))) is not None]
        rows = self._bucket(action).reduce_rows([self._unit_grads(u) for u in units], self.device)
        if action.microbatch is None:  # (a micro-batch's share: the next micro-batch computes with them again)
            self._release_compute(units)
        dtype = functools.reduce(torch.promote_types, (piece.dtype for row in rows for piece in row))
        self._share_dtypes[unit] = functools.reduce(torch.promote_types, made) if made else dtype
        if self.reduce_dtypes is not None:
            dtype = self.reduce_dtypes[unit]
        if ("reduce", unit) in self._pending:  # (the lowering waits for a unit's share before its next)
            raise RuntimeError(f"reduce_scatter({unit}) issued while its previous one is in flight")
        self._pending[("reduce", unit)] = psum_scatter_rows_async(rows, dtype, action.axis, mesh=self.mesh)

    def wait_reduce(self, action: Action) -> None:
        """A reduced shard (a bucket's shards). A micro-batch's share (``shard_params``'
        ``reduce_each_microbatch``) is summed with the next micro-batch's in the dtype it was reduced in
        (the precision policy's reduce dtype: summed in bf16, each share rounded again, it was 1.1e-2 off at
        8 micro-batches; and a tied weight's two parts 3e-3), infinite where the dtype the gradients were
        made in overflows: an fp16 gradient that overflows one device's backward (a step skipped) came out
        finite when summed in float32 alone."""
        unit = action.require("layer")
        reduced = self._pending.pop(("reduce", unit)).wait()
        earlier = self._reduced_shares.pop(unit, None)
        if earlier is not None or action.microbatch is not None:
            wire, made_in = reduced.dtype, self._share_dtypes[unit]
            summed_in = wire if narrower(made_in, wire) else made_in  # (the reduce dtype, f32 for bf16 shares)
            reduced = reduced.to(summed_in) if earlier is None else earlier.add_(reduced.to(summed_in))
            if action.microbatch is not None:
                self._reduced_shares[unit] = reduced
                return
            # Infinite where the dtype the gradients were made in overflows (an f16 gradient that overflows one
            # device's backward of the whole batch is inf here too), in the dtype reduced in (HSDP: the replicas'
            # all-reduce goes in it).
            reduced = overflowing_as(reduced, made_in).to(wire)
        if self._sharding().replicate is not None:  # HSDP: all-reduced over the replicas first, once
            self._replica_input[unit] = reduced
            return
        self._take_grad_shards(action, reduced)

    def reduce_replicas(self, action: Action) -> None:
        """HSDP: issue the all-reduce of a reduce-scattered shard (a bucket's shards) over the
        replicas' axis, in the dtype it was reduced in."""
        unit = action.require("layer")
        self._pending[("replicas", unit)] = psum_async(
            self._replica_input.pop(unit), action.require("axis"), mesh=self.mesh
        )

    def wait_replicas(self, action: Action) -> None:
        self._take_grad_shards(action, self._pending.pop(("replicas", action.require("layer"))).wait())

    def _take_grad_shards(self, action: Action, reduced: torch.Tensor) -> None:
        """The reduced gradient shard of a unit (or a bucket's), in the master dtype and unscaled; infinite where
        the dtype the gradients were made in overflows (the sum over the ranks of f16 shares that one device's f16
        backward of the whole batch makes infinite: the step skips as that one's does, whatever the layout)."""
        unit = action.require("layer")
        made_in = self._share_dtypes.get(unit)
        if made_in is not None:
            reduced = overflowing_as(reduced, made_in)
        shards = self._bucket(action).split_shards(reduced) if action.units else {unit: reduced}
        for u, shard in shards.items():
            shard = shard.to(self.master[u].dtype)
            self._grad_shards[u] = shard if self.grad_scale == 1.0 else shard / self.grad_scale

    def gather_params(self, action: Action) -> None:
        """Stages 1-2: all-gather a unit's (or a bucket's) updated shards into full parameters; with
        ``into_params``, straight into the parameters the step was given where they are laid out for
        it (contiguous, the shards' dtype), else into a buffer copied into them at the wait."""
        unit = action.require("layer")
        bucket = self._bucket(action)
        pieces = bucket.gather_pieces(self.new_master)
        axis = action.require("axis")
        rows = bucket.rows_into(self._next_held(), pieces[0]) if self.into_params else None
        # The shards are the update's result, which nothing writes to before the wait (this step's,
        # or with overlap_gather the next step's, before its update): no copy.
        if rows is not None:
            # The state is consumed (an in-place update) and nothing reads its parameters after the
            # backward: the rows are written as they arrive, and this rank's own row is its shards
            # where they lie (the parameters' values, where the update wrote them in place): through
            # shared memory, no buffer of the bucket's, nor of its row.
            handle = all_gather_into_async(pieces, rows, axis, mesh=self.mesh)
            self._pending[("params into", unit)] = handle
        else:
            flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            handle = all_gather_async(flat, axis, tiled=True, mesh=self.mesh, snapshot=False)
            self._pending[("params", unit)] = handle
        self.params_in_flight.append((bucket, handle))

    def _next_held(self) -> dict[str, dict[str, torch.Tensor]]:
        """The parameters the next state holds: the given ones, each unit's dict a copy of its own."""
        if self.new_held is None:
            held = self.held.settle() if isinstance(self.held, InFlightParams) else self.held  # not a read
            self.new_held = {k: dict(v) for k, v in held.items()}
        return self.new_held

    def wait_params(self, action: Action) -> None:
        """The gathered parameters are views of the all-gather's output (one copy of a parameter
        that lies across two ranks' shards): no copy per parameter; or, gathered into the given
        parameters, already in place.

        The wait of this step's own gather (at its end), or with ``overlap_gather`` (listed before
        the bucket's first forward, ahead of this step's gathers) the wait of the gather the last
        step left in flight: its parameters become the layers' (their compute copies)."""
        unit = action.require("layer")
        into = self._pending.pop(("params into", unit), None)
        handle = into if into is not None else self._pending.pop(("params", unit), None)
        if handle is not None:
            self.params_in_flight = [(b, h) for b, h in self.params_in_flight if h is not handle]
            if into is not None:
                into.wait()
                return
            new_held = self._next_held()
            got = self._bucket(action).unflatten(handle.wait())
            if not self.into_params:
                new_held.update(got)
                return
            # Written into the parameters the step was given (gathers_into_params), where they are
            # not laid out for the gather to write them: the gathered buffer goes as this returns,
            # before the next bucket's gather.
            with torch.no_grad():
                for unit, tensors in got.items():
                    for name, value in tensors.items():
                        new_held[unit][name].copy_(value)
            return
        incoming = self.source.incoming
        if incoming is None:  # the state's parameters were complete when the step began
            return
        units = action.units or (unit,)
        got = incoming.wait_bucket(units)
        compute = self.source.compute
        if compute is None:  # released at finish_grads: no forward of this step reads them any more
            return
        assert isinstance(compute, dict) and self.source.cast is not None
        compute.update(self.source.cast(got))
