"""Is my distributed step the same computation as my single-device step?

:func:`assert_equivalent` runs several steps of both on the same global
batches and compares the loss and every parameter after every step, on every
rank. On failure it reports the first divergence: the step, the parameter
path, the rank, the largest absolute and relative error.

How a tensor is judged (the default is scale-aware). Each tensor must satisfy

    max|a - b|  <=  atol + rtol * scale,   scale = max|b| over the tensor's layer

where ``b`` is the reference and "the tensor's layer" is the innermost
container holding it in the params pytree (``params[layer]``: for a Chain, one
layer's parameters; a metric is its own layer). This is a norm-wise test
(infinity norm) per layer rather than per element or per tensor, because
rounding errors are relative to the magnitudes a value is computed from, not
to the value itself. An element-wise relative error is noise for entries near
zero; a per-tensor one is noise for a tensor whose true value is zero: BERT's
attention key bias has an exactly zero gradient (softmax ignores a shift of all
scores of a query), so it moves only by rounding residue of the other
gradients, ~1e-22 in float64, and two correct summation orders give residues
that differ by 30-70 % of themselves. Against the scale of the layer those
residues are 1e-22, as they should be, while a real bug (a learning rate off
by a factor, a layer whose gradient is dropped, a shard summed twice) moves a
layer's parameters by the size of an update, far above ``rtol`` of the layer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from torch import nn

from ..collectives.launch import launch
from ..collectives.mesh import Mesh
from ..engine.layout.in_flight import InFlightParams
from ..engine.model.whole_batch import called_modules
from .coarse_compute import coarser_compute

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


def _refuse_nan_reference(expected: Sequence[tuple[dict[str, Any], Any]]) -> None:
    """Refuse a reference whose loss or parameters are NaN at some step: a distributed step NaN there too would
    match it (NaN equals NaN below), and a NaN matched certifies nothing (HF eager attention over a row that
    masks every key). (Not the gradient norm: a loss-scaled step that skips an overflow reports it non-finite.)"""
    for index, (metrics, params) in enumerate(expected):
        named = [*((k, v) for k, v in metrics.items() if k == "loss"),
                 *(("params" + "".join(f"[{k!r}]" for k in path), leaf) for path, leaf in
                   zip(*optree.tree_flatten_with_path(params)[:2], strict=True))]
        for where, value in named:
            if isinstance(value, torch.Tensor) and value.is_floating_point() and bool(value.isnan().any()):
                raise ValueError(
                    f"the reference step's {where} is NaN at step {index + 1}: there is nothing to compare the "
                    "distributed step with (a NaN would match a NaN); make the single-device step finite first "
                    "(a row whose attention masks every key gives NaN in eager attention, float16 may overflow), "
                    "then check again"
                )


def _abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - b|``; infinite for a shape or NaN / inf pattern that differs.

    NaN equals NaN and an infinity equals the same infinity (``inf - inf`` is NaN, which would
    otherwise make the error NaN: no tolerance rejects a NaN error, none accepts it either).
    """
    if actual.is_complex() != expected.is_complex():
        return float("inf")
    a, b = _real_f64(actual), _real_f64(expected)
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    both_nan = a.isnan() & b.isnan()
    same_inf = a.isinf() & (a == b)
    nonfinite_mismatch = (a.isnan() != b.isnan()) | ((a.isinf() | b.isinf()) & ~same_inf)
    if bool(nonfinite_mismatch.any()):
        return float("inf")
    diff = torch.where(both_nan | same_inf, torch.zeros_like(a), (a - b).abs())
    return float(diff.max())


def _real_f64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, a complex tensor as its real view (its real and imaginary parts each compared: a cast
    to float64 would drop the imaginary part)."""
    t = t.detach()
    return torch.view_as_real(t.to(torch.complex128)) if t.is_complex() else t.to(torch.float64)


def _magnitude(t: torch.Tensor) -> float:
    """``max|t|`` over its finite entries (0 for an empty tensor; a complex tensor's parts)."""
    if t.numel() == 0:
        return 0.0
    return float(_real_f64(t).abs().nan_to_num(posinf=0.0, neginf=0.0).max())


def _relative(abs_err: float, scale: float) -> float:
    return abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))


# Metrics compared when both steps report them: a padding or scaling bug shows in the norm.
COMPARED_METRICS = ("loss", "grad_norm")


