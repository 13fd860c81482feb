"""``shardwise checkpoint inspect PATH``: what a checkpoint holds, per rank and per leaf."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..engine.checkpoint.file_format import CheckpointError
from ..engine.checkpoint.save_load import describe
from .report import CommandFailed, Output

HELP = "look inside a shardwise checkpoint"
DESCRIPTION = """\
inspect PATH prints a checkpoint's step count, loss scale, the mesh and transform stack
that wrote it, every parameter with its global shape, dtype and shard spec, and per rank
its file, bytes and the tensors it holds (--records: every saved box). A directory that
is not a committed checkpoint (missing, partial, corrupt) exits 1 with what is wrong.
"""


def add_parser(verbs: Any) -> None:
    parser = verbs.add_parser("checkpoint", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = actions.add_parser("inspect", help="what is in a checkpoint, per rank and leaf", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    inspect.add_argument("path", metavar="PATH", type=Path, help="the checkpoint directory")
    inspect.add_argument("--records", action="store_true", help="list every saved box of every rank")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    inspect.set_defaults(run=run)


def run(args: argparse.Namespace, out: Output) -> int:
    try:
        report = describe(args.path)
    except CheckpointError as err:
        raise CommandFailed(str(err), {"path": str(args.path)}) from None
    if not args.records:
        for rank in report["ranks"]:
            rank.pop("records")
    out.emit(report, _text(report, args.records))
    return 0


def _text(report: dict[str, Any], records: bool) -> str:
    scale = report["loss_scale"]
    mesh = report["mesh"] or "one device"
    lines = [
        f"{report['path']}: step {report['step']}, {report['world']} rank(s) on mesh {mesh}",
        f"stack: {' > '.join(report['stack']) or '(single-device step)'}",
        f"loss scale: {scale['type'] + str(scale['fields']) if scale else 'none'}",
        f"optimizer state: per parameter {report['optimizer']['mirrors']}, shared {report['optimizer']['scalars']}",
        "",
        "leaves:",
        *(f"  {line}" for line in report["leaves"].values()),
    ]
    if report["aliases"]:
        lines.append("tied names: " + ", ".join(f"{a} = {k}" for a, k in report["aliases"].items()))
    lines.append("")
    for rank in report["ranks"]:
        lines.append(f"rank {rank['rank']}: {rank['file']}, {rank['bytes']} bytes, {len(rank['tensors'])} tensors")
        for r in rank.get("records", []) if records else []:
            lines.append(f"  {r['tensor']} at {r['offsets']} size {r['sizes']} ({r['bytes']} bytes)")
    return "\n".join(lines)
