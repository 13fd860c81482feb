"""Is my distributed step the same computation as my single-device step?

:func:`assert_equivalent` runs several steps of both on the same global
batches and compares the loss and every parameter after every step, on every
rank. On failure it reports the first divergence: the step, the parameter
path, the rank, the largest absolute and relative error.

Errors are measured per tensor as ``max|a - b|`` against ``atol + rtol *
max|b|`` (a norm-wise relative error), which stays meaningful for tensors with
entries near zero, where an element-wise relative error is noise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from ..collectives.launch import launch
from ..collectives.mesh import Mesh

# Default rtol by parameter dtype. float64: distributed sums change only the
# rounding order, ~1e-16 per operation, so 1e-10 leaves room for depth and
# steps while catching any real error; lower precisions scale with their eps.
DEFAULT_RTOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}


class NotEquivalentError(AssertionError):
    """The distributed step diverged from the reference; attributes say where."""

    def __init__(self, message: str, step: int, path: str, rank: int, abs_err: float, rel_err: float) -> None:
        super().__init__(message)
        self.step, self.path, self.rank, self.abs_err, self.rel_err = step, path, rank, abs_err, rel_err


@dataclass
class EquivalenceReport:
    """Largest errors seen per step (over ranks, parameters and the loss)."""

    steps: int
    max_abs_err: list[float] = field(default_factory=list)
    max_rel_err: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        worst = max(self.max_rel_err, default=0.0)
        return f"equivalent over {self.steps} steps; worst relative error {worst:.3g}"


def _errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, float]:
    a = actual.detach().to(torch.float64)
    b = expected.detach().to(torch.float64)
    if a.shape != b.shape:
        return float("inf"), float("inf"), 0.0
    diff = (a - b).abs()
    if diff.numel() == 0:
        return 0.0, 0.0, 0.0
    nonfinite_mismatch = (a.isnan() != b.isnan()) | (a.isinf() != b.isinf())
    if bool(nonfinite_mismatch.any()):
        return float("inf"), float("inf"), 0.0
    diff = torch.where(a.isnan() & b.isnan(), torch.zeros_like(diff), diff)
    abs_err = float(diff.max())
    scale = float(b.abs().nan_to_num(posinf=0.0, neginf=0.0).max())
    rel_err = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))
    return abs_err, rel_err, scale


# Metrics compared when both steps report them: a padding or scaling bug shows in the norm.
COMPARED_METRICS = ("loss", "grad_norm")


def record_history(step: Any, state: Any, batches: Sequence[Any]) -> list[tuple[dict[str, Any], Any]]:
    """Run ``step`` from ``state`` over ``batches``; after each, the compared metrics and the full
    parameters (a collective for sharded steps: call it on every rank)."""
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        scalars = {k: metrics[k].detach().clone() for k in COMPARED_METRICS if k in metrics}
        history.append((scalars, optree.tree_map(lambda t: t.detach().clone(), step.full_params(state))))
    return history


def _rank_program(step: Any, params: Any, mesh: Mesh, batches: Sequence[Any]) -> list[tuple[dict[str, Any], Any]]:
    return record_history(step, step.init(params, mesh), batches)


def _param_dtype(params: Any) -> torch.dtype:
    leaves = [t for t in optree.tree_leaves(params) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return leaves[0].dtype if leaves else torch.float32


def assert_equivalent(
    step: Any,
    reference: Any,
    mesh: Mesh,
    batches: Sequence[Any],
    params: Any,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    backend: str = "threads",
    timeout: float = 120.0,
) -> EquivalenceReport:
    """Run ``len(batches)`` steps of ``step`` on ``mesh`` and of ``reference`` on one device; compare.

    Every rank gets the same global batches and the same full ``params``; the
    distributed step decides what each rank computes. After every step the
    loss and the gradient norm (each when both steps report it: see
    ``Step.with_metrics``) and the full parameters (``step.full_params``) of
    every rank must match the reference within ``atol + rtol * max|reference|``
    per tensor.
    ``rtol`` defaults by dtype (see ``DEFAULT_RTOL``). With
    ``backend="processes"`` the step, params and batches must be picklable.

    >>> import torch, shardwise as sw
    >>> chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(3, 2)).double())
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1))
    >>> batches = [(torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))] * 2
    >>> print(sw.testing.assert_equivalent(step, step, sw.Mesh(dp=2), batches, params))
    equivalent over 2 steps; worst relative error 0
    """
    if not batches:
        raise ValueError("assert_equivalent needs at least one batch")
    rtol = DEFAULT_RTOL.get(_param_dtype(params), 1e-5) if rtol is None else rtol
    expected = record_history(reference, reference.init(params), batches)
    program = functools.partial(_rank_program, step, params, mesh, list(batches))
    per_rank = launch(program, mesh.size, backend=backend, timeout=timeout)

    return compare_histories(per_rank, expected, rtol=rtol, atol=atol)


def compare_histories(
    per_rank: Sequence[Sequence[tuple[dict[str, Any], Any]]],
    expected: Sequence[tuple[dict[str, Any], Any]],
    *,
    rtol: float,
    atol: float = 0.0,
) -> EquivalenceReport:
    """Check every rank's ``record_history`` against the reference's; raise at the first divergence.

    Useful where ``assert_equivalent`` cannot launch the ranks itself (a step
    built inside each process of a pool): record on every rank, compare here.
    """
    report = EquivalenceReport(steps=len(expected))
    for index, (exp_metrics, exp_params) in enumerate(expected):
        worst_abs = worst_rel = 0.0
        for rank, history in enumerate(per_rank):
            got_metrics, got_params = history[index]
            checks = [(k, got_metrics[k], v) for k, v in exp_metrics.items() if k in got_metrics]
            exp_paths, exp_leaves, exp_spec = optree.tree_flatten_with_path(exp_params)
            got_leaves, got_spec = optree.tree_flatten(got_params)
            if got_spec != exp_spec:
                raise NotEquivalentError(
                    f"step {index + 1}, rank {rank}: parameter structure differs from the reference:\n"
                    f"  got      {got_spec}\n  expected {exp_spec}",
                    index + 1, "<structure>", rank, float("inf"), float("inf"),
                )
            checks += [
                ("params" + "".join(f"[{k!r}]" for k in path), g, e)
                for path, g, e in zip(exp_paths, got_leaves, exp_leaves, strict=True)
            ]
            for path, got, exp in checks:
                abs_err, rel_err, scale = _errors(got, exp)
                worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
                if not abs_err <= atol + rtol * scale:
                    raise NotEquivalentError(
                        f"not equivalent: first divergence at step {index + 1}, {path}, rank {rank}: "
                        f"max abs error {abs_err:.3g}, relative error {rel_err:.3g} "
                        f"(allowed: atol={atol:g} + rtol={rtol:g} x max|reference| {scale:.3g})",
                        index + 1, path, rank, abs_err, rel_err,
                    )
        report.max_abs_err.append(worst_abs)
        report.max_rel_err.append(worst_rel)
    return report