def record_history(step: Any, state: Any, batches: Sequence[Any]) -> list[tuple[dict[str, Any], Any]]:
    """Run ``step`` from ``state`` over ``batches``; after each, the compared metrics and the full
    parameters (a collective for sharded steps: call it on every rank)."""
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        scalars = {k: metrics[k].detach().clone() for k in COMPARED_METRICS if k in metrics}
        history.append((scalars, optree.tree_map(lambda t: t.detach().clone(), step.full_params(_as_stepped(state)))))
    return history


def _as_stepped(state: Any) -> Any:
    """``state`` whose parameters still in flight (ZeRO-1/2 with ``overlap_gather``) are read as the
    next step reads them: a user's read would make that step cut its shards again from what was read,
    and the checker would certify that path instead of the carried shards a run without reads takes.
    (What is read here is cloned at once and never written.)"""
    params = getattr(state, "params", None)
    if isinstance(params, InFlightParams):
        return state._replace(params=dict(params.settle()))
    return state


def _rank_program(step: Any, params: Any, mesh: Mesh, batches: Sequence[Any]) -> list[tuple[dict[str, Any], Any]]:
    return record_history(step, step.init(params, mesh), batches)


def _metric_rtol(expected: torch.Tensor, rtol: float, at_its_dtype: bool) -> float:
    """The tolerance a metric is judged at: ``rtol``, or with ``at_its_dtype`` the coarser of that and
    its own dtype's default (a float32 loss of a float64 model carries float32 rounding whatever the
    parameters' precision)."""
    return max(rtol, _metric_rounding(expected.dtype)) if at_its_dtype else rtol


def _metric_rounding(dtype: torch.dtype) -> float:
    """What a sum over parts instead of one sum may move a metric in ``dtype`` by: a few units in the last
    place (8 eps: 9.5e-7 for float32), not the dtype's whole default, so that an error of the metric alone
    (a loss weighted otherwise while the parameters are right) still shows above it."""
    if not dtype.is_floating_point:
        return 0.0
    return min(DEFAULT_RTOL.get(dtype, 1.0), 8 * torch.finfo(dtype).eps)


def _coarser_dtype_hint(where: str, expected: Any, rtol: float) -> str:
    """A note on a metric in a dtype whose rounding alone exceeds the tolerance it was judged at."""
    dtype = getattr(expected, "dtype", None)
    own = _metric_rounding(dtype) if isinstance(dtype, torch.dtype) else None
    if where not in COMPARED_METRICS or not own or own <= rtol:
        return ""
    return (f"; the reference's {where} is {dtype}, whose rounding alone is about {own:g} of it: "
            "leave rtol unset to judge the metrics at their own dtype (the parameters keep theirs), or "
            f"compute the {where} in the parameters' dtype")


