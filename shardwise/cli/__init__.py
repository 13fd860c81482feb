"""The ``shardwise`` command: look at schedules and Plans, verify a step, from the shell.

Exit status, as pytest and torchrun use it: 0 when all is well, 1 when the
command ran and the answer is "no" (an invalid schedule, a step that diverges
from its reference, an error raised by your code), 2 for a usage error (a bad
flag, a bad ``--mesh``, a missing FILE or FUNCTION). ``--json`` prints one JSON
object on stdout instead of text, ``"ok": false`` with the reason for a "no";
errors also go to stderr, and usage errors only there. Every error is one line on
stderr, ``shardwise VERB: error: ...``; an exception raised by your code says where
it was raised, and ``--traceback`` prints its whole traceback as well.

>>> main(["schedule", "gpipe", "--ranks", "2", "--microbatches", "2"])
rank 0: 0F0 0F1 0B0 0B1
rank 1: 1F0 1F1 1B0 1B1
<BLANKLINE>
gpipe: makespan 9, bubble 33.3%
rank 0 |0F0 0F1 ............0B0     0B1     |
rank 1 |....1F0 1F1 1B0     1B1     ........|
legend: 0F1 = stage 0, micro-batch 1 (F forward, B backward); . idle
<BLANKLINE>
bubble 33.3% of the ranks' time (makespan 9 units)
peak activations held per rank: 0:2 1:2
0
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from . import checkpoint_cmd, plan_cmd, schedule_cmd, verify_cmd
from .arguments import UsageError
from .report import CommandFailed, Output, one_line

OK, FAILED, USAGE = 0, 1, 2

__all__ = ["FAILED", "OK", "USAGE", "build_parser", "main"]


class OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors in one line (it prints the usage first): the help is one flag away."""

    def error(self, message: str) -> NoReturn:
        for action in self._actions:  # a missing verb: name them, as the usage would have
            names = action.metavar if isinstance(action, argparse._SubParsersAction) else None
            if isinstance(names, str) and names in message:
                message += f" ({names} is one of {', '.join(action.choices or ())})"
        self.exit(USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def raised_where(error: BaseException) -> str:
    """Where the innermost frame outside shardwise and Python's own libraries raised ``error``, if any."""
    ours = Path(__file__).resolve().parents[1]
    libraries = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = Path(frame.filename).resolve()
        if ours not in path.parents and not libraries.intersection(path.parents) and path.is_file():
            return f" (raised at {frame.filename}:{frame.lineno}, in {frame.name})"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="shardwise",
        description=__doc__.split("\n\n>>>")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    schedule_cmd.add_parser(verbs)
    plan_cmd.add_parser(verbs)
    verify_cmd.add_parser(verbs)
    checkpoint_cmd.add_parser(verbs)
    for command in _commands(parser):
        command.add_argument("--traceback", action="store_true",
                             help="on an error raised by your code (or ours), print its whole traceback too")
    return parser


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers that run something: the verbs, and the actions under a verb that has them."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_commands(sub) or [sub])
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse's own usage errors (status 2) and --help (status 0)
        return exit_.code if isinstance(exit_.code, int) else USAGE
    prog = f"shardwise {args.verb}"
    out = Output(as_json=args.json, prog=prog)
    try:
        return int(args.run(args, out))
    except UsageError as err:
        print(f"{prog}: error: {one_line(str(err))} (see {prog} --help)", file=sys.stderr)
        return USAGE
    except CommandFailed as failure:
        out.fail(failure)
        return FAILED
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # raised by the user's code (or ours): say what and where, exit 1
        if args.traceback:
            traceback.print_exc()
        hint = "" if args.traceback else "; --traceback prints the whole traceback"
        print(f"{prog}: error: {type(err).__name__}: {one_line(str(err))}{raised_where(err)}{hint}", file=sys.stderr)
        # A program reading --json gets its one object in every outcome, never an empty stdout.
        out.fail_quietly(f"{type(err).__name__}: {err}", {"traceback": traceback.format_exc()})
        return FAILED
