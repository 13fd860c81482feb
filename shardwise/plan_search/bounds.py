"""Lower bounds on a candidate's peak memory and step time, from the model's sizes, before any Plan.

Planning and simulating a 70B-shaped candidate over 512 ranks takes seconds, and the space
holds thousands; most of them either cannot fit or cannot be among the fastest, and arithmetic
says which. Both bounds are below what the Plan and the simulation would give (the tests check
it over whole spaces), so a candidate bounded out could not have been returned:

* memory: a pipeline index holds its stages' share (by parameter count, the pipeline's own
  balanced partition) of the single-device step's parameters and optimizer state, divided by tp
  and ep and, as the ZeRO stage shards them, by dp, through the step; and the more of two moments:
  at the update, the same share of the gradients and of what an out-of-place update keeps beside
  them (its new parameters and state: the new TrainState, held with the old to the step's end,
  ``held_levels.update_levels``); as the backward starts, the activations its schedule keeps (the
  most micro-batches in flight on it, as the schedule's simulation counts them, each at its
  least-keeping stage's figure) of its layers at one micro-batch, predicted as the Plan predicts
  them, once per (tp, micro-batch shape, remat, precision). The Plan's peak is the most the rank
  holds at one of its actions, with more (buffers, gathered units, the loss's own) at each.
* time: a rank's computes run one at a time, each at least its layer's cost at its share of the
  batch and of the parameters (between ``1 / (tp x ep)`` and 1 of them); a stage cannot start before the
  first micro-batch's forward through the stages before it (and under GPipe and 1F1B, whose
  last compute on a stage is a backward, cannot end before that backward has run through the
  stages before it); a collective a split (tensor
  parallel) issues inside a layer blocks the rank for at least its transfer (predicted as the
  Plan predicts them, per layer); a 1F1B or GPipe pipeline's first
  micro-batch runs forward and backward through every stage in turn; and a dp group runs its
  collectives one at a time, among them a reduction of every gradient and a gather of every
  parameter over dp.

What is shared between candidates: the single-device figures per (remat, precision), the kept
bytes and in-layer collectives per layer per (tp, micro-batch shape, remat, precision), and the
layer costs (``compute``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..engine.layout.precision import compute_dtype
from ..engine.layout.state_layout import Placement
from ..engine.optim.meta_like import meta_like
from ..engine.plan.accounting import predict_kept_parts
from ..engine.plan.actions import BACKWARD, FORWARD, LOSS, UPDATE
from ..engine.plan.inside import predict_inside
from ..engine.plan.lower import zero_holds_shards
from ..engine.plan.update_memory import predict_update_held
from ..engine.simulate.costs import CommModel
from ..engine.stack.roles import prediction_keywords
from ..engine.step.planning import one_microbatch, planned_device
from ..engine.step.step import Step
from ..engine.torch_api import data_dependent_errors
from ..transforms.pipeline.simulate import simulate
from .candidate import Candidate
from .compute import LayerCosts, batch_size

FULL_CHAIN = ("gpipe", "1f1b")  # schedules whose first micro-batch runs F and B through every stage in turn


@dataclass(frozen=True)
class Bound:
    """A candidate's lower bounds: ``memory`` (bytes on its fullest rank) and ``time`` (seconds)."""

    memory: int
    time: float