def _random_draws(step: Any) -> list[str]:
    """Where ``step``'s model draws random numbers in training, as far as its modules say: a dropout module in
    training mode with p > 0; a module's own float ``*dropout`` / ``*pdrop`` / ``drop_prob`` above 0 (the rate a
    Hugging Face attention hands its functional dropout: ``self.attention_dropout``; a DropPath's stochastic
    depth). Not a config's: a config lists rates of heads the model may not have (GPT-2's
    ``summary_first_dropout``, for its double-heads model alone); SpecAugment's only where the module holds its
    mask embedding (``masked_spec_embed``, which Wav2Vec2 and its kin make for it)."""
    chain = getattr(step, "base_chain", None)
    if chain is None:
        return []
    found: dict[str, None] = {}
    for path, module in called_modules(chain):
        if not module.training:
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found[f"{type(module).__name__}(p={module.p:g}) at {path}"] = None
        for key, value in vars(module).items():
            if (key.endswith("dropout") or key.endswith("pdrop") or key == "drop_prob") and type(value) is float \
                    and value > 0:  # (drop_prob: stochastic depth, a DropPath's: Swin's, BEiT's, ConvNeXt's, timm's)
                found[f"{type(module).__name__}.{key}={value:g} at {path}"] = None
        config = getattr(module, "config", None)
        if "masked_spec_embed" in module._parameters:  # SpecAugment (Wav2Vec2 and kin): masks drawn in training
            for key in ("mask_time_prob", "mask_feature_prob"):
                rate = getattr(config, key, 0)
                if isinstance(rate, (int, float)) and rate > 0:
                    found[f"SpecAugment {type(module).__name__}.config.{key}={rate:g} at {path}"] = None
    return list(found)


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
    every rank must match the reference within ``atol + rtol * max|reference|``,
    the largest reference magnitude of the tensor's layer (see the module
    docstring: a tensor whose reference is rounding noise, such as a bias whose
    true gradient is zero, is not a failure, and a wrong update still is).
    ``rtol`` defaults by dtype (see ``DEFAULT_RTOL``): the parameters' for the
    parameters, and for the loss and the gradient norm the coarser of that and
    a few units in the last place of their own dtype (8 eps; a float64 model's loss computed in float32, as
    transformers computes its ``labels=`` loss, differs between a sum over
    parts and one sum by float32 rounding alone; the parameters still show a
    real error at their own tolerance). An ``rtol`` given applies to every
    tensor. With ``backend="processes"`` the step, params and batches must be picklable.

    >>> import torch, shardwise as sw
    >>> chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(3, 2)).double())
    >>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1))
    >>> batches = [(torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))] * 2
    >>> print(sw.testing.assert_equivalent(step, step, sw.Mesh(dp=2), batches, params))
    equivalent over 2 steps; worst relative error 0
    """
    if not batches:
        raise ValueError("assert_equivalent needs at least one batch")
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"assert_equivalent(mesh=...) needs the Mesh the step runs on, got {type(mesh).__name__}; a transform "
            "of one device (remat, mixed_precision alone) runs on sw.Mesh(dp=1)"
        )
    check_reference(reference)
    rtol_given = rtol
    rtol = DEFAULT_RTOL.get(_param_dtype(params), 1e-5) if rtol is None else rtol
    program = functools.partial(_rank_program, step, params, mesh, list(batches))
    # The distributed step first: where it and the reference share a model (shard_params(step) against step),
    # the reference's first call would set state its forward keeps (a lazy initialization) in the module the
    # ranks' copies are made of, and they would not set it from their shares, as a run of the step alone does.
    per_rank = launch(program, mesh.size, backend=backend, timeout=timeout)
    expected = record_history(reference, reference.init(params), batches)

    try:
        return compare_histories(per_rank, expected, rtol=rtol, atol=atol, metrics_at_their_dtype=rtol_given is None)
    except NotEquivalentError as err:
        raise explained(err, reference, params, batches[0], rtol) from None


def check_reference(reference: Any) -> None:
    """Refuse a reference that runs a parallel transform: it is the single-device step (its ``init`` would say
    it needs the mesh, which the caller never passes)."""
    parallel = [str(spec) for spec in getattr(reference, "parallel_transforms", ())]
    if parallel:
        raise ValueError(
            f"assert_equivalent(step, reference, ...): the reference is the single-device step, but it runs "
            f"{', '.join(parallel)}, which needs a mesh. Pass the step before its parallel transforms as the "
            "reference (the distributed step comes first: were they swapped?)"
        )


def explained(err: NotEquivalentError, reference: Any, params: Any = None, batch: Any = None,
              rtol: float | None = None) -> NotEquivalentError:
    """``err``, naming where the reference's model draws random numbers in training, if it does; else, for an error
    of about a coarser dtype's rounding, where the model computes in that dtype on ``batch`` (``coarse_compute.py``)."""
    drawn = _random_draws(reference)
    if drawn:
        note = (
            f"the model draws random numbers in training ({', '.join(drawn[:4])}): a distributed step draws "
            "its masks per rank and micro-batch, not as one device does, so it cannot equal it step for step; set "
            "them to 0 (or the module to eval mode) to check equivalence"
        )
    elif (coarse := coarser_compute(reference, params, batch)) is None:
        return err
    else:
        layer, op, dtype = coarse
        own = DEFAULT_RTOL.get(dtype, 1e-5)
        if (rtol is not None and rtol >= own) or err.rel_err > min(10 * own, 1e-2):
            return err  # judged at that dtype's tolerance already, or far above its rounding: not explained by it
        note = (
            f"the model computes in {dtype} inside (an {op} to {dtype} of values computed from the parameters or "
            f"the batch in layer {layer!r}, such as an RMSNorm's x.float() in a float64 model): a sum over the "
            "whole batch and a sum over its parts (ranks, micro-batches) round apart at that precision, not the "
            "parameters', and an update carries it on (Adam scales a small gradient up); an error of this size may "
            f"be that rounding: judge at {dtype}'s tolerance (rtol={own:g}), where a real error still shows"
        )
    return NotEquivalentError(f"{err}; {note}", err.step, err.path, err.rank, err.abs_err, err.rel_err)


