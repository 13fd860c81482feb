"""``shardwise plan FILE:FUNCTION --mesh ...``: what every rank of a step will do, hold and send."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from ..collectives.mesh import Mesh
from ..engine.plan.actions import INSIDE, Action, Plan
from ..engine.simulate.simulation import simulate as simulate_plan
from ..testing.plan_check import measure, ranks_off_plan
from ..transforms.pipeline import ascii_timeline
from .arguments import UsageError, call_for, load_function, parse_mesh, positive_seconds

HELP = "print the per-rank Plan of a step: actions, memory, communication"
CONTRACT = ("step", "params", "batch")
DESCRIPTION = """\
Print the Plan of a training step on a mesh: every rank's actions in order, the
bytes each rank holds (parameters, gradients, optimizer state, activations kept
for backward), and what it communicates.

FILE:FUNCTION names a function of no arguments in a Python file that returns
(step, params, batch): a step built with shardwise (sw.train_step and any
transforms), its full parameters and one global batch, e.g.

    def make():
        chain, params = sw.functionalize(model)
        step = sw.shard_params(sw.train_step(chain, loss_fn, sw.optim.sgd(0.1)), "dp", stage=3)
        return step, params, (inputs, targets)

    shardwise plan train.py:make --mesh dp=2
"""


def mesh_argument(text: str) -> Mesh:
    """``--mesh`` for argparse: a bad mesh is a usage error with its reason."""
    try:
        return parse_mesh(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_parser(verbs: Any) -> None:
    parser = verbs.add_parser("plan", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar="FILE:FUNCTION", help="a function returning (step, params, batch)")
    parser.add_argument("--mesh", type=mesh_argument, required=True, help="mesh axes and sizes, e.g. dp=2,pp=2")
    parser.add_argument("--simulate", action="store_true", help="also print a simulated timeline of the whole step")
    parser.add_argument("--measure", action="store_true",
                        help="also run one step on threads, print the collectives it issued (per axis and op; "
                             "init's are not counted) and whether each rank's equal the Plan's")
    parser.add_argument("--timeout", type=positive_seconds, default=120.0,
                        help="with --measure: seconds any collective may wait (default 120)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, out: Any) -> int:
    step, params, batch = call_for(args.target, load_function(args.target), CONTRACT)
    mesh: Mesh = args.mesh
    plan = step.plan(mesh, params, batch)
    if not isinstance(plan, Plan):
        raise UsageError(f"{args.target}: step.plan returned a {type(plan).__name__}, not a shardwise Plan")
    data: dict[str, Any] = {"mesh": mesh.shape, **plan_data(plan)}
    # The Plan's text already lists its bytes per axis and op (Plan.comm_bytes).
    data["comm_bytes"] = {f"{axis}/{op}": list(per_rank) for (axis, op), per_rank in plan.comm_bytes().items()}
    text = [str(plan), "", action_table(plan)]
    if args.simulate:
        data["simulation"], simulated = simulation(plan)
        text += ["", simulated]
    if args.measure:
        ledger = measure(step, params, batch, mesh, args.timeout)
        data["measured"] = {f"{axis}/{op}": vars(s) for (axis, op), s in ledger.summary().items()}
        differ = ranks_off_plan(plan, ledger)
        data["ledger_equals_plan"] = not differ
        verdict = ("every rank issued exactly the collectives its Plan lists" if not differ
                   else f"ranks {differ} did not issue the collectives their Plan lists")
        text += ["", "collectives measured over one step on threads (the communication ledger; init's not "
                 "counted):", str(ledger), verdict]
    out.emit(data, text="\n".join(text))
    return 0


def plan_data(plan: Plan) -> dict[str, Any]:
    """The Plan as JSON-ready data: each rank's coordinates and actions, the memory figures."""
    return {
        "ranks": [
            {"rank": rank, "coords": plan.mesh.coords_of(rank), "actions": [str(a) for a in actions]}
            for rank, actions in enumerate(plan.actions)
        ],
        "memory": {key: list(per_rank) for key, per_rank in plan.memory.items()},
    }


def action_table(plan: Plan) -> str:
    """How many actions of each kind each rank performs: the communicating ones stand out (a collective
    a layer issues inside its compute by its op: ``inside psum``)."""

    def kind(a: Action) -> str:
        return f"{a.kind} {a.op}" if a.kind == INSIDE else a.kind

    kinds = sorted({kind(a) for actions in plan.actions for a in actions})
    counts = [Counter(kind(a) for a in actions) for actions in plan.actions]
    width = max(len(k) for k in kinds) if kinds else 0
    lines = ["actions per rank: " + " ".join(f"{r:>4}" for r in range(plan.mesh.size))]
    lines += [f"  {k:<{width}}  " + " ".join(f"{c[k]:>4}" for c in counts) for k in kinds]
    return "\n".join(lines)


def simulation(plan: Plan) -> tuple[dict[str, Any], str]:
    """The whole Plan simulated (computes, transfers and collectives under the default costs)."""
    timeline = simulate_plan(plan)
    data = {"makespan": timeline.makespan, "bubble_fraction": timeline.bubble_fraction,
            "summary": timeline.summary()}
    return data, f"simulated step (default costs; sw.plan.PlanCosts fits your own):\n{ascii_timeline(timeline)}"
