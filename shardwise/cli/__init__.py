"""The ``shardwise`` command: look at schedules and Plans, verify a step, search layouts, from the shell.

Exit status, as pytest and torchrun use it: 0 when all is well, 1 when the
command ran and the answer is "no" (an invalid schedule, a step that diverges
from its reference, an error raised by your code), 2 for a usage error (a bad
flag, a bad ``--mesh``, a missing FILE or FUNCTION). ``--json`` prints one JSON
object on stdout instead of text, ``"ok": false`` with the reason for a "no";
errors also go to stderr, and usage errors only there.

>>> main(["schedule", "gpipe", "--ranks", "2", "--microbatches", "2"])
rank 0: 0F0 0F1 0B0 0B1
rank 1: 1F0 1F1 1B0 1B1
<BLANKLINE>
gpipe: makespan 9, bubble 33.3%
rank 0 |0F0 0F1 ............0B0     0B1     |
rank 1 |....1F0 1F1 1B0     1B1     ........|
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

from . import checkpoint_cmd, plan_cmd, schedule_cmd, search_cmd, verify_cmd
from .arguments import UsageError
from .report import CommandFailed, Output

OK, FAILED, USAGE = 0, 1, 2

__all__ = ["FAILED", "OK", "USAGE", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description=__doc__.split("\n\n>>>")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    schedule_cmd.add_parser(verbs)
    plan_cmd.add_parser(verbs)
    verify_cmd.add_parser(verbs)
    checkpoint_cmd.add_parser(verbs)
    search_cmd.add_parser(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse's own usage errors (status 2) and --help (status 0)
        return exit_.code if isinstance(exit_.code, int) else USAGE
    out = Output(as_json=args.json)
    try:
        return int(args.run(args, out))
    except UsageError as err:
        print(f"shardwise {args.verb}: error: {err}", file=sys.stderr)
        return USAGE
    except CommandFailed as failure:
        out.fail(failure)
        return FAILED
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # raised by the user's code (or ours): show where, exit 1
        traceback.print_exc()
        print(f"shardwise {args.verb}: error: {type(err).__name__} (traceback above)", file=sys.stderr)
        # A program reading --json gets its one object in every outcome, never an empty stdout.
        out.fail_quietly(f"{type(err).__name__}: {err}", {"traceback": traceback.format_exc()})
        return FAILED