def compare_histories(
    per_rank: Sequence[Sequence[tuple[dict[str, Any], Any]]],
    expected: Sequence[tuple[dict[str, Any], Any]],
    *,
    rtol: float,
    atol: float = 0.0,
    metrics_at_their_dtype: bool = False,
) -> EquivalenceReport:
    """Check every rank's ``record_history`` against the reference's; raise at the first divergence.

    Useful where ``assert_equivalent`` cannot launch the ranks itself (a step
    built inside each process of a pool): record on every rank, compare here.
    With ``metrics_at_their_dtype`` the loss and the gradient norm are judged
    at the coarser of ``rtol`` and 8 eps of their own dtype.
    """
    report = EquivalenceReport(steps=len(expected))
    _refuse_nan_reference(expected)
    for index, (exp_metrics, exp_params) in enumerate(expected):
        worst_abs = worst_rel = 0.0
        for rank, history in enumerate(per_rank):
            got_metrics, got_params = history[index]
            exp_paths, exp_leaves, exp_spec = optree.tree_flatten_with_path(exp_params)
            got_leaves, got_spec = optree.tree_flatten(got_params)
            if got_spec != exp_spec:
                raise NotEquivalentError(
                    f"step {index + 1}, rank {rank}: parameter structure differs from the reference:\n"
                    f"  got      {got_spec}\n  expected {exp_spec}",
                    index + 1, "<structure>", rank, float("inf"), float("inf"),
                )
            # Every tensor is judged against the largest reference magnitude of its layer
            # (the module docstring says why).
            layer_scale: dict[tuple[Any, ...], float] = {}
            for path, e in zip(exp_paths, exp_leaves, strict=True):
                layer_scale[path[:-1]] = max(layer_scale.get(path[:-1], 0.0), _magnitude(e))
            # (where, got, expected, scale, whose scale, rtol)
            checks: list[tuple[str, Any, Any, float, str, float]] = [
                (k, got_metrics[k], v, _magnitude(v), k, _metric_rtol(v, rtol, metrics_at_their_dtype))
                for k, v in exp_metrics.items() if k in got_metrics
            ]
            checks += [
                ("params" + "".join(f"[{k!r}]" for k in path), g, e, layer_scale[path[:-1]],
                 "params" + "".join(f"[{k!r}]" for k in path[:-1]), rtol)
                for path, g, e in zip(exp_paths, got_leaves, exp_leaves, strict=True)
            ]
            for where, got, exp, scale, layer, tol in checks:
                # (dtypes may differ on purpose: a pure-bf16 step judged against its float32 reference)
                if where.startswith("params") and isinstance(got, torch.Tensor) and isinstance(exp, torch.Tensor) \
                        and got.shape != exp.shape:
                    raise NotEquivalentError(
                        f"not equivalent: at step {index + 1}, {where}, rank {rank}: the step gives a "
                        f"{got.dtype} tensor of shape {list(got.shape)}, the reference a {exp.dtype} tensor of shape "
                        f"{list(exp.shape)} (a piece not gathered back?)",
                        index + 1, where, rank, float("inf"), float("inf"),
                    )
                abs_err = _abs_error(got, exp)
                rel_err = _relative(abs_err, scale)
                worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
                if not abs_err <= atol + tol * scale:
                    raise NotEquivalentError(
                        f"not equivalent: first divergence at step {index + 1}, {where}, rank {rank}: "
                        f"max abs error {abs_err:.3g}, relative error {rel_err:.3g} "
                        f"(allowed: atol={atol:g} + rtol={tol:g} x max|reference| of {layer} {scale:.3g})"
                        + _coarser_dtype_hint(where, exp, tol),
                        index + 1, where, rank, abs_err, rel_err,
                    )
        report.max_abs_err.append(worst_abs)
        report.max_rel_err.append(worst_rel)
    return report
