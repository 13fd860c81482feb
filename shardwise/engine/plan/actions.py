"""The Plan: one list of typed actions per rank, the unit of truth of a step.

``step.plan(mesh, params, batch)`` lowers the step's whole transform stack into
a Plan; the one executor (``engine/run/executor.py``) runs it; the simulator and
the drawings read it. Every collective and transfer a step issues is an action
here, with its mesh axis, its peer, and (when the plan was made with the
parameters, and the batch for activations) the dtype and bytes of every tensor
it puts on the wire: the contract test runs the step under ``comm_ledger()``
and checks that each rank issued exactly :meth:`Plan.collectives` of it.

Actions are small frozen values with a short text form (``F(blocks.0)``,
``B(s1, mb=0)``, ``gather(head)``, ``send_activation(s0, mb=1, to=1)``,
``update``), so a Plan prints readably and two plans compare with ``==``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ...collectives.mesh import Mesh
from ..stack.in_layer import OPS as INSIDE_OPS
from .text import plan_text

# -- compute --------------------------------------------------------------------------------
FORWARD = "forward"  # a stage's layers on one micro-batch
LOSS = "loss"  # the loss of one micro-batch, on the rank that holds the last stage
BACKWARD = "backward"  # a stage's backward: input and weight gradients
BACKWARD_INPUT = "backward_input"  # zero-bubble I: the input gradient only (the graph is kept)
BACKWARD_WEIGHT = "backward_weight"  # zero-bubble W: the weight gradients, later
FINISH_GRADS = "finish_grads"  # the gradients the optimizer gets, and this rank's share of the metrics
UPDATE = "update"  # the optimizer on this rank's (shards of the) parameters
COMPUTES = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
GRAD_COMPUTES = (BACKWARD, BACKWARD_WEIGHT)  # the actions that add to weight gradients

# -- ZeRO: a unit (a layer's owned parameters as one flat buffer) over a data-parallel axis ----
GATHER = "gather"  # issue the all-gather of a unit's shards
WAIT_GATHER = "wait_gather"  # wait for it: the unit's parameters are usable
FREE = "free"  # release a gathered unit's memory
REDUCE_SCATTER = "reduce_scatter"  # issue the reduce-scatter of a unit's gradient
WAIT_REDUCE = "wait_reduce"  # wait for it: this rank holds its gradient shard
GATHER_PARAMS = "gather_params"  # stages 1-2: all-gather an updated shard into full parameters
WAIT_PARAMS = "wait_params"
# HSDP: all-reduce a reduce-scattered gradient shard over the replicas' axis, and wait for it
REDUCE_REPLICAS = "reduce_replicas"
WAIT_REPLICAS = "wait_replicas"

# -- pipeline: point-to-point transfers between stages along the pipeline axis --------------
SEND_ACTIVATION = "send_activation"
RECV_ACTIVATION = "recv_activation"
SEND_GRAD = "send_grad"
RECV_GRAD = "recv_grad"
SEND_TIED = "send_tied"  # a weight tied across pipeline ranks: this rank's gradient to a peer
RECV_TIED = "recv_tied"
SUM_TIED = "sum_tied"  # add the copies' gradients in axis order (every copy then updates alike)
WAIT_SENDS = "wait_sends"  # every send of the step delivered

# -- metrics (engine/run/metrics.py) -------------------------------------------------------------
REDUCE_METRICS = "reduce_metrics"  # an all-reduce of what the step exchanges (async on the first axis)
WAIT_METRICS = "wait_metrics"  # the summed values are known

# -- a split transform: a collective a layer issues inside its compute (the action just before) ------
# Its ``op`` says which (stack/in_layer.py's OPS: psum, all_gather, psum_scatter, all_to_all,
# ppermute); it prints as that op: ``psum(blocks.0.attn, axis=tp)``. Issued by its compute: the
# executor skips it.
INSIDE = "inside"
# all-gather a checksum of the split's replicated gradients (and the batch's) over its axis
CHECK_REPLICAS = "check_replicas"
# The replica check's all-gather: the replicated gradients' sums and sums of magnitudes in this many bins (piece i in
# bin i % REPLICA_BINS: a missed sum in one small parameter is not lost among the others'), then the batch's
# fingerprint, float64
REPLICA_BINS = 32
WAIT_CHECK = "wait_check"  # they must be equal on every index: else the step refuses before its update

#: Every kind of action a Plan lists (the constants above).
ACTION_KINDS = frozenset({
    FORWARD, LOSS, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FINISH_GRADS, UPDATE, GATHER, WAIT_GATHER, FREE,
    REDUCE_SCATTER, WAIT_REDUCE, GATHER_PARAMS, WAIT_PARAMS, REDUCE_REPLICAS, WAIT_REPLICAS, SEND_ACTIVATION,
    RECV_ACTIVATION, SEND_GRAD, RECV_GRAD, SEND_TIED, RECV_TIED, SUM_TIED, WAIT_SENDS, REDUCE_METRICS, WAIT_METRICS,
    INSIDE, CHECK_REPLICAS, WAIT_CHECK,
})

#: The collective (as the ledger names it) that each communicating action issues.
LEDGER_OP = {
    GATHER: "all_gather",
    REDUCE_SCATTER: "psum_scatter",
    GATHER_PARAMS: "all_gather",
    REDUCE_REPLICAS: "psum",
    SEND_ACTIVATION: "send",
    SEND_GRAD: "send",
    SEND_TIED: "send",
    RECV_ACTIVATION: "recv",
    RECV_GRAD: "recv",
    RECV_TIED: "recv",
    REDUCE_METRICS: "psum",
    CHECK_REPLICAS: "all_gather",
}  # and INSIDE: its own ``op``

SHORT = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}  # a compute's letter


class Boundary(NamedTuple):
    """What one pipeline stage passes to the next: each tensor's (shape, dtype), and the pytree
    structure they form (a dict, a named tuple, a ModelOutput), which the receiver rebuilds."""

    leaves: tuple[tuple[torch.Size, torch.dtype], ...]
    spec: Any  # optree.PyTreeSpec
    # Per leaf, whether a gradient comes back for it: whether it depends on a parameter. A floating
    # value made from buffers and the batch alone (RoPE's cos and sin) needs none.
    grads: tuple[bool, ...] = ()

    def grad_leaves(self) -> list[tuple[torch.Size, torch.dtype]]:
        """The (shape, dtype) of each gradient that travels back over the boundary."""
        return [leaf for leaf, grad in zip(self.leaves, self.grads, strict=True) if grad]


@dataclass(frozen=True)
class Wire:
    """One tensor a communicating action puts on the wire (or receives): its dtype and bytes."""

    dtype: str  # as the ledger writes it, e.g. "float32"
    nbytes: int


@dataclass(frozen=True)
class Action:
    """One thing a rank does.

    ``layer`` names the layer, unit or (for a multi-layer pipeline stage) the stage's
    first layer; ``stage`` is the stage index of compute and transfer actions. A
    collective or transfer has its mesh ``axis``; a transfer its ``peer`` (the other
    end's index along that axis). ``wire`` lists what it moves, one entry per tensor,
    when the plan was made with enough to know (empty otherwise).
    """

    kind: str
    layer: str | None = None
    microbatch: int | None = None
    stage: int | None = None
    axis: str | None = None
    peer: int | None = None
    wire: tuple[Wire, ...] = ()
    tied: int | None = None  # the index of a weight tied across pipeline ranks (Placement.tied)
    label: str | None = None  # the text form of the action's subject, when not ``layer``
    # A ZeRO bucket's units, in its order (``layer`` is the first), when several travel as one collective
    units: tuple[str, ...] = ()
    # The collective (as the ledger names it) the action issues: set for INSIDE, filled in from
    # LEDGER_OP for every other kind (None: it issues none).
    op: str | None = None

    def __post_init__(self) -> None:
        if self.kind == INSIDE:
            if self.op not in INSIDE_OPS:
                raise ValueError(f"an {INSIDE!r} action needs op= one of {INSIDE_OPS}, got {self.op!r}")
        elif self.op != LEDGER_OP.get(self.kind):
            if self.op is not None:
                raise ValueError(f"a {self.kind!r} action issues {LEDGER_OP.get(self.kind)!r}, not op={self.op!r}")
            object.__setattr__(self, "op", LEDGER_OP.get(self.kind))

    @property
    def mb(self) -> int:
        """The micro-batch; 0 for a step that cuts no micro-batches (the one batch)."""
        return 0 if self.microbatch is None else self.microbatch

    def require(self, name: str) -> Any:
        """Field ``name``, which this kind of action must have: a clear error when it is missing."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"action {self} has no {name}, which a {self.kind!r} action needs")
        return value

    @property
    def nbytes(self) -> int:
        """Bytes the action puts on the wire (or receives), summed over its tensors."""
        return sum(w.nbytes for w in self.wire)

    def __str__(self) -> str:
        head = str(self.op) if self.kind == INSIDE else SHORT.get(self.kind, self.kind)
        subject = self.label if self.label is not None else self.layer
        inner = [] if subject is None else [subject]
        if self.microbatch is not None:
            inner.append(f"mb={self.microbatch}")
        if self.peer is not None:
            inner.append(("to" if self.kind.startswith("send") else "from") + f"={self.peer}")
        if self.kind in (REDUCE_METRICS, INSIDE) and self.axis is not None:
            inner.append(f"axis={self.axis}")
        return f"{head}({', '.join(inner)})" if inner else head


@dataclass(frozen=True)
class Collective:
    """What the ledger records for one tensor of one communicating action (see ``CommRecord``)."""

    op: str
    axis: str
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """Per-rank action lists for one training step on ``mesh``, plus accounting figures.

    ``memory`` holds per-rank byte counts when the plan was made with the
    parameters (``step.plan(mesh, params)``): keys such as ``params``,
    ``grads``, ``opt_state``, each a tuple with one entry per rank; what comes and goes as
    the actions run, each at its own peak: in every stack ``update_buffers`` (what the
    optimizer's update allocates, and an out-of-place update's new parameters and state from
    then to the step's end), under a precision policy ``compute_copies`` (the parameters, or
    ZeRO-3's shards, cast to the compute dtype, held through the step), without shard_params
    over micro-batches ``grad_accumulation`` (a later micro-batch's gradient before it is added
    in); under ``shard_params`` also (``gathered_peak``, ``reduce_buffers``, ``comm_buffers``; at stages 1-2
    ``params_in_flight``, the updated parameters the step's all-gathers bring, beside the old
    ones until the step returns, and with ``overlap_gather`` still in flight then; and
    ``master_shards``, the rank's shard of every unit that the optimizer updates, held through
    the step beside the whole parameters, and between steps too: the state hands them on to the
    next update; 0 where the step gathers into the parameters, whose shards they are views of), and
    ``held_in_step``, the most those and the gradients (under shard_params, the gradient shards)
    made so far hold together at one action. With a batch, ``kept_for_backward`` (what the layers
    keep for backward, with the micro-batches in flight) and ``loss_buffers`` (what the loss holds at
    its worst on the ranks that run it: the chain's output while it runs, what it keeps for its
    backward, per micro-batch in flight, and its backward's gradients down to the output's); in a
    pipeline ``transfer_buffers`` (the receives posted ahead of their waits, the stage outputs sent, to
    their backwards, and the input gradients sent, until a message from the peer shows them delivered).
    ``peak`` is ``params`` and ``opt_state``, and the most that ``held_in_step``'s parts, what the forward
    and the loss keep, the transfers, and the loss's own (and a layer's backward's, as it runs) hold
    together at one action: at most the sum of those figures, which come at different actions. ``layers``
    says how the rewriting transforms run each layer (its compute dtype, its
    remat policy), in the stack's words.
    """

    mesh: Mesh
    actions: tuple[tuple[Action, ...], ...]
    memory: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    layers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.actions) != self.mesh.size:
            raise ValueError(
                f"Plan has {len(self.actions)} action lists but {self.mesh!r} has {self.mesh.size} ranks"
            )

    def for_rank(self, rank: int) -> tuple[Action, ...]:
        return self.actions[self._rank(rank)]

    def count(self, kind: str, rank: int | None = None) -> int:
        """How many actions of ``kind`` one rank (or all ranks together) performs."""
        if kind not in ACTION_KINDS:
            raise ValueError(f"Plan.count({kind!r}): not an action kind; one of {sorted(ACTION_KINDS)}")
        ranks: Sequence[int] = range(self.mesh.size) if rank is None else [self._rank(rank)]
        return sum(1 for r in ranks for a in self.actions[r] if a.kind == kind)

    def _rank(self, rank: Any) -> int:
        """``rank``, refused unless it is one of the mesh's ranks (a negative index would pick another)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.actions):
            raise ValueError(f"rank={rank!r}: an int, one of the ranks 0 to {len(self.actions) - 1} of the Plan's mesh "
                             f"{self.mesh!r}")
        return rank

    def collectives(self, rank: int) -> Iterator[Collective]:
        """Every collective ``rank`` issues, in order, one per tensor, as the ledger records them.

        Needs a plan made with the parameters (and, for a pipeline's transfers, a batch):
        an action whose payload is unknown raises rather than being skipped.
        """
        for action in self.actions[self._rank(rank)]:
            op = action.op
            if op is None:
                continue
            if not action.wire:
                raise ValueError(f"{action} on rank {rank}: its payload is unknown: {self.why_unknown(action)}")
            assert action.axis is not None
            for w in action.wire:
                yield Collective(op, action.axis, w.dtype, w.nbytes)

    def why_unknown(self, action: Action) -> str:
        """Why ``action``'s payload is unknown, and what to do, for an error that names it. A pipeline's
        transfer in a plan made with a batch is unknown because its stage boundary was not predicted:
        a layer before it could not run on fake tensors (its shapes may depend on the data), so the
        transfer announces its shapes at run time."""
        if "kept_for_backward" in self.memory and action.kind in (SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRAD,
                                                                   RECV_GRAD):
            stood_in = [n for n, notes in self.layers.items() if any("zero-filled stand-ins" in x for x in notes)]
            which = f" ({', '.join(stood_in)} ran on stand-ins)" if stood_in else ""
            return ("the pipeline's stage boundary was not predicted, since a layer before it could not run on fake "
                    f"tensors{which}: its transfers announce their shapes at run time, and the plan cannot "
                    "count their bytes")
        return "the plan was made without the parameters or a batch; make it with step.plan(mesh, params, batch)"

    def comm_bytes(self) -> dict[tuple[str, str], tuple[int, ...]]:
        """Bytes each rank hands to each (axis, collective) in one step: the inputs of its
        collectives and the tensors it sends or receives (not the ring algorithm's traffic,
        which ``Ledger.sent_bytes`` counts). Unknown payloads count zero."""
        out: dict[tuple[str, str], list[int]] = {}
        for rank, actions in enumerate(self.actions):
            for a in actions:
                if a.op is not None and a.axis is not None:
                    out.setdefault((a.axis, a.op), [0] * self.mesh.size)[rank] += a.nbytes
        return {k: tuple(v) for k, v in sorted(out.items())}

    def __str__(self) -> str:
        return plan_text(self)