@dataclass
class Bounds:
    """Bounds for the candidates of one search: ``step`` on ``params`` (meta is enough) and the
    global ``batch``, layer costs from ``compute``, communication from ``comm`` (None: free)."""

    step: Step
    params: Any
    batch: Any
    compute: Callable[[Candidate], LayerCosts]
    comm: CommModel | None = None
    _state: dict[Any, tuple[int, int, int, int, float]] = field(default_factory=dict, repr=False)
    _kept: dict[Any, dict[str, int]] = field(default_factory=dict, repr=False)
    _issued: dict[Any, tuple[dict[str, float], dict[str, float], float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.names = list(self.step.chain.names)
        self.weights = {n: sum(t.numel() for t in self.params.get(n, {}).values()) for n in self.names}
        self.total = max(1, sum(self.weights.values()))
        self.samples = batch_size(self.batch)

    def _rewritten(self, c: Candidate) -> Step:
        return Candidate(remat=c.remat, precision=c.precision).apply(self.step)

    def _single(self, c: Candidate) -> tuple[int, int, int, int, float]:
        """(params, grads, optimizer state, what the update keeps) bytes on one device, and the bytes
        per parameter on the wire at the least (the narrowest of the stored, compute and reduce dtypes)."""
        key = c.rewrites
        if key not in self._state:
            step = self._rewritten(c)
            memory = step.plan(None, self.params).memory
            leaves = [t for layer in self.params.values() for t in layer.values()]
            size = min((t.element_size() for t in leaves), default=4)
            if step.precision is not None:
                for name in self.names:
                    policy = step.precision.for_layer(name)
                    dtypes = (policy.compute, policy.reduce)
                    size = min(size, *(d.itemsize for d in dtypes))
            opt = memory.get("opt_state", (0,))[0]
            master = step.master_meta(self.params)
            with meta_like():
                try:
                    _, kept = predict_update_held(step.optimizer.update, master, master, step.optimizer.init(master),
                                                  planned_device(self.params, self.batch))
                except data_dependent_errors():  # an update fake tensors cannot run: none, at the least
                    kept = 0
            self._state[key] = (memory["params"][0], memory["grads"][0], opt, kept, float(size))
        return self._state[key]

    def _kept_per_layer(self, c: Candidate, applied: Step) -> dict[str, int]:
        """Bytes each layer keeps for backward on one micro-batch on a rank, as the Plan predicts
        them (tensor parallel's rank 0's slices): the same for every candidate of the same tp,
        micro-batch shape, remat and precision, so predicted once for all of them."""
        inputs = one_microbatch(applied, c.mesh, self.batch)[0]
        shapes = tuple(tuple(t.shape) for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor))
        key = (*c.rewrites, c.tp, shapes)
        if key not in self._kept:
            with applied.predicting(c.mesh):
                view = applied.compute_view(applied.local_view(self.params, c.mesh, 0))
                self._kept[key] = dict(predict_kept_parts(applied.chain, view, inputs).own)
        return self._kept[key]

    def _inside(self, c: Candidate, applied: Step) -> tuple[dict[str, float], dict[str, float], float]:
        """Seconds of the collectives a split's layers issue inside each layer's forward and backward
        (and the loss's) on one micro-batch, as the Plan predicts them, priced by ``comm``: they
        block the rank (a sync collective). Predicted once per (tp, micro-batch shape, remat,
        precision), each layer as a stage of its own so that any partition can sum them."""
        if self.comm is None or not applied.split.axes:
            return {}, {}, 0.0
        inputs, targets = one_microbatch(applied, c.mesh, self.batch)
        shapes_key = tuple(tuple(t.shape) for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor))
        key = (*c.rewrites, tuple(c.mesh.axis_size(a) for a in applied.split.axes), shapes_key)
        if key not in self._issued:
            local = applied.local_view(self.params, c.mesh, 0)
            shapes = {layer: {name: (t.shape, compute_dtype(applied.precision, layer, t.dtype))
                              for name, t in tensors.items()} for layer, tensors in local.items()}
            placement = Placement.pipelined(applied.chain, "pp", [[n] for n in self.names], range(len(self.names)))
            predict = applied.split.own_prediction() or predict_inside
            found = predict(applied.chain, placement, shapes, applied.loss_fn, inputs, targets,
                            functools.partial(applied.predicting, c.mesh),
                            **prediction_keywords(predict, False))  # (B's alone)
            mesh = c.mesh

            def seconds(kind: str, s: int) -> float:
                assert self.comm is not None
                return sum(self.comm.time(i.op, int(torch.Size(i.shape).numel()) * i.dtype.itemsize,
                                          mesh.axis_size(i.axis), ranks=mesh.group_ranks(i.axis, 0))
                           for i in found.get((kind, s), ()))

            self._issued[key] = ({n: seconds(FORWARD, s) for s, n in enumerate(self.names)},
                                 {n: seconds(BACKWARD, s) for s, n in enumerate(self.names)},
                                 seconds(LOSS, len(self.names) - 1))
        return self._issued[key]

    def __call__(self, c: Candidate, applied: Step, full: bool = True) -> Bound:
        """``c``'s bounds; ``applied``: ``c``'s transforms on the step (for the pipeline's partition).
        ``full=False``: without the activations and the in-layer collectives, which take a
        prediction on fake tensors (seconds on a 70B shape) per (tp, micro-batch shape, remat,
        precision); lower still, and what the search orders every candidate by before it asks
        for the full bound of the ones that come first. Raises the Plan's own ValueError where
        the Plan would refuse the same way (a batch the mesh and micro-batches cannot cut, more
        stages than layers)."""
        inputs = one_microbatch(applied, c.mesh, self.batch)[0]  # the lowering's check of the batch's cut
        pipe = applied.pipeline_spec
        if pipe is not None:
            placement, schedule = pipe.place(applied.chain, c.mesh, self.params)
            stages: Sequence[Sequence[str]] = placement.stages
            index_of: Sequence[int] = schedule.placement
            indices = schedule.num_ranks
        else:
            stages, index_of, indices, schedule = [self.names], [0], 1, None
        params_b, grads_b, opt_b, kept_b, wire = self._single(c)
        zp = c.dp if c.zero_stage and zero_holds_shards(applied) else 1  # params at rest: whole, or shards
        zs = c.dp if c.zero_stage else 1
        del inputs
        kept = self._kept_per_layer(c, applied) if full else {}
        per_stage = [sum(kept.get(n, 0) for n in layers) for layers in stages]
        if pipe is None or not full:  # (the schedule's simulation is for the full bound only)
            held: Sequence[int] = (per_stage[0],) if pipe is None else (0,) * indices
        else:
            # The most micro-batches in flight on an index, each keeping at least its least-keeping stage's.
            peaks = simulate(schedule).peak_activations
            held = [peaks[i] * min((per_stage[s] for s, p in enumerate(index_of) if p == i), default=0)
                    for i in range(indices)]
        share = [0.0] * indices
        for s, layers in enumerate(stages):
            share[index_of[s]] += sum(self.weights[n] for n in layers) / self.total
        split = c.tp * c.ep
        rest = [sh * (params_b / zp + opt_b / zs) / split for sh in share]
        made = [sh * (grads_b + kept_b) / zs / split for sh in share]  # by the update, the activations freed
        memory = max(int(rest[i]) + max(int(made[i]), held[i]) for i in range(indices))
        return Bound(memory, self._time(c, applied, stages, index_of, indices, share, wire, zs, full))

    def _time(self, c: Candidate, applied: Step, stages: Sequence[Sequence[str]], index_of: Sequence[int],
              indices: int, share: Sequence[float], wire: float, zs: int, full: bool) -> float:
        costs = self.compute(c)
        f_in, b_in, loss_in = self._inside(c, applied) if full else ({}, {}, 0.0)
        f = 1.0 / (c.batch_ways * c.microbatches)
        split = c.tp * c.ep  # a rank holds between 1 / split and all of a layer's parameters

        def least(kind: str, layer: str | None, lo: float, hi: float) -> float:
            return min(costs.at(kind, layer, lo), costs.at(kind, layer, hi))

        forward = [sum(least(FORWARD, n, f / split, f) + f_in.get(n, 0.0) for n in layers) for layers in stages]
        backward = [sum(least(BACKWARD, n, f / split, f) + b_in.get(n, 0.0) for n in layers) for layers in stages]
        loss = costs.at(LOSS, None, f) + loss_in
        update = costs.full.get((UPDATE, None), 0.0)
        work = [0.0] * indices
        first = [len(stages)] * indices
        for s in range(len(stages)):
            i = index_of[s]
            work[i] += c.microbatches * (forward[s] + backward[s] + (loss if s == len(stages) - 1 else 0.0))
            first[i] = min(first[i], s)
        best = 0.0
        for i in range(indices):
            own = work[i] + update * min(1.0, share[i] / (split * zs))
            before = sum(forward[:first[i]])
            # Under GPipe and 1F1B a stage's last compute is a backward, which every stage before
            # it must then run too, one after another.
            after = sum(backward[:first[i]]) if c.pp > 1 and c.schedule in FULL_CHAIN else 0.0
            best = max(best, before + own, before + work[i] + after, self._dp_comm(c, stages, index_of, i, wire))
        if c.pp > 1 and c.schedule in FULL_CHAIN:
            best = max(best, sum(forward) + sum(backward) + loss)
        return best

    def _dp_comm(self, c: Candidate, stages: Sequence[Sequence[str]], index_of: Sequence[int], index: int,
                 wire: float) -> float:
        """The dp group's collectives, one at a time: the index's gradients reduced and its
        parameters gathered over dp at least once a step."""
        if self.comm is None or c.dp == 1:
            return 0.0
        mesh = c.mesh
        coords = {axis: 0 for axis in mesh.axis_names}
        if "pp" in coords:
            coords["pp"] = index
        group = mesh.group_ranks("dp", mesh.rank_of(coords))
        model = self.comm.level(group)
        held = sum(self.weights[n] for s, layers in enumerate(stages) if index_of[s] == index for n in layers)
        nbytes = int(held * wire / (c.tp * c.ep))
        # One call each at the least: buckets (ZeRO-1 and 2) reduce many units in one collective.
        reduce = min(model.time(op, nbytes, c.dp) for op in ("psum_scatter", "psum"))
        return reduce + model.time("all_gather", nbytes // c.dp, c.dp)
