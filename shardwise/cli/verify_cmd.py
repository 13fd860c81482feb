"""``shardwise verify FILE:FUNCTION --mesh ...``: is the distributed step the single-device step?"""

from __future__ import annotations

import argparse
from typing import Any

import optree
import torch

from ..collectives.launch import RankFailed, launch
from ..collectives.mesh import Mesh
from ..testing.equivalence import (
    DEFAULT_RTOL,
    EquivalenceReport,
    NotEquivalentError,
    assert_equivalent,
    check_reference,
    compare_histories,
    explained,
    record_history,
)
from .arguments import call_for, load_function, positive_seconds, tolerance
from .plan_cmd import mesh_argument
from .report import CommandFailed

HELP = "run a step and its single-device reference side by side; exit 1 if they diverge"
CONTRACT = ("step", "reference", "params", "batches")
DESCRIPTION = """\
Run sw.testing.assert_equivalent: several steps of a distributed step on the mesh
and of its single-device reference on the same global batches, comparing the loss,
the gradient norm and every parameter on every rank after every step. Exits 0 when
they agree, 1 at the first divergence (the step, parameter, rank and errors).

FILE:FUNCTION names a function of no arguments in a Python file that returns
(step, reference, params, batches): the distributed step, the single-device step
it must equal (the same train_step before the transforms, with the same
precision policy if any), the full parameters and a list of global batches, e.g.

    def make():
        torch.manual_seed(0)
        chain, params = sw.functionalize(model.double())
        reference = sw.train_step(chain, loss_fn, sw.optim.sgd(0.1, momentum=0.9))
        step = sw.shard_params(reference, "dp", stage=3)
        return step, reference, params, [(x, y), (x2, y2)]

    shardwise verify train.py:make --mesh dp=2

With --backend processes the ranks are local gloo processes, and each of them
imports FILE and calls FUNCTION itself (steps hold closures, which do not
pickle): FUNCTION must then build the same params and batches every time (seed
it); a rank that built different ones is reported.
"""


def add_parser(verbs: Any) -> None:
    parser = verbs.add_parser("verify", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar="FILE:FUNCTION",
                        help="a function returning (step, reference, params, batches)")
    parser.add_argument("--mesh", type=mesh_argument, required=True, help="mesh axes and sizes, e.g. dp=2,pp=2")
    parser.add_argument("--backend", choices=("threads", "processes"), default="threads",
                        help="ranks as threads of this process (default) or as local gloo processes")
    parser.add_argument("--rtol", type=tolerance, help="relative tolerance, 0 or more (default: by parameter dtype)")
    parser.add_argument("--atol", type=tolerance, default=0.0, help="absolute tolerance, 0 or more (default 0)")
    parser.add_argument("--timeout", type=positive_seconds, default=120.0,
                        help="seconds any collective may wait (default 120)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, out: Any) -> int:
    step, reference, params, batches = call_for(args.target, load_function(args.target), CONTRACT)
    batches = list(batches)
    setting = {"mesh": args.mesh.shape, "backend": args.backend, "steps": len(batches)}
    try:
        if args.backend == "threads":
            report = assert_equivalent(step, reference, args.mesh, batches, params, rtol=args.rtol,
                                       atol=args.atol, timeout=args.timeout)
        else:
            report = _verify_on_processes(args, reference, params, batches)
    except NotEquivalentError as err:
        raise CommandFailed(str(err), {**setting, "equivalent": False, "step": err.step, "path": err.path,
                                       "rank": err.rank, "abs_err": err.abs_err, "rel_err": err.rel_err}) from None
    except RankFailed as err:
        raise CommandFailed(str(err), {**setting, "equivalent": None, "rank": err.rank}) from err
    per_step = "\n".join(
        f"  step {i}: max abs error {a:.3g}, max relative error {r:.3g}"
        for i, (a, r) in enumerate(zip(report.max_abs_err, report.max_rel_err, strict=True), start=1)
    )
    out.emit(
        {**setting, "equivalent": True, "max_abs_err": report.max_abs_err, "max_rel_err": report.max_rel_err},
        text=f"{report} on {args.mesh!r} ({args.backend})\n{per_step}",
    )
    return 0


def _verify_on_processes(
    args: argparse.Namespace, reference: Any, params: Any, batches: list[Any]
) -> EquivalenceReport:
    """``assert_equivalent`` with every rank process building the step from FILE:FUNCTION itself."""
    check_reference(reference)
    expected = record_history(reference, reference.init(params), batches)
    per_rank = launch(_rank_history, args.mesh.size, backend="processes", timeout=args.timeout,
                      args=(args.target, args.mesh))
    for rank, (built_params, built_batches, _) in enumerate(per_rank):
        if not (_same(built_params, params) and _same(built_batches, batches)):
            raise CommandFailed(
                f"{args.target} built different params or batches on rank {rank} than in this process: "
                f"with --backend processes every rank calls it, so it must be deterministic (seed it)"
            )
    rtol = _default_rtol(params) if args.rtol is None else args.rtol
    try:  # (judged as assert_equivalent judges: the metrics at their own dtype where no rtol was given)
        return compare_histories([history for *_, history in per_rank], expected, rtol=rtol, atol=args.atol,
                                 metrics_at_their_dtype=args.rtol is None)
    except NotEquivalentError as err:
        raise explained(err, reference, params, batches[0], rtol) from None


def _rank_history(target: str, mesh: Mesh) -> tuple[Any, Any, Any]:
    """On one rank process: build the user's step, run it; return what it was built from and its history."""
    step, _, params, batches = call_for(target, load_function(target), CONTRACT)
    return params, list(batches), record_history(step, step.init(params, mesh), list(batches))


def _same(a: Any, b: Any) -> bool:
    """Whether two builds made the same trees: tensors equal element for element, a NaN where the other has one
    (a batch of tabular features with missing values; NaN equals nothing, not even a NaN)."""
    leaves_a, spec_a = optree.tree_flatten(a)
    leaves_b, spec_b = optree.tree_flatten(b)
    return spec_a == spec_b and all(
        _same_tensor(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    if torch.equal(x, y):
        return True
    if x.shape != y.shape or x.dtype != y.dtype or not (x.is_floating_point() or x.is_complex()):
        return False
    return bool(((x == y) | (x.isnan() & y.isnan())).all())


def _default_rtol(params: Any) -> float:
    """The tolerance ``assert_equivalent`` picks: by the dtype of the first floating parameter."""
    floating = [t for t in optree.tree_leaves(params) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return DEFAULT_RTOL.get(floating[0].dtype if floating else torch.float32, 1e-5)
