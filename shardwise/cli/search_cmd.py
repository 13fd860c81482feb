"""``shardwise search FILE:FUNCTION --world N --memory 80GB``: the best layouts of a step."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ..engine.simulate.costs import CommModel
from ..plan_search import FlopCompute, Space, params_per_layer, parse_bytes, plot_frontier, search
from ..plan_search.compute import batch_size
from .arguments import UsageError, check_output_file, load_function
from .report import CommandFailed

HELP = "search the parallel layouts of a step: ranked by simulated time, bounded by memory"
OPTIONS = ("tp_plan", "space", "certify_with")
DESCRIPTION = """\
Try every layout of a training step on --world ranks (data, pipeline and tensor
parallel and their products; ZeRO stages, schedules, micro-batches, remat), keep
those whose predicted peak memory per rank fits --memory, and rank them by the
simulated step time. Prints a table (the time-memory frontier marked with *) and,
with --plot, draws time against memory.

FILE:FUNCTION names a function of no arguments that returns (step, params, batch):
the single-device step (sw.train_step, no parallel transforms), its parameters and
one global batch; or (step, params, batch, options) with options a dict of
  tp_plan       a tensor-parallel plan (sw.tp.tiny_gpt_plan(), sw.tp.llama_plan(), ...);
                without one, layouts with tp > 1 are skipped
  space         a shardwise.plan_search.Space (the options to combine)
  certify_with  (small_step, small_params, small_batches): a small version of the
                model; the top layouts are checked by sw.testing.assert_equivalent

Compute costs are measured from single-device steps here (real parameters), or
come from --flops (a FLOP count at that rate). Communication is priced by
--comm FILE, JSON lines of benchmarks/collectives.py; without it, it is free.

    shardwise search train.py:make --world 8 --memory 80GB --comm collectives.jsonl
"""


def memory_argument(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def add_parser(verbs: Any) -> None:
    parser = verbs.add_parser("search", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", metavar="FILE:FUNCTION", help="a function returning (step, params, batch[, options])")
    parser.add_argument("--world", type=positive_int, required=True, help="how many ranks")
    parser.add_argument("--memory", type=memory_argument, required=True, help="memory per rank, e.g. 80GB or 512MiB")
    parser.add_argument("--top", type=positive_int, default=10, help="layouts to list (default 10)")
    parser.add_argument("--comm", help="JSON lines of benchmarks/collectives.py to price communication from")
    parser.add_argument("--flops", type=float, help="price compute by FLOPs at this rate per rank instead of "
                                                     "measuring (e.g. 1e12)")
    parser.add_argument("--tokens-per-sample", type=positive_int, default=1,
                        help="with --flops: tokens in one sample of the batch (a sequence's length)")
    parser.add_argument("--cores", type=positive_int, help="cores the ranks share (default: one each)")
    parser.add_argument("--plot", help="draw predicted time against memory to this file (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(run=run)


def _loaded(target: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    result = load_function(target)()
    if not isinstance(result, tuple | list) or len(result) not in (3, 4):
        got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple | list) else "")
        raise UsageError(f"{target} must return (step, params, batch) or (step, params, batch, options), got {got}")
    options = dict(result[3]) if len(result) == 4 else {}
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise UsageError(f"{target}: options {unknown} are not search options; use {list(OPTIONS)}")
    if "space" in options and not isinstance(options["space"], Space):
        raise UsageError(f"{target}: options['space'] must be a shardwise.plan_search.Space")
    return result[0], result[1], result[2], options


def _comm(path: str | None) -> CommModel | None:
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--comm {path!r}: no such file")
    try:
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        return CommModel.from_benchmark(rows)
    except (ValueError, KeyError) as err:
        raise UsageError(f"--comm {path!r}: {err}") from None


def _check_plot(path: str | None) -> None:
    """Refuse a --plot the search could not write, before the search (minutes on a large model) runs."""
    if path is None:
        return
    check_output_file("--plot", path, "frontier.png")
    suffix = Path(path).suffix.lstrip(".").lower()
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # plot_frontier says so in the output; the search is still worth its table
        return
    if suffix and suffix not in (kinds := FigureCanvasBase.get_supported_filetypes()):
        raise UsageError(f"--plot {path!r}: matplotlib cannot write a .{suffix} file; use one of "
                         f"{', '.join('.' + k for k in sorted(kinds))}")


def _samples(target: str, batch: Any) -> int:
    try:
        return batch_size(batch)
    except ValueError as err:
        raise UsageError(f"{target}: --flops counts FLOPs per sample, but {err}") from None


def run(args: argparse.Namespace, out: Any) -> int:
    step, params, batch, options = _loaded(args.target)
    compute = None
    if args.flops is None and args.tokens_per_sample != 1:
        raise UsageError("--tokens-per-sample counts the FLOPs of --flops: give --flops too")
    if args.flops is not None:
        if not (args.flops > 0 and math.isfinite(args.flops)):
            raise UsageError(f"--flops {args.flops}: a finite rate above 0, e.g. 1e12")
        samples = _samples(args.target, batch)  # any batch tree: a Hugging Face dict of inputs too
        compute = FlopCompute(params_per_layer(step, params), args.flops, samples, args.tokens_per_sample)
    _check_plot(args.plot)
    found = search(step, params, batch, world=args.world, memory_per_rank=args.memory, comm=_comm(args.comm),
                   compute=compute, top=args.top, cores=args.cores, **options)
    text = [found.table()]
    data = found.as_dict()
    if args.plot:
        try:
            done = plot_frontier(found, args.plot)
        except (OSError, ValueError) as err:  # the table is the answer: print it, then say the plot failed
            if not out.as_json:
                print("\n".join(text))
            raise CommandFailed(f"--plot {args.plot!r}: not drawn ({type(err).__name__}: {err}); the search's "
                                "answer is the table", data) from None
        text.append(done)
        data["plot"] = done
    if not found.ranked:  # the answer is "no": exit 1, with what was refused and why
        if not out.as_json:
            print("\n".join(text))
        raise CommandFailed(f"{found.why_none()}; the table says why", data)
    out.emit(data, text="\n".join(text))
    return 0
