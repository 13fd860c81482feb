"""Compute costs for the search: what each layer's forward, backward, loss and update take on
one device, at the whole batch and at a small share of it, measured or from a FLOP count.

A candidate's rank runs each layer on a share of the batch (``1 / (dp x micro-batches)``)
and, under tensor parallel, on its slice of the layer's parameters; its update on its share
of the optimizer state. :meth:`LayerCosts.at` reads a cost at such a share off the line
through the two measured points: on a CPU a small layer's time is far from proportional to
its batch (a fixed cost per call), so one point would mis-price every split of the batch.
``remat`` and ``precision`` change what a layer costs (a recompute, a cast), so each distinct
pair is measured with those rewrites applied (:class:`MeasuredCompute`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import optree
import torch

from ..engine.plan.actions import BACKWARD, FORWARD, LOSS, UPDATE
from ..engine.step.step import Step
from .candidate import Candidate

Key = tuple[str, str | None]  # (action kind, layer or None)
PER_ACTION = "per_action"  # measure_once's key for the executor's time between actions


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per (kind, layer) of a single-device step at the whole batch (``full``) and at
    ``small_fraction`` of it (``small``); ``per_action``: the executor's own time between two
    actions, which every action of a Plan pays (a distributed Plan has many more actions).

    >>> costs = LayerCosts({("forward", "a"): 3.0}, {("forward", "a"): 1.5}, 0.25)
    >>> costs.at("forward", "a", 0.5), costs.at("forward", "b", 0.5)
    (2.0, 0.0)
    """

    full: Mapping[Key, float]
    small: Mapping[Key, float]
    small_fraction: float
    source: str = "measured"
    per_action: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.small_fraction < 1:
            raise ValueError(f"LayerCosts(small_fraction={self.small_fraction}): a share of the batch in [0, 1)")
        for name in ("full", "small"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def at(self, kind: str, layer: str | None, fraction: float) -> float:
        """The cost of ``kind`` of ``layer`` at ``fraction`` of the batch (0 when never seen)."""
        whole = self.full.get((kind, layer))
        if whole is None:
            return 0.0
        part = self.small.get((kind, layer), whole * self.small_fraction)
        slope = (whole - part) / (1.0 - self.small_fraction)
        return max(0.0, part + slope * (fraction - self.small_fraction))


def _shrink(batch: Any, n: int) -> Any:
    """The first ``n`` samples of every tensor of ``batch`` (batch-first)."""
    return optree.tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def batch_size(batch: Any) -> int:
    sizes = {t.shape[0] for t in optree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()}
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors must share their first (batch) dim; their sizes are {sorted(sizes)}")
    return sizes.pop()


def measure_once(step: Step, params: Any, batch: Any, steps: int = 10, warmup: int = 1) -> dict[Key, float]:
    """Seconds of every (kind, layer) of single-device steps of ``step`` on ``batch``: each action's
    shortest over ``steps`` steps (what it costs when nothing else takes its core: on a shared
    machine a millisecond's action that lost its core to another process for a time slice would
    otherwise look ten times dearer than its twin), summed where a kind and layer recur."""
    traced = step.with_trace()
    plan = traced.plan(None, params, batch)
    state = traced.init(params)
    shortest: dict[int, float] = {}
    between = float("inf")
    for i in range(warmup + steps):
        state, metrics = traced(state, batch)
        if i >= warmup:
            ordered = sorted(metrics["action_times"], key=lambda t: t[1])
            for pos, start, end in ordered:
                shortest[pos] = min(shortest.get(pos, float("inf")), end - start)
            gaps = [max(0.0, b[1] - a[2]) for a, b in itertools.pairwise(ordered)]
            between = min(between, sum(gaps) / max(1, len(gaps)))
    times: dict[Key, float] = {}
    for pos, action in enumerate(plan.actions[0]):
        key = (action.kind, action.layer)
        times[key] = times.get(key, 0.0) + shortest.get(pos, 0.0)
    times[(PER_ACTION, None)] = 0.0 if between == float("inf") else between
    return times


class MeasurementFailed(RuntimeError):
    """The single-device step could not be measured (it raised on the batch): no candidate of these
    rewrites can be priced from measurements. The search refuses them at the stage ``measure``."""


@dataclass
class MeasuredCompute:
    """Layer costs measured on one device, once per (remat, precision) a candidate asks for.

    ``smallest`` is the smallest share of the batch a candidate's action runs on (the search
    passes ``1 / (world x largest micro-batch count)``); it is measured at that many samples
    (at least one). A step that cannot run that few (BatchNorm in training at one sample) is
    measured at twice as many, and so on, up to the whole batch (then the costs are taken as
    proportional to the batch); ``source`` says so. A step that cannot run the whole batch
    raises :class:`MeasurementFailed`. ``threads``: torch threads while measuring (a rank's,
    usually 1).
    """

    step: Step
    params: Any
    batch: Any
    smallest: float = 0.25
    steps: int = 10
    threads: int = 1
    _cache: dict[tuple[str | None, str | None], LayerCosts | MeasurementFailed] = field(default_factory=dict,
                                                                                        repr=False)
    _moved: list[str] = field(default_factory=list, repr=False)

    @property
    def source(self) -> str:
        """How the costs were had, in words: with where a small measurement had to move."""
        return "; ".join(["measured on one device", *self._moved])

    def __call__(self, candidate: Candidate) -> LayerCosts:
        key = candidate.rewrites
        if key not in self._cache:
            before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                self._cache[key] = self._measured(candidate)
            except MeasurementFailed as err:  # once per rewrites: every candidate of them would fail alike
                self._cache[key] = err
            finally:
                torch.set_num_threads(before)
        found = self._cache[key]
        if isinstance(found, MeasurementFailed):
            raise found
        return found

    def _measured(self, candidate: Candidate) -> LayerCosts:
        rewritten = Candidate(remat=candidate.remat, precision=candidate.precision).apply(self.step)
        whole = batch_size(self.batch)
        try:
            full = measure_once(rewritten, self.params, self.batch, self.steps)
        except (ValueError, RuntimeError) as err:
            raise MeasurementFailed(
                f"the single-device step{_of(candidate)} raised on the whole batch while being measured "
                f"({_said(err)}); fix the step, or pass compute=FlopCompute(...)"
            ) from err
        n, small = max(1, int(whole * self.smallest)), {}
        failed: tuple[int, str] | None = None
        while n < whole:
            try:
                small = measure_once(rewritten, self.params, _shrink(self.batch, n), self.steps)
                break
            except (ValueError, RuntimeError) as err:  # too few samples for the model (BatchNorm at one)
                failed = failed or (n, _said(err))
                n *= 2
        if failed is not None:
            where = f"at {n} samples" if n < whole else "at the whole batch only, costs taken as proportional to it"
            self._moved.append(f"the small point{_of(candidate)} measured {where}: at {failed[0]} samples the step "
                               f"raised {failed[1]}")
        per_action = full.pop((PER_ACTION, None))
        small.pop((PER_ACTION, None), None)
        return LayerCosts(full, small, n / whole if n < whole else 0.0, per_action=per_action)


def _of(candidate: Candidate) -> str:
    rewrites = ", ".join(f"{k}={v}" for k, v in (("remat", candidate.remat), ("precision", candidate.precision))
                         if v is not None)
    return f" (under {rewrites})" if rewrites else ""


def _said(err: BaseException) -> str:
    """``err`` as its type and first line (a torch error can run to pages)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


@dataclass(frozen=True)
class FlopCompute:
    """Layer costs from a FLOP count: a layer's forward does ``2 x parameters x tokens`` FLOPs,
    its backward twice that (plus a forward again under remat), the update ``update_flops``
    per parameter, all at ``flops_per_second``. A step's tokens are its ``samples`` (the global
    batch) times ``tokens_per_sample`` (a sequence's length for a language model).

    >>> model = FlopCompute({"a": 10, "b": 0}, flops_per_second=1e3, samples=4)
    >>> costs = model(Candidate())
    >>> costs.at("forward", "a", 1.0), costs.at("backward", "a", 0.5)
    (0.08, 0.08)
    """

    params_per_layer: Mapping[str, int]
    flops_per_second: float
    samples: int
    tokens_per_sample: int = 1
    update_flops: float = 10.0
    source: ClassVar[str] = "from a FLOP count"

    def __post_init__(self) -> None:
        if not self.flops_per_second > 0:
            raise ValueError(f"FlopCompute(flops_per_second={self.flops_per_second}): a rate above 0, e.g. 1e12")

    def __call__(self, candidate: Candidate) -> LayerCosts:
        tokens = self.samples * self.tokens_per_sample
        full: dict[Key, float] = {}
        for layer, n in self.params_per_layer.items():
            forward = 2.0 * n * tokens / self.flops_per_second
            full[(FORWARD, layer)] = forward
            full[(BACKWARD, layer)] = 2 * forward + (forward if candidate.remat is not None else 0.0)
        full[(UPDATE, None)] = self.update_flops * sum(self.params_per_layer.values()) / self.flops_per_second
        full.setdefault((LOSS, None), 0.0)
        return LayerCosts(full, {}, 0.0, source="flops")


def params_per_layer(step: Step, params: Any) -> dict[str, int]:
    """Parameter count of every layer of ``step``'s chain (a layer's own, tied ones once)."""
    return {name: sum(t.numel() for t in step.chain.layer_params(params, name).values())
            for name in step.chain.names}

