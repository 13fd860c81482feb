"""Runs one pipeline rank's actions: stage forwards and backwards, sends and receives.

Each (stage, micro-batch) forward keeps its own autograd graph, cut at the
stage input, so its backward can run whenever the schedule says: as one
``B``, or as ``I`` (gradient for the input, sent upstream at once; the graph
is kept) followed later by ``W`` (gradients for the weights). The last stage
seeds its backward with ``1/m`` so the pipelined step equals the step on the
whole batch, not ``m`` times it.

Every micro-batch's forward uses the same leaf per parameter for the whole step,
and weight gradients go into that leaf's ``.grad`` (``autograd.backward(inputs=)``):
autograd then adds each micro-batch's gradient in place into one buffer, as
torch's modules accumulate ``.grad``, instead of allocating a new sum per
micro-batch. The sums are the same additions in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ...collectives.issue import Handle
from ...collectives.mesh import Mesh
from ...collectives.ops import psum, psum_async
from ...collectives.p2p import recv, send
from ...engine.chain import Chain
from ...engine.devices import device_of
from ...engine.metrics import EXCHANGE_METRICS, NOTHING_SUMMED, MetricExchange, Summed
from ...engine.plan import Action
from .lowering import (
    FINISH_GRADS,
    RECV_ACTIVATION,
    RECV_GRAD,
    REDUCE_METRICS,
    SEND_ACTIVATION,
    SEND_GRAD,
    UPDATE,
    tag_of,
)

LossFn = Callable[[Any, Any], torch.Tensor]
Layout = tuple[torch.Size, torch.dtype]
TIED_TAG_BASE = 1 << 29  # above every activation/gradient tag (tag_of stays far below it)
_COMPUTE_KINDS = frozenset(("forward", "backward", "backward_input", "backward_weight"))


def _float_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


@dataclass
class _Saved:
    inputs: list[torch.Tensor]  # leaves that require grad (empty for stage 0)
    params: dict[tuple[str, str], torch.Tensor]  # (layer, local name) -> leaf
    outputs: list[torch.Tensor]  # float leaves of the stage output (or [loss] on the last stage)
    output_grads: list[torch.Tensor | None] | None = None  # kept between I and W


@dataclass
class PipelineRuntime:
    """One rank's pipelined step; ``run`` leaves the gradients for the optimizer and the summed metric values."""

    chain: Chain
    loss_fn: LossFn
    mesh: Mesh
    axis: str
    stages: Sequence[Sequence[str]]  # layer names per stage
    placement: Sequence[int]  # stage -> index along the axis
    params: Mapping[str, Mapping[str, torch.Tensor]]  # this rank's layers
    microbatches: Sequence[tuple[Any, Any]]
    poison: bool = False  # fill consumed receive buffers with NaN: stale reuse would show
    record: bool = False
    loss_scale: float = 1.0  # seeds each micro-batch: 1/replicas (data parallel) x the precision loss scale
    # Turns the local gradients into what the optimizer gets (reduced shards, unscaled, master dtype).
    finalize_grads: Callable[[Mapping[str, Mapping[str, torch.Tensor]]], Any] | None = None
    metric_axes: tuple[str, ...] = ()
    # What the ranks sum after the backward (the step's metrics, the norm to clip by, the finite flag).
    exchange: MetricExchange = EXCHANGE_METRICS
    summed: Summed = NOTHING_SUMMED
    final_grads: Any = None
    tied: Sequence[tuple[str, str, tuple[int, ...]]] = ()  # weights tied across pipeline ranks
    # Per stage boundary, the (shape, dtype) of each tensor the stage's output carries, when the
    # step could predict them: transfers then go without count and headers.
    layouts: Sequence[Sequence[Layout]] | None = None
    replica_layers: frozenset[str] = frozenset()  # layers of which this rank only holds tied copies
    device: torch.device = field(init=False)  # see __post_init__
    grads: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _local_metrics: torch.Tensor | None = None  # this rank's share of what the ranks sum (exchange.local)
    _pending_metrics: tuple[Handle, tuple[str, ...]] | None = None  # all-reduce started, axes still to go
    events: list[tuple[int, str, float, float]] = field(default_factory=list)
    _inbox: dict[tuple[str, int, int], Any] = field(default_factory=dict)
    _saved: dict[tuple[int, int], _Saved] = field(default_factory=dict)
    _outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    _input_grads: dict[tuple[int, int], list[torch.Tensor | None]] = field(default_factory=dict)
    _sends: list[Handle] = field(default_factory=list)
    _posted: dict[tuple[str, int, int], list[Handle]] | None = None  # None: not posted yet
    _actions: Sequence[Action] = ()
    _losses: list[torch.Tensor] = field(default_factory=list)
    _leaves: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (layer, local) -> step's leaf
    _bound: dict[int, tuple[list[Callable[[Any], Any]], dict[tuple[str, str], torch.Tensor]]] = field(
        default_factory=dict
    )  # per stage: its layers bound to the step's leaves, and those leaves

    def __post_init__(self) -> None:
        # Where this rank computes: its parameters', else its micro-batches'. Received activations
        # and gradients are put there (torch.distributed delivers them on the CPU), and the
        # metrics are made there.
        self.device = device_of(self.params, self.microbatches)

    @property
    def last(self) -> int:
        return len(self.stages) - 1

    def run(self, actions: Sequence[Action], update: Callable[[Action], None]) -> None:
        table: dict[str, Callable[[Action], None]] = {
            "forward": self.forward,
            "backward": self.backward,
            "backward_input": self.backward,
            "backward_weight": self.backward,
            RECV_ACTIVATION: self.receive,
            RECV_GRAD: self.receive,
            SEND_ACTIVATION: self.send_activation,
            SEND_GRAD: self.send_grad,
            FINISH_GRADS: self.finish_grads,
            REDUCE_METRICS: self.reduce_metrics,
            UPDATE: update,
        }
        self._actions = actions
        timed: list[tuple[Action, float, float]] = []  # compute actions, when recording
        for action in actions:
            handler = table.get(action.kind)
            if handler is None:
                raise ValueError(f"pipeline runtime has no handler for action {action}")
            if self.record and action.kind in _COMPUTE_KINDS:
                start = time.perf_counter()
                handler(action)
                timed.append((action, start, time.perf_counter()))
            else:
                handler(action)
        # Named after the step, so recording costs two clock reads per compute while it runs.
        rank = self.mesh.rank
        self.events.extend((rank, _op_text(action), start, end) for action, start, end in timed)

    # -- compute ---------------------------------------------------------------------
    def forward(self, action: Action) -> None:
        s, m = _stage(action), _mb(action)
        x = self.microbatches[m][0] if s == 0 else self._take_input(s, m)
        inputs = [] if s == 0 else _float_leaves(x)
        calls, leaves = self._bound_stage(s)
        with torch.enable_grad():
            for t in inputs:
                t.requires_grad_(True)
            y = x
            for call in calls:
                y = call(y)
            if s == self.last:
                loss = self.loss_fn(y, self.microbatches[m][1])
                self._losses.append(loss.detach())
                outputs = [loss]
            else:
                outputs = _float_leaves(y)
                self._outputs[(s, m)] = y
        self._saved[(s, m)] = _Saved(inputs, leaves, outputs)

    def backward(self, action: Action) -> None:
        s, m = _stage(action), _mb(action)
        saved = self._saved[(s, m)]
        want_inputs = action.kind in ("backward", "backward_input")
        want_weights = action.kind in ("backward", "backward_weight")
        if saved.output_grads is None:
            saved.output_grads = self._output_grads(s, m, saved)
        pairs = [(o, g) for o, g in zip(saved.outputs, saved.output_grads, strict=True) if g is not None]
        outputs, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        got: list[torch.Tensor | None] = [None] * len(saved.inputs)
        if want_inputs and not want_weights and pairs and saved.inputs:  # I: the graph stays for W
            got = list(torch.autograd.grad(outputs, saved.inputs, seeds, retain_graph=True, allow_unused=True))
        elif want_weights and pairs:
            # B or W: weight gradients accumulate into the step's leaves (in place after the first);
            # B also leaves each input's gradient in its (per micro-batch) leaf.
            wrt = (saved.inputs if want_inputs else []) + list(saved.params.values())
            if wrt:
                torch.autograd.backward(outputs, seeds, inputs=wrt)
            if want_inputs:
                got = [x.grad for x in saved.inputs]
        if want_inputs:
            # An input the stage did not use still gets a (zero) gradient: upstream expects one per output.
            self._input_grads[(s, m)] = [
                g if g is not None else torch.zeros_like(x) for g, x in zip(got, saved.inputs, strict=True)
            ]
        if want_weights:
            del self._saved[(s, m)]
            if self.poison:
                self._poison(s, saved)

    def _collect_grads(self) -> None:
        """The weight gradients of the step, from its leaves (a weight no forward reached has none)."""
        for (layer, local), leaf in self._leaves.items():
            if leaf.grad is not None:
                self.grads.setdefault(layer, {})[local] = leaf.grad
        self._leaves.clear()

    def _poison(self, s: int, saved: _Saved) -> None:
        """Fill what this (stage, micro-batch) received with NaN once it is used up: reusing a stale
        buffer would then show in the result. Values handed over in memory are left alone (the
        producing stage's graph may still hold them)."""
        received = list(saved.output_grads or []) if s != self.last else []
        if s > 0 and self.placement[s - 1] != self.placement[s]:
            received += saved.inputs
        with torch.no_grad():
            for t in received:
                if t is not None:
                    t.fill_(float("nan"))

    def _output_grads(self, s: int, m: int, saved: _Saved) -> list[torch.Tensor | None]:
        if s == self.last:
            # The loss of each micro-batch counts 1/m: the step is the mean over the whole batch.
            return [torch.full_like(saved.outputs[0], self.loss_scale / len(self.microbatches))]
        if self.placement[s + 1] == self.placement[s]:
            grads = self._input_grads.pop((s + 1, m))
        else:
            grads = self._inbox.pop(("grad", s + 1, m))
        self._outputs.pop((s, m), None)
        if len(grads) != len(saved.outputs):
            raise RuntimeError(
                f"stage {s}, micro-batch {m}: {len(grads)} gradients came back for {len(saved.outputs)} outputs"
            )
        return list(grads)

    def _bound_stage(self, s: int) -> tuple[list[Callable[[Any], Any]], dict[tuple[str, str], torch.Tensor]]:
        """Stage ``s``'s layers bound to the step's leaves (tied ones through their owner), and the
        leaves they use. Bound once per step and stage: every micro-batch runs the same calls."""
        bound = self._bound.get(s)
        if bound is None:
            used: dict[tuple[str, str], torch.Tensor] = {}
            calls = []
            for name in self.stages[s]:
                layer = self.chain[name]
                tensors = {local: self._leaf(layer.ties.get(local, (name, local)), used) for local in layer.param_names}
                calls.append(layer.bind(tensors))
            bound = self._bound[s] = (calls, used)
        return bound

    def _leaf(self, key: tuple[str, str], used: dict[tuple[str, str], torch.Tensor]) -> torch.Tensor:
        """The step's leaf (requires grad) for parameter ``key``, recorded in ``used`` for this forward's
        backward; one leaf per parameter for the whole step."""
        leaf = self._leaves.get(key)
        if leaf is None:
            owner, name = key
            tensor = self.params.get(owner, {}).get(name)
            if tensor is None:
                raise KeyError(f"pipeline rank holds no parameter {name!r} of layer {owner!r}, which its stages use")
            leaf = self._leaves[key] = tensor.detach().requires_grad_(True)
        used[key] = leaf
        return leaf

    def _take_input(self, s: int, m: int) -> Any:
        if self.placement[s - 1] == self.placement[s]:
            y = self._outputs[(s - 1, m)]
            return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
        return self._inbox.pop(("activation", s, m))

    # -- communication -------------------------------------------------------------------
    def send_activation(self, action: Action) -> None:
        s, m = _stage(action), _mb(action)
        self._send(self._outputs[(s, m)], "activation", s, m, dst=self.placement[s + 1])

    def send_grad(self, action: Action) -> None:
        s, m = _stage(action), _mb(action)
        self._send(tuple(self._input_grads.pop((s, m))), "grad", s, m, dst=self.placement[s - 1])

    def _send(self, value: Any, kind: str, s: int, m: int, dst: int) -> None:
        leaves = optree.tree_leaves(value)
        if not leaves:
            raise ValueError(f"stage {s} passes no tensor to the next stage; a pipeline boundary carries at least one")
        mb = len(self.microbatches)
        known = self.layouts is not None
        if not known:  # the receiver learns how many tensors follow
            count = torch.tensor(len(leaves), dtype=torch.int64, device="cpu")  # host-side control data
            self._sends.append(send(count, self.axis, dst, tag=tag_of(kind, s, m, mb), mesh=self.mesh))
        for i, leaf in enumerate(leaves, start=1):
            tag = tag_of(kind, s, m, mb, i)
            # No snapshot: nothing modifies a stage output or an input gradient in place once made,
            # and finish_grads waits for every send (by then the peers have posted their receives).
            self._sends.append(
                send(leaf.detach(), self.axis, dst, tag=tag, announce=not known, snapshot=False, mesh=self.mesh)
            )

    def _source(self, action: Action) -> tuple[str, int, int, int]:
        """(kind, producing stage, micro-batch, source index along the axis) of a receive action."""
        s, m = _stage(action), _mb(action)
        if action.kind == RECV_ACTIVATION:
            return "activation", s - 1, m, self.placement[s - 1]
        return "grad", s + 1, m, self.placement[s + 1]

    def _expected(self, kind: str, producer: int) -> Sequence[Layout]:
        """The tensors a transfer carries, when the step predicted them: an activation carries the
        producing stage's output, a gradient one tensor per floating output of the stage below."""
        assert self.layouts is not None
        boundary = producer if kind == "activation" else producer - 1
        outputs = self.layouts[boundary]
        return outputs if kind == "activation" else [o for o in outputs if o[1].is_floating_point]

    def post_receives(self, actions: Sequence[Action]) -> None:
        """Post every receive of the step, so transfers land while this rank computes instead of
        when it asks for them (gloo moves a message only once its receive is posted). This runs
        at the rank's first receive, before it waits there, so the computes that need no receive
        (stage 0's first forwards) start without paying for it. With predicted layouts every
        tensor is received as it is (one transfer each); otherwise the count and the first tensor
        (a transfer has at least one)."""
        mb = len(self.microbatches)
        self._posted = {}
        for action in actions:
            if action.kind not in (RECV_ACTIVATION, RECV_GRAD):
                continue
            kind, producer, m, src = self._source(action)
            if self.layouts is not None:
                self._posted[(kind, producer, m)] = [
                    recv(self.axis, src, tag=tag_of(kind, producer, m, mb, i), like=like, device=self.device,
                         mesh=self.mesh)
                    for i, like in enumerate(self._expected(kind, producer), start=1)
                ]
            else:
                self._posted[(kind, producer, m)] = [
                    recv(self.axis, src, tag=tag_of(kind, producer, m, mb), mesh=self.mesh),
                    recv(self.axis, src, tag=tag_of(kind, producer, m, mb, 1), device=self.device, mesh=self.mesh),
                ]

    def receive(self, action: Action) -> None:
        if self._posted is None:
            self.post_receives(self._actions)
        assert self._posted is not None
        kind, producer, m, src = self._source(action)
        mb = len(self.microbatches)
        posted = self._posted.pop((kind, producer, m))
        if self.layouts is not None:
            leaves = [handle.wait() for handle in posted]
        else:
            count = int(posted[0].wait())
            leaves = [posted[1].wait()] + [
                recv(self.axis, src, tag=tag_of(kind, producer, m, mb, i), device=self.device, mesh=self.mesh).wait()
                for i in range(2, count + 1)
            ]
        value: Any = leaves if kind == "grad" else (leaves[0] if len(leaves) == 1 else tuple(leaves))
        self._inbox[(kind, _stage(action) if kind == "activation" else producer, m)] = value

    # -- end of step -------------------------------------------------------------------------
    def finish_grads(self, action: Action) -> None:
        """The gradients the optimizer gets (``final_grads``) and this rank's share of the metrics."""
        for handle in self._sends:  # delivered: the peers posted every receive at their first one
            handle.wait()
        self._sends.clear()
        self._collect_grads()
        self._sum_tied_grads()
        self.final_grads = self.grads if self.finalize_grads is None else self.finalize_grads(self.grads)
        if self.exchange.empty:
            return
        # A tied copy's gradient is also its owner's: count it once in the norm.
        counted: Any = {k: v for k, v in self.final_grads.items() if k not in self.replica_layers}
        pieces: list[torch.Tensor] = list(optree.tree_leaves(counted))
        self._local_metrics = self.exchange.local(self._losses, pieces, self._metric_dtype(), self.device)

    def reduce_metrics(self, action: Action) -> None:
        """Start the all-reduce of this rank's share; :meth:`wait_metrics` completes it. A step
        that exchanges nothing (no metric asked for, no rule needing one) sends nothing."""
        if self.exchange.empty:
            return
        if self._local_metrics is None:
            raise RuntimeError("reduce_metrics before finish_grads")
        axes = self.metric_axes or (self.axis,)
        self._pending_metrics = (psum_async(self._local_metrics, axes[0], mesh=self.mesh), axes[1:])

    def wait_metrics(self) -> None:
        """``summed``: the shares summed over the metric axes (once; later calls return)."""
        if self._pending_metrics is None:
            return
        handle, rest = self._pending_metrics
        self._pending_metrics = None
        total = handle.wait()
        for axis in rest:
            total = psum(total, axis, mesh=self.mesh)
        self.summed = self.exchange.unpack(total)

    def _sum_tied_grads(self) -> None:
        """Every rank using a tied weight sends its gradient to the others and sums all of them in
        axis order, so each copy gets the same total and takes the same update."""
        me = self.mesh.axis_index(self.axis)
        for i, (owner, name, users) in enumerate(self.tied):
            if me not in users:
                continue
            mine = self.grads.get(owner, {}).get(name)
            if mine is None:  # this rank's layers did not reach the weight in this step
                mine = torch.zeros_like(self.params[owner][name])
            tag = TIED_TAG_BASE + i
            handles = [send(mine, self.axis, peer, tag=tag, mesh=self.mesh) for peer in users if peer != me]
            parts = {me: mine}
            for peer in users:
                if peer != me:
                    parts[peer] = recv(self.axis, peer, tag=tag, device=mine.device, mesh=self.mesh).wait()
            for handle in handles:
                handle.wait()
            total = parts[users[0]]
            for peer in users[1:]:
                total = total + parts[peer]
            self.grads.setdefault(owner, {})[name] = total

    def _metric_dtype(self) -> torch.dtype:
        dtypes = {t.dtype for layer in self.params.values() for t in layer.values()}
        return torch.float64 if torch.float64 in dtypes else torch.float32


def _stage(action: Action) -> int:
    index = _STAGE_INDEX.get(action.layer)  # a handful of names, read for every action of every step
    if index is None:
        if action.layer is None or not action.layer.startswith("stage"):
            raise ValueError(f"action {action} does not name a stage")
        index = _STAGE_INDEX[action.layer] = int(action.layer.removeprefix("stage"))
    return index


_STAGE_INDEX: dict[str | None, int] = {}


def _mb(action: Action) -> int:
    if action.microbatch is None:
        raise ValueError(f"action {action} needs a micro-batch")
    return action.microbatch


def _op_text(action: Action) -> str:
    kind = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}[action.kind]
    return f"{_stage(action)}{kind}{action.microbatch}"
