"""Certification: a chosen layout checked by the equivalence checker before anyone launches it.

The check runs at a reduced shape that the user supplies: a small version of the model (fewer
layers, a smaller width, the same layer names and structure) built into a step, its
parameters and a few batches. Shrinking an arbitrary model automatically is not robust (a
module's widths are tied together in ways only its config knows), so the search asks for the
small version instead; a config callable makes one in a line (``make(n_layers=2, d_model=16)``).
The candidate's transforms are applied to the small step as they are to the real one, and
:func:`shardwise.testing.assert_equivalent` compares it on thread ranks with the small step
on one device under the candidate's precision (a bf16 layout is held to a bf16 reference).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.step.step import Step
from ..testing.equivalence import EquivalenceReport, assert_equivalent
from .candidate import Candidate


def certify(
    candidate: Candidate, step: Step, params: Any, batches: Sequence[Any], *,
    tp_plan: Mapping[str, Any] | None = None, rtol: float | None = None, timeout: float = 120.0,
    cp_options: Mapping[str, Any] | None = None,
) -> EquivalenceReport:
    """Check ``candidate`` on the small ``step``: its transforms applied, on ``candidate.mesh``'s
    ranks as threads, against ``step`` on one device, over ``batches``; raise
    ``NotEquivalentError`` at the first difference.

    >>> import torch, shardwise as sw
    >>> from shardwise.testing.models import mlp
    >>> chain, params = sw.functionalize(mlp([4, 8, 8, 2]).double())
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    >>> batches = [(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64))] * 2
    >>> print(certify(Candidate(dp=2, zero_stage=3), step, params, batches))  # doctest: +ELLIPSIS
    equivalent over 2 steps; worst relative error ...
    """
    if not isinstance(candidate, Candidate):
        raise TypeError(f"certify(candidate=...) takes a search Candidate, got {type(candidate).__name__}")
    if not batches:
        raise ValueError("certify needs at least one batch of the small model (two catch a wrong update)")
    distributed = candidate.apply(step, tp_plan, cp_options)
    reference = Candidate(precision=candidate.precision).apply(step)
    return assert_equivalent(distributed, reference, candidate.mesh, batches, params, rtol=rtol, timeout=timeout)
