"""``shardwise schedule``: a built-in or hand-written pipeline schedule, checked, simulated, drawn."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..transforms.pipeline import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    ascii_timeline,
    gantt,
    get_schedule,
    simulate,
    validate,
    write_chrome_trace,
)
from .arguments import UsageError, check_output_file
from .report import CommandFailed, Output

HELP = "print a pipeline schedule, its simulated bubble and activation peaks; draw it"
DESCRIPTION = f"""\
Print a pipeline schedule (one line of actions per rank), its simulated timeline,
bubble and peak activations per rank (costs F=1, B=2, I=W=1 units), and draw it.

SCHEDULE is a built-in name ({", ".join(sorted(SCHEDULES))}) or a file in the
schedule text form, one line per rank, for example:

    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1B0 1F1 1B1

A file is validated with the library's own rules (shardwise.transforms.pipeline.validate);
an invalid one exits 1 with the rule it breaks.
"""


def add_parser(verbs: Any) -> None:
    parser = verbs.add_parser("schedule", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("schedule", metavar="SCHEDULE", help="a built-in name or a schedule text file")
    parser.add_argument("--ranks", type=_positive, help="pipeline ranks (required for a built-in name)")
    parser.add_argument("--microbatches", type=_positive, help="microbatches per step (required for a name)")
    parser.add_argument("--stages", type=_positive,
                        help="pipeline stages (default: --ranks, or 2 x --ranks for zb_v)")
    parser.add_argument("--png", type=Path, metavar="FILE", help="draw a Gantt chart to FILE (needs matplotlib)")
    parser.add_argument("--svg", type=Path, metavar="FILE", help="draw a Gantt chart to FILE (needs matplotlib)")
    parser.add_argument("--trace", type=Path, metavar="FILE",
                        help="write a Chrome/Perfetto trace (JSON) to FILE")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def load_schedule(args: argparse.Namespace) -> Schedule:
    """The schedule named or written in ``args.schedule``, validated; shape flags must agree with a file."""
    key = args.schedule.strip().lower().replace("-", "_")
    if key in SCHEDULES:
        missing = [flag for flag in ("ranks", "microbatches") if getattr(args, flag) is None]
        if missing:
            raise UsageError(f"schedule {args.schedule!r} needs " + " and ".join(f"--{m}" for m in missing))
        stages = args.stages or (2 * args.ranks if key == "zb_v" else args.ranks)
        try:
            return get_schedule(key, args.ranks, stages, args.microbatches)
        except ValueError as err:  # a shape the built-in cannot take: the flags are wrong
            raise UsageError(str(err)) from None
    path = Path(args.schedule)
    if not path.is_file():
        raise UsageError(
            f"{args.schedule!r} is neither a built-in schedule ({', '.join(sorted(SCHEDULES))}) nor a file"
        )
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise UsageError(f"schedule file {str(path)!r} is not text (UTF-8: {err.reason} at byte {err.start}); "
                         "a schedule file holds one line of actions per rank, as `shardwise schedule NAME` "
                         "prints them") from None
    try:
        schedule = Schedule.parse(text, name=path.stem)
        validate(schedule)
    except ScheduleError as err:
        raise CommandFailed(f"schedule {str(path)!r} is invalid: {err}") from None
    for flag, found in (("ranks", schedule.num_ranks), ("stages", schedule.num_stages),
                        ("microbatches", schedule.microbatches)):
        wanted = getattr(args, flag)
        if wanted is not None and wanted != found:
            raise CommandFailed(f"schedule {str(path)!r} has {flag}={found}, but --{flag} {wanted} was given")
    return schedule


def run(args: argparse.Namespace, out: Output) -> int:
    for flag, example in (("png", "schedule.png"), ("svg", "schedule.svg"), ("trace", "trace.json")):
        target = getattr(args, flag)
        if target is not None:  # (refused before the work: a trace of thousands of ranks takes a while)
            if flag != "trace" and target.suffix.lower() != f".{flag}":
                raise UsageError(f"--{flag} {str(target)!r}: the file name must end in .{flag}")
            check_output_file(f"--{flag}", target, example)
    schedule = load_schedule(args)
    timeline = simulate(schedule)
    drawn: dict[str, str] = {}
    for kind in ("png", "svg"):
        target = getattr(args, kind)
        if target is not None:
            try:
                drawn[kind] = str(gantt(timeline, target))
            except ImportError as err:
                raise CommandFailed(str(err)) from None
    if args.trace is not None:
        drawn["trace"] = str(write_chrome_trace(timeline, args.trace))
    peaks = list(timeline.peak_activations)
    out.emit(
        {
            "name": schedule.name,
            "ranks": schedule.num_ranks,
            "stages": schedule.num_stages,
            "microbatches": schedule.microbatches,
            "placement": list(schedule.placement),
            "text": str(schedule),
            "makespan": timeline.makespan,
            "bubble_fraction": timeline.bubble_fraction,
            "peak_activations": peaks,
            "files": drawn,
        },
        text="\n".join([
            str(schedule),
            "",
            ascii_timeline(timeline),
            "",
            f"bubble {timeline.bubble_fraction:.1%} of the ranks' time (makespan {timeline.makespan:g} units)",
            "peak activations held per rank: " + " ".join(f"{r}:{p}" for r, p in enumerate(peaks)),
            *(f"wrote {path}" for path in drawn.values()),
        ]),
    )
    return 0
