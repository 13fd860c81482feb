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
    ``NotEquivalentError`` at the first difference. ``rtol`` defaults to the parameters' dtype's, or, for a
    candidate computing in bf16 or float16, that precision's (:func:`low_precision_rtol`).

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
    if rtol is None:
        rtol = low_precision_rtol(candidate.precision)
    return assert_equivalent(distributed, reference, candidate.mesh, batches, params, rtol=rtol, timeout=timeout)


def low_precision_rtol(precision: str | None) -> float | None:
    """The tolerance of a layout that computes in bf16 (2**-6, the guide's: its float32 parameters differ from the
    one-device bf16 step's by bf16's rounding of what each part sums) or float16 (2**-9), where ``precision``
    names one; None (the parameters' dtype's default) otherwise. Held at the parameters' own tolerance, every
    bf16 layout that cuts the batch was refused (1.1e-4 apart against 1e-5)."""
    text = (precision or "").replace(" ", "").lower()
    if "bf16" in text or "bfloat16" in text:
        return 2**-6
    if "f16" in text or "float16" in text or "half" in text:
        return 2**-9
    return None
