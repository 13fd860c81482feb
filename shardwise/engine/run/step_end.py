"""The executor's end of a step: the gradients the optimizer gets, the check that replicated
gradients came out equal over a split's axis, the metrics' exchange, and the update. A mixin of
:class:`~shardwise.engine.run.executor.Executor`, whose fields it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optree
import torch

from ...collectives import Handle, all_gather_async, psum, psum_async
from ...collectives.mesh import Mesh
from ..layout.precision import all_finite
from ..optim.optimizers import global_norm
from ..plan.actions import REPLICA_BINS, Action
from .metrics import MetricExchange, Summed, different_batches
from .wide_grads import WideGrads

if TYPE_CHECKING:
    from .bindings import BoundStage, StageBindings
    from .param_source import ParamSource


@dataclass(frozen=True)
class ReplicaCheck:
    """The gradients that must come out equal on every index of a split's axis (keys, or per ZeRO
    unit the ranges of this rank's shard), and what the error says when they do not: the split's
    name and how to fix it."""

    selection: Any
    by: str
    fix: str


def _equal_rows(rows: torch.Tensor) -> bool:
    """Every row bitwise the first, NaN equal to NaN in the same place: gradients that overflowed alike
    (a loss scale too large, to be skipped) give every rank the same NaN checksum."""
    nan = rows.isnan()
    first = rows[:1].expand_as(rows)
    return torch.equal(nan, nan[:1].expand_as(nan)) and torch.equal(rows.nan_to_num(0.0), first.nan_to_num(0.0))


REPLICA_ULPS = 256  # rounding allowed between replicas of a gradient, in units of its dtype's eps
REPLICA_RTOL_CAP = 1e-2  # (bf16's 256 eps would be 2)


def _within_rounding(sums: torch.Tensor, rtol: float | torch.Tensor) -> bool:
    """Whether every rank's per-bin sums and magnitudes (``[ranks, 2 x bins]``: sums, then magnitudes) are the
    first rank's to ``rtol`` (one, or each bin's) of each bin's magnitude; not where NaNs differ (an overflow on some
    ranks only)."""
    if not torch.equal(sums.isnan(), sums[:1].isnan().expand_as(sums)):
        return False
    n = sums.shape[1] // 2
    tolerance = torch.as_tensor(rtol, dtype=sums.dtype).expand(n).repeat(2).to(sums.device)
    scale = sums[0, n:].repeat(2)
    return bool(((sums - sums[:1]).abs().nan_to_num(0.0) <= tolerance * scale.nan_to_num(0.0)).all())


def _counted_pieces(grads: Any, counted: Any) -> list[torch.Tensor]:
    """The gradients (or, of ZeRO's flat shards, the ranges) that ``counted`` names."""
    if isinstance(counted, frozenset):
        return [g for layer, tensors in grads.items() for name, g in tensors.items() if (layer, name) in counted]
    return [grads[u][a:b] for u, ranges in counted.items() if u in grads for a, b in ranges]


class StepEnd:
    """local_grads, finish_grads, check_replicas, wait_check, reduce_metrics, wait_metrics, run_update."""

    mesh: Mesh | None
    source: ParamSource
    device: torch.device
    finalize: Callable[[dict[str, dict[str, torch.Tensor]]], Any]
    update: Callable[..., Any]
    bindings: StageBindings | None
    exchange: MetricExchange
    metric_axes: tuple[str, ...]
    metric_dtype: torch.dtype
    replica_layers: frozenset[str]
    replicas: Mapping[str, ReplicaCheck]
    counted: Any
    counts_losses: bool
    batch_fingerprint: torch.Tensor | None
    step_digest: float | None
    losses: list[torch.Tensor]
    counts: list[torch.Tensor]
    final_grads: Any
    summed: Summed
    new_master: Any
    new_held: Any
    _rank: int
    _leaves: dict[tuple[str, str], torch.Tensor]
    _wide: WideGrads | None
    _bound: dict[int, BoundStage]
    _pending: dict[tuple[str, str], Handle]
    _grad_shards: dict[str, torch.Tensor]
    _checks: dict[str, tuple[Handle, torch.Tensor]]
    _local_metrics: torch.Tensor | None
    _metrics_total: torch.Tensor | None
    _metrics_handle: Handle | None

    def local_grads(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every held parameter's accumulated gradient (zeros for one no forward reached)."""
        assert self.source.compute is not None
        out: dict[str, dict[str, torch.Tensor]] = {}
        for layer, tensors in self.source.compute.items():
            out[layer] = {}
            for name, t in tensors.items():
                leaf = self._leaves.get((layer, name))
                grad = self._wide.fold((layer, name), leaf) if self._wide is not None else (
                    None if leaf is None else leaf.grad)
                out[layer][name] = grad if grad is not None else torch.zeros_like(t)
        return out

    def finish_grads(self, action: Action) -> None:
        """The gradients the optimizer gets (``final_grads``) and this rank's share of the metrics."""
        self._check_no_gather_pending()
        incoming = self.source.incoming
        if incoming is not None and incoming.in_flight:
            raise RuntimeError(
                f"{incoming.in_flight} all-gathers of the last step's updated shards were never waited for "
                "before the update (which writes the shards they read): the Plan lists a wait_params for each"
            )
        if self.source.sharding is not None:
            self.final_grads = dict(self._grad_shards)
        else:
            self.final_grads = self.finalize(self.local_grads())
        if self.bindings is not None:  # kept for the next step, without this one's gradients
            self.bindings.clear_grads()
        else:
            # Only the forwards and backwards read the compute copies: released, with the leaves
            # and bound layers that hold them, before the update's allocations (under a precision
            # policy, a copy of the parameters a rank holds whole).
            self._leaves.clear()
            self._bound.clear()
            self.source.compute = None
        if self.exchange.empty:
            return
        counted: Any = (
            {k: v for k, v in self.final_grads.items() if k not in self.replica_layers}
            if self.replica_layers else self.final_grads
        )
        if not self.metric_axes:  # one rank: nothing to exchange, the values are already global
            loss_sum = torch.stack(self.losses).sum() if len(self.losses) > 1 else self.losses[0]
            norm = global_norm(counted) if self.exchange.norm else None
            finite = not self.exchange.finite or bool(all_finite(list(optree.tree_leaves(counted))))
            count = torch.stack(self.counts).sum() if self.exchange.count else None
            self.summed = Summed(loss_sum, None if norm is None else norm * norm, finite, exact_norm=norm, count=count)
            return
        losses, counts = self.losses, self.counts
        pieces: list[torch.Tensor] = list(optree.tree_leaves(counted))
        if self.counted is not None:  # an index of a split's axis that counts only its split gradients
            if not self.counts_losses:
                losses, counts = [], []
            pieces = _counted_pieces(counted, self.counted)
        self._local_metrics = self.exchange.local(
            losses, pieces, self.metric_dtype, self.device, counts, self.batch_fingerprint, self._rank,
            self.step_digest,
        )

    def _check_no_gather_pending(self) -> None:
        for key in [k for k in self._pending if k[0] == "gather"]:
            raise RuntimeError(f"gather of unit {key[1]!r} issued but never waited for")

    def check_replicas(self, action: Action) -> None:
        """Issue the all-gather of a checksum of this rank's replicated gradients over a split's axis:
        they must be the same on every index (else a replicated parameter was used on per-rank values
        without its gradient being summed, or random ops differed)."""
        axis = action.require("axis")
        replicas = self.replicas.get(axis)
        pieces = _counted_pieces(self.final_grads, replicas.selection) if replicas is not None else []
        # The pieces' sums and sums of magnitudes in REPLICA_BINS bins (piece i in bin i % REPLICA_BINS): a missed sum
        # in one small parameter is not lost among the rest's, and every rank gathers the same shape.
        local = torch.zeros(2 * REPLICA_BINS + 1, dtype=torch.float64, device=self.device)
        # Each bin's rounding, of its coarsest piece: one bf16 piece does not loosen the float32 bins' check
        eps = [0.0] * REPLICA_BINS
        for i, g in enumerate(pieces):
            local[i % REPLICA_BINS] += g.double().sum()
            local[REPLICA_BINS + i % REPLICA_BINS] += g.double().abs().sum()
            if g.is_floating_point():
                eps[i % REPLICA_BINS] = max(eps[i % REPLICA_BINS], torch.finfo(g.dtype).eps)
        if self.batch_fingerprint is not None:
            local[-1] = self.batch_fingerprint.to(device=self.device, dtype=torch.float64)
        rtol = torch.tensor([min(REPLICA_RTOL_CAP, REPLICA_ULPS * e) for e in eps], dtype=torch.float64)
        self._checks[axis] = (all_gather_async(local, axis, mesh=self.mesh), rtol)

    def wait_check(self, action: Action) -> None:
        axis = action.require("axis")
        assert axis in self._checks, f"wait_check over {axis!r} before its check_replicas"
        handle, rtol = self._checks.pop(axis)
        every = handle.wait()
        if not torch.equal(every[:, -1], every[0, -1].expand(every.shape[0])):  # computed alike from one batch
            raise ValueError(different_batches(f"the ranks of axis {axis!r}"))
        # Equal bitwise where every rank computes alike (a sum over the axis gives every index the same bits); a
        # missed sum differs by the order of the gradient itself. Ranks on other CPU kernels (AVX-512 beside
        # none) or thread counts round differently: within REPLICA_ULPS units of the gradients' rounding of each
        # piece's magnitudes, let through (the copies then differ by rounding, as Megatron's do).
        sums = every[:, :-1]
        if not _equal_rows(sums) and not _within_rounding(sums, rtol):
            replicas = self.replicas.get(axis)
            by, fix = ("the split", "") if replicas is None else (replicas.by, replicas.fix)
            n = sums.shape[1] // 2
            scale = sums[0, n:].repeat(2).clamp_min(torch.finfo(torch.float64).tiny)
            worst = float(((sums - sums[:1]).abs() / scale).nan_to_num(float("inf")).max())
            raise ValueError(
                f"{by}: the gradients of the replicated parameters differ between the ranks of axis "
                f"{axis!r} ({worst:.3g} of a parameter's gradient magnitude, beyond rounding), so their copies "
                f"would drift apart. {fix}"
            )

    def reduce_metrics(self, action: Action) -> None:
        """Sum this rank's share over ``action.axis``: the first axis asynchronously (the update need
        not wait for it unless it uses the sums), later axes once the first is in."""
        axis = action.require("axis")
        if self._metrics_handle is None and self._metrics_total is None:
            if self._local_metrics is None:
                raise RuntimeError("reduce_metrics before finish_grads")
            self._metrics_handle = psum_async(self._local_metrics, axis, mesh=self.mesh)
            return
        self._complete_first_metrics()
        assert self._metrics_total is not None
        self._metrics_total = psum(self._metrics_total, axis, mesh=self.mesh)
        self.summed = self.exchange.unpack(self._metrics_total)

    def wait_metrics(self, action: Action) -> None:
        self._complete_first_metrics()

    def _complete_first_metrics(self) -> None:
        if self._metrics_handle is not None:
            self._metrics_total = self._metrics_handle.wait()
            self._metrics_handle = None
            self.summed = self.exchange.unpack(self._metrics_total)

    def run_update(self, action: Action) -> None:
        """The optimizer on this rank's master tree, or (ZeRO-1/2, the action naming a bucket) on that
        bucket's units alone, so that its all-gather is issued while the next bucket updates."""
        if action.layer is not None:
            units = action.units or (action.layer,)
            part = self.update({u: self.final_grads[u] for u in units}, self.summed, units)
            self.new_master = {**(self.new_master or {}), **part}
            return
        self.new_master = self.update(self.final_grads, self.summed)
        sharding = self.source.sharding
        if sharding is None or sharding.holds_shards:
            self.new_held = self.new_master
