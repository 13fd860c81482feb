"""Recording the example run of the call-recording split (``capture.py``): every unit call with its
arguments and output, when each other submodule runs, which parameters the code around the units reads,
and who uses what a unit returns beside its hidden state."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..torch_api import fake_tensors
from .capture_refusals import extra_refused, refuse_changed_in_unit, refuse_collecting
from .carry import (
    Layout,
    Segment,
    UnitCall,
    output_parts,
)
from .changed_inputs import LeafIndices, changed_since, copies, versions
from .fx_split import FunctionalizeError
from .hf_collecting import collecting_now
from .hf_masks import mask_decisions_as_at_run_time
from .module_call import call_arguments
from .predicted_state import clear_method_caches
from .reuse import reusing_forwards
from .tensor_reads import ReadLog, tensors_in

# Where forward is, outside the units: gap g is the code that runs after g units have returned (gap 0
# before the first, gap len(units) after the last).
Gap = int


@dataclass
class Recording:
    calls: list[UnitCall]
    phase: dict[str, set[Gap]]  # module path -> the gaps it runs in
    output: Any
    executed: list[str]  # unit paths in the order forward ran them
    param_reads: dict[Gap, set[str]]  # names of the params read in each gap
    extra_reads: list[tuple[str, int, str]]  # (unit, output index, what reads it) for outputs beyond [0]
    handed: list[tuple[int, int, int]]  # (unit, output index, a later unit receiving it) for outputs beyond [0]
    changed: LeafIndices = ()  # the input's tensors forward changes in place (Whisper's SpecAugment)


def record_calls(root: nn.Module, paths: list[str], x: Any, fake_units: bool = False) -> Recording:
    """Run ``root(x)`` once with hooks. ``fake_units``: from the first unit's call on, run on fake
    tensors (shapes and dtypes, no arithmetic): the units and the code after them are most of a
    large model's cost, while the code before them (the attention mask, which may read ids and
    skip a mask it does not need) runs on the real example, as at run time. It runs on a copy of the
    example's tensors, noting those forward changes in place (``changed_inputs.py``)."""
    x = copies(x)
    unit_index = {p: i for i, p in enumerate(paths)}
    faking = contextlib.ExitStack()
    calls: dict[int, UnitCall] = {}
    phase: dict[str, set[Gap]] = {}
    state = {"started": 0, "ended": 0, "inside": 0}
    handles = []

    def when() -> Gap:
        return state["ended"]

    # Parameter reads outside the units, wherever the tensor came from (a module call or an attribute,
    # as DeBERTa's rel_embeddings.weight), and every use of what a unit returns beyond its hidden state.
    log = ReadLog(lambda: None if state["inside"] else when())
    for name, p in root.named_parameters():
        log.watch(p, name, follow=True)
    extras: dict[int, tuple[Tensor, str, int]] = {}
    extra_labels: dict[str, tuple[str, int]] = {}
    extra_reads: list[tuple[str, int, str]] = []
    handed: list[tuple[int, int, int]] = []
    collecting: list[tuple[str, str]] = []  # (unit, output) its model collected while the unit ran
    before_unit: list[int | None] = []  # the input's tensors' versions as the unit running now began

    def extra_users(tree: Any, user: str) -> None:
        for t in tensors_in(tree):
            found = extras.get(id(t))
            if found is not None and found[0] is t:
                extra_reads.append((found[1], found[2], user))

    def handed_to(receiver: int, tree: Any) -> None:
        for t in tensors_in(tree):
            found = extras.get(id(t))
            if found is not None and found[0] is t:
                handed.append((unit_index[found[1]], found[2], receiver))

    for path, sub in root.named_modules():
        if path in unit_index:
            i = unit_index[path]

            def pre(mod: nn.Module, args: Any, kwargs: Any, i: int = i, path: str = path) -> None:
                if i in calls:
                    raise FunctionalizeError(
                        f"functionalize: unit {path!r} is called more than once in forward, but a unit "
                        "is one layer and runs once; make the code that calls it repeatedly the unit instead."
                    )
                if fake_units and state["started"] == 0:
                    faking.callback(clear_method_caches, root)  # (after the fake run: predicted_state.py)
                    faking.enter_context(fake_tensors())
                    faking.enter_context(mask_decisions_as_at_run_time())  # (hf_masks.py)
                    faking.enter_context(reusing_forwards([root.get_submodule(p) for p in paths]))
                collecting.extend((path, key) for key in collecting_now())  # only the model's own call fills it
                handed_to(i, (args, kwargs))  # T5's position bias: its layer writes it into the carry
                log.passed((args, kwargs), f"unit {path!r} receives it")  # a parameter handed over as it is
                calls[i] = UnitCall(tuple(args), dict(kwargs))
                before_unit[:] = versions(x)
                state["started"] += 1
                state["inside"] += 1

            def post(mod: nn.Module, args: Any, kwargs: Any, out: Any, i: int = i, path: str = path) -> None:
                calls[i].output = out
                refuse_changed_in_unit(path, x, changed_since(x, before_unit))
                state["ended"] += 1
                state["inside"] -= 1
                parts = output_parts(out)
                if parts is not None:
                    # What it was given and hands back (a mask) travels in the carry already.
                    given = {id(t) for t in tensors_in((args, kwargs, parts[:1]))}
                    for k, v in enumerate(parts[1:], start=1):
                        if isinstance(v, Tensor) and id(v) not in given:
                            extras[id(v)] = (v, path, k)
                            extra_labels[f"output[{k}] of {path!r}"] = (path, k)
                            log.watch(v, f"output[{k}] of {path!r}", layout=True)

            handles.append(sub.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(sub.register_forward_hook(post, with_kwargs=True))
        elif not any(path.startswith(p + ".") for p in paths):

            def seen(mod: nn.Module, args: Any, path: str = path) -> None:
                phase.setdefault(path, set()).add(when())

            handles.append(sub.register_forward_pre_hook(seen))
    first = versions(x)
    try:
        args, kwargs = call_arguments(root, x)
        with torch.no_grad(), log:
            output = root(*args, **kwargs)
        extra_users(output, f"{type(root).__name__} returns it")
    finally:
        faking.close()
        for h in handles:
            h.remove()
    missing = [p for i, p in enumerate(paths) if i not in calls]
    if missing:
        raise FunctionalizeError(
            f"functionalize: units {missing} are never called when {type(root).__name__} runs on the "
            "example input; choose units that forward calls."
        )
    refuse_collecting(root, collecting)
    gaps = range(len(paths) + 1)
    for label, op in [r for gap in gaps for r in log.reads.get(gap, [])]:
        if label in extra_labels:
            unit, k = extra_labels[label]
            extra_reads.append((unit, k, f"{op}() in {type(root).__name__}'s forward reads it"))
    param_reads = {gap: log.labels(gap) for gap in gaps}
    return Recording(
        [calls[i] for i in range(len(paths))], phase, output, [paths[i] for i in calls], param_reads, extra_reads,
        handed, changed_since(x, first),
    )




def refuse_read_extras(recording: Recording, root: nn.Module, paths: list[str]) -> None:
    """A unit's outputs beyond the hidden state pass on only to the later units of its segment (T5's
    blocks hand their position bias to the next: :func:`carry_writes`), so the code around the units
    must not use them. Where the unit is a block of a loop whose next block is not a unit, that block,
    run in the code around the units, is the likely reader: the refusal says so."""
    if not recording.extra_reads:
        return
    unit, k, user = recording.extra_reads[0]
    head, _, index = unit.rpartition(".")
    following = None
    if index.isdigit() and head:  # the first later block of the unit's loop that is not a unit
        j = int(index) + 1
        while f"{head}.{j}" in paths:
            j += 1
        following = f"{head}.{j}" if _has_submodule(root, f"{head}.{j}") else None
    hint = ""
    if following is not None:
        hint = (f"; the loop's block {following!r} is not a unit, and a block handing its successor a value "
                "(T5's position bias) needs its loop's later blocks among the units too: name them")
    raise extra_refused(unit, k, user + hint)


def _has_submodule(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def carry_writes(
    paths: list[str], recording: Recording, segments: list[Segment], layouts: list[Layout]
) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per unit, ``(output index, carry index)`` for each tensor it returns beside its hidden state that
    later units of its segment receive (T5's first block computes the position bias from its
    ``relative_attention_bias`` and hands it to the next, which hand it on): its layer writes it into
    the carry, where the code before it (``embed``, a bridge) put an absent marker, so the later units read
    it and its gradient comes back to the unit's parameters. Handed to a unit of another segment, it is
    refused: the bridge between them has only the hidden state of the units before it."""
    writes: dict[int, set[tuple[int, int]]] = {}
    for unit, k, receiver in recording.handed:
        seg = next(j for j, sg in enumerate(segments) if sg.start <= unit < sg.stop)
        if not segments[seg].start <= receiver < segments[seg].stop:
            raise extra_refused(paths[unit], k, f"unit {paths[receiver]!r}, after the code between them, receives it")
        value = (output_parts(recording.calls[unit].output) or ())[k]  # a tuple: it had parts (record_calls)
        group = layouts[seg].group_of[("tensor", id(value))]
        writes.setdefault(unit, set()).add((k, 1 + group))
    return {unit: tuple(sorted(found)) for unit, found in writes.items()}
