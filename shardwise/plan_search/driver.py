"""``search``: the candidates of the space bounded by arithmetic, the ones that can still be
among the best priced once (planned, checked against the memory budget, simulated), ranked by
time, and (when a small version of the model is given) the best certified."""

from __future__ import annotations

import heapq
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import optree
import torch

from ..engine.model.pytrees import plain_batch
from ..engine.model.reuse import sharing_runs
from ..engine.simulate.costs import CommModel
from ..engine.step.step import Step
from ..testing.equivalence import NotEquivalentError
from .bounds import Bound, Bounds
from .candidate import Candidate
from .certify import certify
from .compute import LayerCosts, MeasuredCompute, MeasurementFailed
from .rank import CERTIFY, COMPOSE, MEASURE, MEMORY, PLAN, Priced, Refused, first_line, meta, price
from .result import SearchResult
from .space import Space
from .units import format_bytes, parse_bytes


def _on_meta(params: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in optree.tree_leaves(params))


# The layouts plan one model many times: a layer rewritten alike under two of them runs once.
@sharing_runs()
def search(
    step: Step, params: Any, batch: Any, *, world: int, memory_per_rank: int | str,
    comm: CommModel | None = None, compute: Callable[[Candidate], LayerCosts] | None = None,
    tp_plan: Mapping[str, Any] | None = None, space: Space | None = None, top: int = 5,
    cores: int | None = None, certify_with: tuple[Step, Any, Sequence[Any]] | None = None, prune: bool = True,
    cp_options: Mapping[str, Any] | None = None,
) -> SearchResult:
    """The layouts of ``step`` on ``world`` ranks that fit ``memory_per_rank``, fastest first.

    Every candidate of ``space`` (default :class:`Space`: dp, pp, tp and their products, ZeRO
    1-3, gpipe and 1f1b with 1, 2 or 4 micro-batches, remat off and on) is applied with the real
    transforms and bounded from the model's sizes (lower bounds on its peak memory and its step
    time; the guide's "Searching at scale"); one whose memory bound is over budget is refused, and the others are
    planned in the order of their time bound, until the bound of the next is above the time of
    the ``top``-th fastest so far (``prune=False``: all of them; the result counts the ones left,
    ``bounded``). Each is planned once on meta parameters with the global ``batch``, refused when a rank's
    predicted peak (``plan.memory["peak"]``) is over budget, and simulated: compute from
    ``compute`` (default: :class:`MeasuredCompute`, single-device steps of ``step`` measured
    here, which needs real ``params``; or :class:`FlopCompute`), communication from ``comm``
    (default: free, and the result says so), ranks sharing ``cores`` cores (None: one each).
    Tensor parallel needs ``tp_plan`` (e.g. ``sw.tp.tiny_gpt_plan()``); without it those shapes are
    skipped, with the reason. Context parallel (``Space(cp=...)``, with ``cp_options`` for
    :func:`~shardwise.context_parallel`), expert parallel (``Space(ep=...)``) and HSDP
    (``Space(replicate=...)``) are tried where the space asks for them; cp and ep only where the
    model takes them (attention modules, mixture-of-experts blocks), else skipped with the
    transform's reason. With ``certify_with=(small_step, small_params, small_batches)``,
    the best layouts are checked by :func:`certify` in rank order until ``top`` pass; one that
    fails is refused (stage ``certify``), never returned.

    >>> import torch, shardwise as sw
    >>> from shardwise.plan_search import FlopCompute, params_per_layer
    >>> from shardwise.testing.models import mlp
    >>> chain, params = sw.functionalize(mlp([16, 64, 64, 16]))
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-3))
    >>> batch = (torch.randn(32, 16), torch.randn(32, 16))
    >>> found = sw.search(step, params, batch, world=2, memory_per_rank="1MiB",
    ...                   compute=FlopCompute(params_per_layer(step, params), 1e9, 32))
    >>> all(p.memory <= 2**20 for p in found.ranked), found.ranked[0].time <= found.ranked[-1].time
    (True, True)
    >>> ready = found.best.candidate.apply(step)   # the step to launch on found.best.mesh
    """
    if not isinstance(step, Step):
        raise TypeError(f"search(step=...) needs a shardwise Step (see train_step), got {type(step).__name__}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"search(top={top!r}): how many layouts to return, an int >= 1")
    _check_arguments(world, comm, space, cores)
    _check_single_device(step, "step")
    if certify_with is not None:
        _check_small_version(step, certify_with)
    budget = parse_bytes(memory_per_rank)
    batch = plain_batch(batch)  # a tokenizer's BatchEncoding: the dict every plan and measurement cuts
    space = space or Space()
    skipped = [] if tp_plan is not None else ["tensor parallel shapes (tp > 1): no tp_plan= given"]
    allows = {"cp": _allows(step, "cp", space.cp, cp_options, skipped),
              "ep": _allows(step, "ep", space.ep, None, skipped)}
    if compute is None:
        if _on_meta(params):
            raise ValueError("search: params are on the meta device, so no step can be measured; pass "
                             "compute=FlopCompute(params_per_layer(step, params), flops_per_second, samples)")
        compute = MeasuredCompute(step, params, batch, smallest=1.0 / (world * max(space.microbatches)))
    shapes = meta(params)
    base_opt = step.plan(None, shapes).memory.get("opt_state", (0,))[0]
    bounds = Bounds(step, shapes, batch, compute, comm)
    refused: list[Refused] = []
    queue: list[tuple[float, str, bool, Candidate, Step]] = []
    for candidate in space.candidates(world, tensor_parallel=tp_plan is not None, **allows):
        try:
            applied = candidate.apply(step, tp_plan, cp_options)
        except (ValueError, TypeError) as err:
            refused.append(Refused(candidate, COMPOSE, first_line(err)))
            continue
        try:
            bound = bounds(candidate, applied, full=False)
        except MeasurementFailed as err:  # the step's costs, not this layout, are wanting
            refused.append(Refused(candidate, MEASURE, str(err)))
            continue
        except ValueError as err:  # what the lowering says of this batch cut or partition
            refused.append(Refused(candidate, PLAN, first_line(err)))
            continue
        except (TypeError, RuntimeError):
            bound = Bound(0, 0.0)  # no bound: the Plan will say what is wrong
        if bound.memory > budget:
            refused.append(_over(candidate, bound, budget))
            continue
        queue.append((bound.time, str(candidate), False, candidate, applied))
    heapq.heapify(queue)

    def full_bound(c: Candidate, applied: Step) -> Bound:
        try:
            return bounds(c, applied)
        except (ValueError, TypeError, RuntimeError):
            return Bound(0, 0.0)  # no bound: the Plan will say what is wrong

    pricing = _Pricing(queue, prune, budget, full_bound, lambda c, applied: price(
        c, step, shapes, batch, budget=budget, tp_plan=tp_plan, compute=compute, comm=comm or CommModel(),
        cores=cores, base_opt_bytes=base_opt, applied=applied))
    pricing.fill(top)
    chosen = (pricing.ranked()[:top] if certify_with is None
              else _certified(pricing, top, tp_plan, cp_options, certify_with))
    refused += pricing.refused
    failed = {r.candidate for r in refused}
    chosen_set = {c.candidate for c in chosen}
    ranked = pricing.ranked()
    others = [p for p in ranked if p.candidate not in chosen_set and p.candidate not in failed]
    source = getattr(compute, "source", None) or type(compute).__name__
    return SearchResult(tuple(chosen), tuple(refused), len(ranked), tuple(others), tuple(skipped), world, budget,
                        source, comm is not None, bounded=len(pricing.queue), bounded_above=pricing.threshold())


def _check_single_device(step: Step, what: str) -> None:
    """Refuse a step some parallel transform already rewrote: the search applies its own."""
    parallel = [str(spec) for spec in step.parallel_transforms]
    if parallel:
        raise ValueError(
            f"search({what}=...) takes the single-device step (train_step's, with mixed_precision or remat if you "
            f"like) and applies each layout itself; this one is already {' and '.join(parallel)}: pass the step "
            "before those transforms"
        )


def _check_arguments(world: Any, comm: Any, space: Any, cores: Any) -> None:
    """Refuse arguments of the wrong kind before the search runs (a string world, a dict for a Space, a comm that
    is no CommModel: raw errors deep inside it before; cores 0: every candidate refused at its simulation)."""
    if isinstance(world, bool) or not isinstance(world, int):
        raise TypeError(f"search(world={world!r}): the number of ranks, an int (e.g. world=8)")
    if comm is not None and not isinstance(comm, CommModel):
        raise TypeError(f"search(comm={comm!r}): a sw.plan.CommModel (its bandwidths and latencies), or None to price "
                        "communication as free")
    if space is not None and not isinstance(space, Space):
        raise TypeError(f"search(space={space!r}): a sw.plan_search.Space (e.g. Space(dp=(1, 2), pp=(1,))), or None "
                        "for the default one")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ValueError(f"search(cores={cores!r}): the cores the ranks share, an int >= 1, or None (one a rank)")


def _check_small_version(step: Step, certify_with: Any) -> None:
    """Refuse a small step that is not a small version of ``step`` (the guide's rule: the same layers,
    loss and optimizer): its certificate would speak of another model."""
    if not (isinstance(certify_with, tuple) and len(certify_with) == 3 and isinstance(certify_with[0], Step)):
        raise TypeError("search(certify_with=...): give (small_step, small_params, small_batches)")
    small, batches = certify_with[0], certify_with[2]
    if not isinstance(batches, (list, tuple)) or not batches or not all(
            isinstance(b, (list, tuple, Mapping)) for b in batches):
        raise ValueError("search(certify_with=(small_step, small_params, small_batches)): small_batches is a list of "
                         "at least one batch (two catch a wrong update), each (inputs, targets) or a dict, not one "
                         "batch nor an empty list")
    _check_single_device(small, "certify_with")
    differs = [
        f"{what} {mine} there, {theirs} here" for what, mine, theirs in (
            ("layers", _kinds_of_layers(small), _kinds_of_layers(step)),
            ("optimizer", _kind(small.optimizer), _kind(step.optimizer)),
            ("loss", _kind(small.loss_fn), _kind(step.loss_fn)),
        ) if mine != theirs
    ]
    if differs:
        raise ValueError(
            "search(certify_with=...): the small step is not a small version of the step searched "
            f"({'; '.join(differs)}), so its certificate would be of another model: build it as the step is built "
            "(the same kinds of layers, fewer of them, the same loss and optimizer; smaller widths and batches), e.g. "
            "from the same model code with a smaller config"
        )


def _kinds_of_layers(step: Step) -> list[str]:
    """The step's layer names with their indices as ``*``, once each, in order: a small version has
    fewer blocks (``blocks.0``, ``blocks.1`` for ``blocks.0`` to ``blocks.3``), the same kinds of layers."""
    kinds: list[str] = []
    for name in step.chain.names:
        kind = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def _kind(obj: Any) -> str:
    """What an optimizer or loss is, for comparing a small step's with the searched one's: a function by
    its name (a loss, a user optimizer's update method), anything else by its class (a built-in update)."""
    made = getattr(obj, "update", obj)
    if isinstance(made, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return str(made.__qualname__)
    return type(made).__qualname__


def _over(candidate: Candidate, bound: Bound, budget: int) -> Refused:
    return Refused(candidate, MEMORY, f"a lower bound on a rank's peak (from the model's sizes) is over the budget "
                   f"of {format_bytes(budget)}", f"peak at least {bound.memory} bytes")


class _Pricing:
    """The candidates that passed the cheap memory bound, a heap by their time bound: the first is
    given its full bound (refused if that is over budget, put back if it moved), then priced,
    until none left can be among the ``want`` fastest (``prune``), or all of them."""

    def __init__(self, queue: list[tuple[float, str, bool, Candidate, Step]], prune: bool, budget: int,
                 full_bound: Callable[[Candidate, Step], Bound],
                 price_one: Callable[[Candidate, Step], Priced | Refused]) -> None:
        self.queue, self.prune, self.budget = queue, prune, budget
        self.full_bound, self.price_one = full_bound, price_one
        self.priced: list[Priced] = []
        self.refused: list[Refused] = []
        self.want = 0

    def threshold(self) -> float | None:
        """The ``want``-th fastest time so far: a candidate whose bound is above it cannot enter."""
        if len(self.priced) < self.want or not self.want:
            return None
        return sorted(p.time for p in self.priced)[self.want - 1]

    def fill(self, want: int) -> None:
        self.want = max(self.want, want)
        while self.queue:
            bound, name, full, candidate, applied = self.queue[0]
            limit = self.threshold() if self.prune else None
            if limit is not None and bound > limit:
                return
            heapq.heappop(self.queue)
            if not full:
                found = self.full_bound(candidate, applied)
                if found.memory > self.budget:
                    self.refused.append(_over(candidate, found, self.budget))
                else:
                    heapq.heappush(self.queue, (max(bound, found.time), name, True, candidate, applied))
                continue
            outcome = self.price_one(candidate, applied)
            (self.priced if isinstance(outcome, Priced) else self.refused).append(outcome)  # type: ignore[arg-type]

    def ranked(self) -> list[Priced]:
        return sorted(self.priced, key=lambda p: (p.time, p.memory, str(p.candidate)))


def _allows(step: Step, axis: str, sizes: Sequence[int], options: Mapping[str, Any] | None,
            skipped: list[str]) -> bool:
    """Whether ``step``'s model takes context parallel (``cp``) or expert parallel (``ep``), tried
    once: a model without attention modules or mixture-of-experts blocks is refused by the
    transform, and its shapes are skipped, with the transform's reason."""
    if all(n == 1 for n in sizes):
        return False
    try:
        Candidate(**{axis: 2}).apply(step, None, options)  # type: ignore[arg-type]
    except (ValueError, TypeError) as err:
        skipped.append(f"{axis} > 1: {first_line(err)}")
        return False
    return True


def _certified(pricing: _Pricing, top: int, tp_plan: Mapping[str, Any] | None, cp_options: Mapping[str, Any] | None,
               small: tuple[Step, Any, Sequence[Any]]) -> list[Priced]:
    """The first ``top`` of the priced layouts, fastest first, that pass :func:`certify` on the small
    model; one that fails is refused, and the next fastest is priced if the bounds had left it out."""
    small_step, small_params, small_batches = small
    passed: list[Priced] = []
    checked: set[Candidate] = set()
    while len(passed) < top:
        todo = [p for p in pricing.ranked() if p.candidate not in checked]
        if not todo:
            break
        for p in todo:
            if len(passed) == top:
                break
            checked.add(p.candidate)
            try:
                report = certify(p.candidate, small_step, small_params, small_batches, tp_plan=tp_plan,
                                 cp_options=cp_options)
            except (NotEquivalentError, ValueError, TypeError, RuntimeError) as err:
                pricing.refused.append(Refused(p.candidate, CERTIFY, first_line(err)))
                pricing.fill(pricing.want + 1)  # one fewer can be returned: the next may be needed
                break
            passed.append(replace(p, certified=str(report)))
    return passed
