"""``search``: every candidate of the space priced once, pruned by memory, ranked by time,
and (when a small version of the model is given) the best certified."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import optree
import torch

from ..engine.simulate.costs import CommModel
from ..engine.step.step import Step
from ..testing.equivalence import NotEquivalentError
from .candidate import Candidate
from .certify import certify
from .compute import LayerCosts, MeasuredCompute
from .rank import CERTIFY, Priced, Refused, first_line, meta, price
from .result import SearchResult
from .space import Space
from .units import parse_bytes


def _on_meta(params: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in optree.tree_leaves(params))


def search(
    step: Step, params: Any, batch: Any, *, world: int, memory_per_rank: int | str,
    comm: CommModel | None = None, compute: Callable[[Candidate], LayerCosts] | None = None,
    tp_plan: Mapping[str, Any] | None = None, space: Space | None = None, top: int = 5,
    cores: int | None = None, certify_with: tuple[Step, Any, Sequence[Any]] | None = None,
) -> SearchResult:
    """The layouts of ``step`` on ``world`` ranks that fit ``memory_per_rank``, fastest first.

    Every candidate of ``space`` (default :class:`Space`: dp, pp, tp and their products, ZeRO
    1-3, gpipe and 1f1b with 1, 2 or 4 micro-batches, remat off and on) is applied with the real
    transforms, planned once on meta parameters with the global ``batch``, refused when a rank's
    predicted peak (``plan.memory["peak"]``) is over budget, and simulated: compute from
    ``compute`` (default: :class:`MeasuredCompute`, single-device steps of ``step`` measured
    here, which needs real ``params``; or :class:`FlopCompute`), communication from ``comm``
    (default: free, and the result says so), ranks sharing ``cores`` cores (None: one each).
    Tensor parallel needs ``tp_plan`` (e.g. ``sw.tp.tiny_gpt_plan()``); without it those shapes are
    skipped, with the reason. With ``certify_with=(small_step, small_params, small_batches)``,
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
    budget = parse_bytes(memory_per_rank)
    space = space or Space()
    skipped = [] if tp_plan is not None else ["tensor parallel shapes (tp > 1): no tp_plan= given"]
    if compute is None:
        if _on_meta(params):
            raise ValueError("search: params are on the meta device, so no step can be measured; pass "
                             "compute=FlopCompute(params_per_layer(step, params), flops_per_second, samples)")
        compute = MeasuredCompute(step, params, batch, smallest=1.0 / (world * max(space.microbatches)))
    shapes = meta(params)
    base_opt = step.plan(None, shapes).memory.get("opt_state", (0,))[0]
    priced: list[Priced] = []
    refused: list[Refused] = []
    for candidate in space.candidates(world, tensor_parallel=tp_plan is not None):
        outcome = price(candidate, step, shapes, batch, budget=budget, tp_plan=tp_plan, compute=compute,
                        comm=comm or CommModel(), cores=cores, base_opt_bytes=base_opt)
        (priced if isinstance(outcome, Priced) else refused).append(outcome)  # type: ignore[arg-type]
    priced.sort(key=lambda p: (p.time, p.memory, str(p.candidate)))
    fitting = len(priced)
    chosen = priced[:top] if certify_with is None else _certified(priced, refused, top, tp_plan, certify_with)
    failed = {r.candidate for r in refused}
    others = [p for p in priced if p.candidate not in {c.candidate for c in chosen} and p.candidate not in failed]
    source = getattr(compute, "source", None) or type(compute).__name__
    return SearchResult(tuple(chosen), tuple(refused), fitting, tuple(others), tuple(skipped), world, budget,
                        source, comm is not None)


def _certified(priced: list[Priced], refused: list[Refused], top: int, tp_plan: Mapping[str, Any] | None,
               small: tuple[Step, Any, Sequence[Any]]) -> list[Priced]:
    """The first ``top`` of ``priced`` that pass :func:`certify` on the small model; the ones that
    fail go to ``refused``."""
    small_step, small_params, small_batches = small
    passed: list[Priced] = []
    for p in priced:
        if len(passed) == top:
            break
        try:
            report = certify(p.candidate, small_step, small_params, small_batches, tp_plan=tp_plan)
        except (NotEquivalentError, ValueError, TypeError, RuntimeError) as err:
            refused.append(Refused(p.candidate, CERTIFY, first_line(err)))
            continue
        passed.append(replace(p, certified=str(report)))
    return passed
