"""Cutting a module into units by recording its calls (the route for models fx cannot trace).

Hugging Face models cannot be traced by torch.fx (decorated ``forward(*args,
**kwargs)``, data-dependent mask code), but their structure is regular: glue
(embeddings, position ids, the attention mask, rotary embeddings), then a loop
over blocks, then more glue (final norm, head, the model's own loss). So the
module is run once on an example input while hooks record, in order, every
unit call with its arguments and output, and when every other submodule runs.
The chain is then

* ``"embed"``: ``root(x)`` up to the last unit (of the first segment, below), with the
  units replaced by stubs that pass the hidden state through and record what forward
  gives each unit (it stops at the last one). Its output, the *carry*, is a tuple of tensors:
  the hidden state, every tensor the units receive besides it (mask, position
  ids, ``(cos, sin)``), and the tensors of ``x`` itself (ids, mask, labels).
* one layer per unit: ``unit(hidden, **what forward gave it)`` through
  ``ModuleCall``, returning the carry with the new hidden state.
* ``"head"``: ``root(x)`` again with the units stubbed, the last one returning
  the carried hidden state: the code after the loop (norm, head, loss) runs as
  written, and the output is the module's own (a ``ModelOutput``).

* a ``"bridge"`` where the units form two *segments* (an encoder's layers, then a
  decoder's): units of one container pass the hidden state straight on, and code
  between two containers that makes a new one (the encoder's final norm, the
  decoder's embedding and masks) is a layer of its own. It is ``head`` and
  ``embed`` in one: ``root(x)`` again, the units before it passing their input on,
  the segment's last returning the carried hidden state, up to the last unit of
  the next segment, recording what forward gives its units. Its output is the next
  segment's carry (the decoder's hidden state, the encoder's output as
  ``encoder_hidden_states``, the masks, the batch's tensors), so the encoder's
  layers get their gradient through the decoder's layers and the bridge, as in the
  module. (Several segments give ``"bridge.1"``, ``"bridge.2"``, ...)

The code before the first unit thus runs twice (in ``embed`` and, discarded, in
``head``): cheap (an embedding lookup and a mask), and exact. In ``head`` (and a bridge) the
parameters only that code reads are zero placeholders (one element each,
expanded), so the last pipeline stage does not hold the embedding table, and its
dropout modules run in eval mode so the replay draws no random numbers; what the
replay still draws before the carried state (a dropout in a module that holds the
units, as BART's encoder applies to its embedding) is undone where it reaches it, so
the code after draws what it draws in the module.
Which phase holds a parameter is decided by what the recording saw READ (a
TorchFunctionMode, ``tensor_reads.py``), not by which modules ran: DeBERTa reads
``rel_embeddings.weight`` by attribute before its layers and never calls the
module; a value computed before the loop from a parameter and used after it puts
that parameter in ``head`` too, and one read before the encoder and in the bridge
(BART's shared embedding table) is in both: ``embed`` owns it, the bridge ties to
it (``Layer.ties``). The example check (``functionalize`` always runs
it here) proves bitwise that the chain equals the module, and, during it, a read of
a placeholder that can reach a phase's output, or a value computed from one that forward
returns as it is (an encoder's output beside decoder layers as units, or beside both stacks:
wrap the model to return its logits) or that a bridge hands the next units, is refused by
name (a zero-initialised weight would compare equal); so is a use, after the carried state,
of an earlier unit's output (a skip connection into the head, or a decoder given every encoder
layer's output), which the replay has only as that unit's input, passed through, and so is a
unit's argument that the code between two units computes from the hidden state (``embed`` and a
bridge record it with the units passed through); a unit that is the identity on the example,
as a zero-initialised residual branch is, would compare equal.

A unit may return more than its hidden state (Bloom's and GPT-Neo's blocks return
their attention weights even with ``output_attentions=False``). What the later units
of its segment receive (T5's first block computes the position bias from its
``relative_attention_bias``, and the next blocks are given it) is a slot of the carry
that the unit's layer writes (the code before it left an absent marker there), so its
gradient comes back to that block. The rest passes nowhere, so the recording must
show that nothing reads it; where the code around the units reads it, or a unit after
a bridge receives it, it is refused, naming the output and its reader. An encoder's
output reaches the decoder's units only as the last encoder unit's hidden state,
through the bridge: what the decoder's units receive is recorded there.

What crosses a boundary is a tuple of tensors, a structure fixed by the example
input (a pipeline sends tensors). A tensor-or-None argument travels as a tensor
or as the ``ABSENT`` marker (BERT's mask is None for an unpadded batch and a
tensor for a padded one). Non-tensor arguments (``use_cache=False``) are fixed
at the example's values and checked on every call. ``carry.py`` cuts the units into
segments and lays out the carry; this module records forward and builds the layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..torch_api import fake_tensors, is_fake, storage_key
from . import host_random
from .carry import (
    Layout,
    Segment,
    Slot,
    UnitCall,
    absent_marker,
    hidden_of_output,
    output_parts,
    segments_of,
    with_hidden,
)
from .fx_split import FunctionalizeError
from .hf_collecting import collecting_now
from .module_call import ModuleCall, ThreadReplicas, call_arguments, kept_in_copies
from .pytrees import is_model_output, register_output_types
from .reuse import module_signature, reusing_forwards
from .tensor_reads import ReadLog, StandInGuard, tensors_in

EMBED, HEAD = "embed", "head"


# --- recording the example run ----------------------------------------------------------------


# Where forward is, outside the units: gap g is the code that runs after g units have returned (gap 0
# before the first, gap len(units) after the last).
Gap = int


@dataclass
class _Recording:
    calls: list[UnitCall]
    phase: dict[str, set[Gap]]  # module path -> the gaps it runs in
    output: Any
    executed: list[str]  # unit paths in the order forward ran them
    param_reads: dict[Gap, set[str]]  # names of the params read in each gap
    extra_reads: list[tuple[str, int, str]]  # (unit, output index, what reads it) for outputs beyond [0]
    handed: list[tuple[int, int, int]]  # (unit, output index, a later unit receiving it) for outputs beyond [0]


def _record(root: nn.Module, paths: list[str], x: Any, fake_units: bool = False) -> _Recording:
    """Run ``root(x)`` once with hooks. ``fake_units``: from the first unit's call on, run on fake
    tensors (shapes and dtypes, no arithmetic): the units and the code after them are most of a
    large model's cost, while the code before them (the attention mask, which may read ids and
    skip a mask it does not need) runs on the real example, as at run time."""
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
                    faking.enter_context(fake_tensors())
                    faking.enter_context(reusing_forwards([root.get_submodule(p) for p in paths]))
                collecting.extend((path, key) for key in collecting_now())  # only the model's own call fills it
                handed_to(i, (args, kwargs))  # T5's position bias: its layer writes it into the carry
                log.passed((args, kwargs), f"unit {path!r} receives it")  # a parameter handed over as it is
                calls[i] = UnitCall(tuple(args), dict(kwargs))
                state["started"] += 1
                state["inside"] += 1

            def post(mod: nn.Module, args: Any, kwargs: Any, out: Any, i: int = i, path: str = path) -> None:
                calls[i].output = out
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
    _refuse_collecting(root, collecting)
    gaps = range(len(paths) + 1)
    for label, op in [r for gap in gaps for r in log.reads.get(gap, [])]:
        if label in extra_labels:
            unit, k = extra_labels[label]
            extra_reads.append((unit, k, f"{op}() in {type(root).__name__}'s forward reads it"))
    param_reads = {gap: log.labels(gap) for gap in gaps}
    return _Recording(
        [calls[i] for i in range(len(paths))], phase, output, [paths[i] for i in calls], param_reads, extra_reads,
        handed,
    )


def _refuse_collecting(root: nn.Module, collecting: list[tuple[str, str]]) -> None:
    """A model collecting its layers' outputs while they run (``hf_collecting``): split, the layers run one
    by one outside its forward and the code after them would collect nothing."""
    if not collecting:
        return
    unit = collecting[0][0]
    keys = list(dict.fromkeys(key for _, key in collecting))
    flags = ", ".join(f"output_{key.removeprefix('cross_')}=False" for key in keys)
    aux = ("; for the MoE blocks sw.router_aux_loss knows, it adds their load-balancing loss over the whole batch"
           if "router_logits" in keys else "")
    raise FunctionalizeError(
        f"functionalize: {type(root).__name__}'s forward collects its layers' {', '.join(keys)} while they run "
        f"(unit {unit!r} among them), through hooks its own call sets up; split into units, the layers run one "
        f"by one and the code after them would collect nothing. Turn it off ({flags}, in the config, the call "
        f"or the batch), or split with units=None (one layer){aux}"
    )


def _refuse_read_extras(recording: _Recording) -> None:
    """A unit's outputs beyond the hidden state pass on only to the later units of its segment (T5's
    blocks hand their position bias to the next: :func:`_carry_writes`), so the code around the units
    must not use them."""
    if not recording.extra_reads:
        return
    unit, k, user = recording.extra_reads[0]
    raise _extra_refused(unit, k, user)


def _extra_refused(unit: str, k: int, user: str) -> FunctionalizeError:
    return FunctionalizeError(
        f"functionalize: unit {unit!r} returns a tensor at output[{k}] besides its hidden state, and {user}; "
        "only the hidden state (output[0]), and what a unit hands the later units of its own loop (T5's "
        "position bias), pass from one unit to the next. If it is an optional output, turn it off "
        "(output_attentions=False, use_cache=False); else split with units=None (one layer) or choose units "
        "that return only the hidden state."
    )


def _carry_writes(
    paths: list[str], recording: _Recording, segments: list[Segment], layouts: list[Layout]
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
            raise _extra_refused(paths[unit], k, f"unit {paths[receiver]!r}, after the code between them, receives it")
        value = (output_parts(recording.calls[unit].output) or ())[k]  # a tuple: it had parts (_record)
        group = layouts[seg].group_of[("tensor", id(value))]
        writes.setdefault(unit, set()).add((k, 1 + group))
    return {unit: tuple(sorted(found)) for unit, found in writes.items()}


# --- stubs standing in for the units inside the embed / head replicas --------------------------


class _Stopped(Exception):
    """Raised by the last unit's stub in ``embed``: the rest of forward is ``head``'s."""


class _UnitStub(nn.Module):
    """Stands where a unit was: records its call, passes the hidden state on, stops or emits.

    Plain attributes of the unit (``attention_type``, ``layer_idx``) stay readable, since
    forward may consult them; its submodules and tensors are not here: code outside the unit that
    reads one (``F.layer_norm(x, ..., self.h[0].ln_1.weight)``) is refused, naming it."""

    def __init__(self, unit: nn.Module, index: int, slot: Slot, output: Any, path: str = "") -> None:
        super().__init__()
        self.index, self.slot, self.path = index, slot, path
        self.inner = {*unit._modules, *unit._parameters, *unit._buffers}  # what only the unit's own call reads
        self.attributes = {
            k: v for k, v in vars(unit).items() if not k.startswith("_") and not isinstance(v, (nn.Module, Tensor))
        }
        # None: the unit returns the hidden state itself; else the tuple or ModelOutput type it returns
        # it in (a ModelOutput is built from its fields in order, a tuple from one iterable).
        self.output_type: type | None = None if isinstance(output, Tensor) else type(output)
        self._model_output = is_model_output(output)
        # What it passes on beyond the hidden state, and how it runs now: private, since they are
        # the split's bookkeeping (an example's outputs, the phase that ran last), not what the unit
        # computes, and the agreement check compares a module's public attributes.
        # Tensors there are Nones: the code around the units does not read them (_refuse_read_extras), a later
        # unit of the segment that receives one gets it from the carry (_carry_writes), and the example's
        # would be held.
        parts = output_parts(output) or ()
        self._output_rest = tuple(None if isinstance(v, Tensor) else v for v in parts[1:])
        self._mode = "pass"  # pass | stop | emit
        self._recorded: list[UnitCall] | None = None
        self._emit: Tensor | None = None
        self._emitted = False  # in head: whether forward has reached this (the last) unit yet
        self._rewind: Callable[[], None] | None = None  # on emitting: the replay's random draws so far undone
        # Under the check on the example: the guard that follows what it passes on, and whether a layer is
        # recording the next units' calls through it (embed, a bridge) or replaying up to its carried state.
        self._stale: tuple[StandInGuard, bool] | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            attributes = self.__dict__.get("attributes", {})
            if name in attributes:
                return attributes[name]
            if name in self.__dict__.get("inner", ()):
                raise FunctionalizeError(_read_inside_unit(self.__dict__["path"], name)) from None
            raise

    def __getitem__(self, index: Any) -> Any:  # a Sequential or ModuleList unit indexed outside its call
        raise FunctionalizeError(_read_inside_unit(self.path, str(index)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = UnitCall(args, kwargs)
        if self._recorded is not None:
            self._recorded.append(call)
        if self._mode == "stop":
            raise _Stopped
        kind, where = self.slot
        self._emitted = self._mode == "emit"
        if self._emitted and self._rewind is not None:
            self._rewind()
        hidden = self._emit if self._mode == "emit" else (args[where] if kind == "arg" else kwargs[where])  # type: ignore[index]
        if self._stale is not None and self._mode == "pass" and isinstance(hidden, Tensor):
            # What it passes on is its input, not the unit's output, which only its own layer computes:
            # a value of its own (its input stays what it is), followed, so that the code after the
            # carried state reading it, or a later unit receiving a value made from it, is refused.
            hidden = hidden.view_as(hidden)
            guard, recording = self._stale
            guard.mark(hidden, _UnitOutput(self.path, recording))
        if self.output_type is None:
            return hidden
        if self._model_output:
            return self.output_type(hidden, *self._output_rest)
        return self.output_type((hidden, *self._output_rest))


class _UnitOutput(str):
    """The name :class:`StandInGuard` follows a unit's output by in a replay that passes it through;
    ``recording``: while a layer records the next units' calls (``embed``, a bridge), where code may read
    it (a loop's glue) but what the units receive must not come from it."""

    recording: bool

    def __new__(cls, path: str, recording: bool) -> _UnitOutput:
        name = super().__new__(cls, path)
        name.recording = recording
        return name


def _read_inside_unit(path: str, name: str) -> str:
    return (
        f"functionalize: the model's forward reads {path}.{name} outside the call of unit {path!r} (before, "
        "between or after the units). A unit's parameters and submodules live in its own layer, and the code "
        f"around the units runs without them. Read {name!r} only inside the unit's own forward, or pass units= "
        "that keep this code and what it reads together (a larger unit, or units=None for one layer)"
    )


def _stubbed_root(root: nn.Module, paths: list[str], recording: _Recording, segments: list[Segment]) -> nn.Module:
    """A copy of ``root`` (sharing its tensors) whose units are stubs."""
    named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
    memo: dict[int, Any] = {**kept_in_copies(root), **{id(t): t for _, t in named}}
    for path in paths:  # the units themselves are not copied
        memo[id(root.get_submodule(path))] = None
    stubbed = copy.deepcopy(root, memo)
    for seg in segments:
        for i in range(seg.start, seg.stop):
            path = paths[i]
            parent_path, _, attr = path.rpartition(".")
            parent = stubbed.get_submodule(parent_path)
            parent._modules[attr] = _UnitStub(root.get_submodule(path), i, seg.slot, recording.calls[i].output, path)
    return stubbed


def _stubs(module: nn.Module) -> list[_UnitStub]:
    return sorted((m for m in module.modules() if isinstance(m, _UnitStub)), key=lambda s: s.index)


# --- the layers --------------------------------------------------------------------------------


@dataclass
class Piece:
    """A layer to build: its fn(tensors, x), and its params and buffers by local name."""

    fn: Callable[[dict[str, Tensor], Any], Any]
    parameters: list[tuple[str, Tensor]]
    buffers: list[tuple[str, Tensor]]

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.parameters)

    def named_buffers(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.buffers)


class _Placeholders:
    """Zero tensors, one element each expanded to full shape, for params a phase never reads.

    They take the dtype the phase's real parameters arrive in: mixed precision casts those
    (float32 -> bfloat16), and a stand-in left in float32 would meet them in one op (Bloom's
    head replays the layer norm of its tied, real, embedding on a stand-in norm weight)."""

    def __init__(
        self, specs: dict[str, tuple[torch.Size, torch.dtype]], real: dict[str, torch.dtype] | None = None
    ) -> None:
        self.specs = specs
        self.real = real or {}  # the phase's real parameters' recorded dtypes, by name

    def make(self, like: dict[str, Tensor]) -> dict[str, Tensor]:
        device = next((t.device for t in like.values()), torch.device("cpu"))
        cast = {self.real[k]: t.dtype for k, t in like.items() if k in self.real and t.dtype != self.real[k]}
        return {
            k: torch.zeros((), dtype=cast.get(dtype, dtype), device=device).expand(shape)
            for k, (shape, dtype) in self.specs.items()
        }


_GUARDING = contextvars.ContextVar("guarding_stand_ins", default=False)


@contextlib.contextmanager
def guarding_stand_ins() -> Iterator[None]:
    """Inside the block (functionalize's check on the example), ``embed`` and ``head`` refuse a use of
    a parameter's zero stand-in that could reach their output, naming the parameter: a stand-in that
    happens to equal the weight (a zero-initialised one) would pass the comparison with the module."""
    token = _GUARDING.set(True)
    try:
        yield
    finally:
        _GUARDING.reset(token)


def _guard(
    layer: str, stand_ins: dict[str, Tensor], counts: Callable[[], bool], between: str = ""
) -> contextlib.AbstractContextManager[Any]:
    """Under :func:`guarding_stand_ins`, a :class:`StandInGuard` over ``layer``'s stand-ins; else nothing.
    ``between``: for a bridge, the two units it runs between (``'a' and 'b'``)."""
    if not _GUARDING.get():
        return contextlib.nullcontext()

    def refuse(name: str, op: str) -> FunctionalizeError | None:
        if isinstance(name, _UnitOutput):
            return None if name.recording and op != "return" else _stale_output_read(layer, name, op, between)
        if op == "return" and between:
            return FunctionalizeError(
                f"functionalize: the code between units {between} (layer {layer!r}) hands the units after it a "
                f"value computed, before that code, from parameter {name!r}, which layer {layer!r} does not hold: "
                "only the hidden state of the units before passes into it, so it sees a zero stand-in. Make the "
                "code that computes the value run the same way on every call, or split with units=None (one layer "
                "holds every parameter)."
            )
        if op == "return":
            return FunctionalizeError(
                f"functionalize: the model returns a value the code before the first unit computed from "
                f"parameter {name!r}, which layer {layer!r} does not hold: only the hidden state and the units' "
                "own arguments pass through the units, so the code after them sees a zero stand-in (an "
                "encoder's output returned beside a decoder whose layers are the units; LLaVA's image_hidden_states). "
                "Wrap the model in a module whose forward returns only what the loss reads (the logits, or the "
                "model's own loss; so wrapped, an encoder-decoder splits per layer in both stacks: "
                "units=(EncoderLayer, DecoderLayer)), or pass as units layers that run before the code computing "
                "it (an encoder-decoder's encoder layers, the decoder after them), or units=None (one layer holds "
                "every parameter)."
            )
        if layer == EMBED:
            where, seen = "the code before the first unit", "did not see the code before the units read it"
        elif between:
            where = f"the code between units {between} (through a value computed before the first of them)"
            seen = "saw it read before those units only"
        else:
            where = "the code after the last unit (through a value computed before the units)"
            seen = "saw it read before the units only"
        return FunctionalizeError(
            f"functionalize: {where} reads parameter {name!r} (in {op}()), but layer {layer!r} does not hold it: "
            f"the recording on the example {seen}, so this layer has a zero stand-in for it. Make the code "
            "that reads it run the same way on every call, or split with units=None (one layer holds every "
            "parameter)."
        )

    return StandInGuard(stand_ins, counts, refuse)


def _stale_output_read(layer: str, unit: _UnitOutput, op: str, between: str) -> FunctionalizeError:
    """The refusal of the code after a replay's carried state using an earlier unit's output, or of a
    unit's argument computed from it."""
    if unit.recording:
        return FunctionalizeError(
            f"functionalize: a unit after {unit!r} receives a value forward computes from the output of unit "
            f"{unit!r} (besides it as the hidden state): layer {layer!r} records what the units receive with "
            f"them passed through, so there it would be computed from the input unit {unit!r} was given. "
            "Make that code part of a unit (list units by path), or split with units=None (one layer)."
        )
    how, fix = f"reads it (in {op}())", "Make that code use only the last unit's output"
    if op == "return" and between:
        how = "hands it to the units after it"
    elif op == "return":
        how = "returns it as it is (an encoder's output returned beside a decoder's logits)"
        fix = ("Wrap the model in a module whose forward returns only what the loss reads (the logits, or the "
               "model's own loss)")
    where = f"the code between units {between}" if between else "the code after the last unit"
    return FunctionalizeError(
        f"functionalize: {where} (layer {layer!r}) uses the output of unit {unit!r} and {how}, but only the "
        "hidden state of the last unit before that code passes into the layer: there it sees the input unit "
        f"{unit!r} was given instead. {fix}, or pass units that keep the code and what it reads together "
        "(a larger unit, or units=None for one layer)."
    )


def _set_stubs(
    stubs: list[_UnitStub], recorded: list[UnitCall] | None = None, record: range = range(0),
    stop: int | None = None, emit: int | None = None, hidden: Tensor | None = None,
) -> _UnitStub | None:
    """Set the stubs for one replay of forward: every one passes its hidden state on, those in ``record``
    record their calls in ``recorded``, the one at ``stop`` ends forward (``_Stopped``), the one at
    ``emit`` returns ``hidden`` (the carried state: the units before it ran in their own layers). Returns
    the emitting stub."""
    for stub in stubs:
        stub._mode, stub._recorded = "pass", None
    for i in record:
        stubs[i]._recorded = recorded
    if stop is not None:
        stubs[stop]._mode = "stop"
    if emit is None:
        return None
    emitting = stubs[emit]
    emitting._mode, emitting._emit, emitting._emitted = "emit", hidden, False
    return emitting


def _clear_stubs(stubs: list[_UnitStub]) -> None:
    """Drop what a replay left on the stubs (the recorded calls, the carried state): not held on."""
    for stub in stubs:
        stub._recorded, stub._emit, stub._rewind, stub._stale = None, None, None, None


def _follow_passed_outputs(guard: Any, before: list[_UnitStub], recording: list[_UnitStub]) -> None:
    """Under the check on the example, mark what the stubs pass on (their input, not the unit's output):
    the code after the carried state must not use the output of a unit ``before`` it (a skip connection
    from an earlier unit's output into the head), since this layer has only the last one's; and no
    argument of the units ``recording`` records may be computed from one of theirs (a loop's glue making
    the next unit's argument from the hidden state). A unit that computes the identity on the example
    (a zero-initialised residual branch) would compare equal, and train wrong."""
    if isinstance(guard, StandInGuard):
        for stub in before:
            stub._stale = (guard, False)
        for stub in recording:
            stub._stale = (guard, True)


def _rewinder(carried: Tensor, host: list[bool] | None = None) -> Callable[[], None]:
    """Puts the generators forward may draw from (torch's on the CPU and on ``device``, Python's and
    numpy's) back as they are now. A replay (``head``, a bridge) calls it where it reaches its carried
    state: the code before, run again and discarded, may draw (a dropout in a module that holds units,
    as BART's encoder applies to its embedding, is not put in eval mode), and the code after must draw
    what it draws in the module, as the units' layers took the draws between. On fake tensors (a
    pipeline predicting what its stages pass on) nothing draws.

    ``host``: the replay's flag, whether its first run drew from Python's or numpy's generators before the
    carried state (Wav2Vec2's SpecAugment does, in the module that holds the units); a replay that did not
    leaves them alone from then on, as remat's does (saving and setting them costs about 70 us a call)."""
    if is_fake(carried) or carried.is_meta:
        return lambda: None
    device = carried.device
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    first = host is not None and host == [True, True]  # not yet known: this run finds out
    saved = host_random.capture() if host is None or host[0] else None

    def rewind() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        if saved is not None:
            if first and host is not None:
                host[:] = [host_random.moved(saved), False]
            host_random.restore(saved)

    return rewind


def _run_to_stop(
    call: ModuleCall, tensors: dict[str, Tensor], args: Any, kwargs: Any,
    guard: contextlib.AbstractContextManager[Any], stubs: list[_UnitStub], stop: int,
) -> None:
    """Forward up to the stub at ``stop``, which ends it."""
    try:
        with guard:
            call.call(tensors, args, kwargs)
    except _Stopped:
        return
    raise FunctionalizeError(
        f"functionalize: forward did not reach unit {stubs[stop].path!r} on this input, as it did on the example"
        f"{_WHICH_UNITS_RUN}"
    )


# Why a replay may run other units than the example did: each layer replays forward apart, and a draw that
# decides which units run draws again there, differently.
_WHICH_UNITS_RUN = (
    "; if the model skips layers at random in training (LayerDrop: config.layerdrop, encoder_layerdrop or "
    "decoder_layerdrop > 0; M2M100's and NLLB's default 0.05), each layer of the split would draw which units "
    "run apart: set them to 0, or split with units=None (one layer)"
)


_LAYERDROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def _refuse_layerdrop(root: nn.Module) -> None:
    """A model that skips layers at random in training (LayerDrop), whose draws every layer of the split
    would make apart (``_WHICH_UNITS_RUN``): refused before the recording, naming the setting. Read where
    forward reads it: a module's own ``layerdrop`` (BART's stacks copy their config's when built) or its
    config's (Wav2Vec2's encoder reads it there)."""
    for path, module in root.named_modules():
        config = getattr(module, "config", None)
        for owner, where in ((module, path or "the model"), (config, f"{path or 'the model'}'s config")):
            for name in _LAYERDROPS:
                value = vars(owner).get(name) if owner is module else getattr(owner, name, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    raise FunctionalizeError(
                        f"functionalize: {where} has {name}={value}: it skips layers at random in training "
                        "(LayerDrop), and each layer of a split would replay the draws that decide which units run "
                        f"apart, so they would disagree. Build the model with config.{name} = 0.0, or split with "
                        "units=None (one layer)"
                    )


def _refuse_unreached(stub: _UnitStub, layer: str) -> None:
    """A replay that never reached the unit giving the carried state computed without it (the code after a
    skipped last unit reads what the replay passed through instead): refused, not returned."""
    if not stub._emitted:
        raise FunctionalizeError(
            f"functionalize: layer {layer!r} replayed forward, which did not reach unit {stub.path!r} this time "
            f"(it did on the example), so it would compute without the state carried to it{_WHICH_UNITS_RUN}"
        )


def _carry_of_segment(
    layout: Layout, seg: Segment, recorded: list[UnitCall], x: Any, tensors: dict[str, Tensor]
) -> tuple[Tensor, ...]:
    """The carry of the units of ``seg`` from the calls a replay recorded of them."""
    if len(recorded) != seg.stop - seg.start:
        raise FunctionalizeError(
            f"functionalize: forward called {len(recorded)} of the units {layout.paths[0]!r} .. "
            f"{layout.paths[-1]!r} on this input, but {seg.stop - seg.start} on the example{_WHICH_UNITS_RUN}"
        )
    kind, where = seg.slot
    first = recorded[0]
    hidden = first.args[where] if kind == "arg" else first.kwargs[where]  # type: ignore[index]
    return _own_copies(layout.carry(hidden, recorded, x), tensors)


class EmbedFn:
    """``root(x)`` up to the last unit of the first segment: returns its carry."""

    def __init__(self, stubbed: nn.Module, layout: Layout, seg: Segment, placeholders: _Placeholders) -> None:
        self.replicas = ThreadReplicas(stubbed)
        self.layout, self.seg, self.placeholders = layout, seg, placeholders

    def reuse_key(self) -> Hashable | None:
        """Itself: one of a chain (nothing else computes alike), the same under every layout of a plan
        search (``engine/model/reuse.py``'s ``sharing_runs``); the key holds it, so it stays itself."""
        return (EmbedFn, self)

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> tuple[Tensor, ...]:
        call = self.replicas.get()
        stubs = _stubs(call.module)
        recorded: list[UnitCall] = []
        stop = self.seg.stop - 1
        _set_stubs(stubs, recorded, range(self.seg.start, self.seg.stop), stop=stop)
        args, kwargs = call_arguments(call.module, x)
        stand_ins = self.placeholders.make(tensors)
        guard = _guard(EMBED, stand_ins, lambda: True)
        _follow_passed_outputs(guard, [], stubs[self.seg.start:stop])
        try:
            _run_to_stop(call, {**tensors, **stand_ins}, args, kwargs, guard, stubs, stop)
        finally:
            _clear_stubs(stubs)
        out = _carry_of_segment(self.layout, self.seg, recorded, x, tensors)
        if isinstance(guard, StandInGuard):
            guard.check_returned(out)
        return out

    def __repr__(self) -> str:
        return f"embed({type(self.replicas.module).__name__} up to its first unit)"


class BridgeFn:
    """``root(x)`` again between two segments of units (an encoder's layers and a decoder's): the units
    before pass their hidden state on, the last of them returns the carried one, and the code between the
    segments (the encoder's final norm, the decoder's embedding and masks) runs as written up to the last
    unit of the next segment, recording what forward gives its units: their carry. It is ``head`` and
    ``embed`` in one, and computes as they do: the code before the carried state runs again on zero
    stand-ins for the parameters it does not hold, discarded."""

    def __init__(
        self, stubbed: nn.Module, name: str, before: tuple[Layout, Segment], after: tuple[Layout, Segment],
        placeholders: _Placeholders,
    ) -> None:
        self.replicas = ThreadReplicas(stubbed)
        self.name, self.placeholders = name, placeholders
        (self.before, self.previous), (self.layout, self.seg) = before, after
        self.between = f"{self.before.paths[-1]!r} and {self.layout.paths[0]!r}"
        self._host = [True, True]  # as HeadFn's

    def reuse_key(self) -> Hashable | None:
        """Itself, as ``embed``'s and ``head``'s."""
        return (BridgeFn, self)

    def __call__(self, tensors: dict[str, Tensor], carry: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        call = self.replicas.get()
        stubs = _stubs(call.module)
        recorded: list[UnitCall] = []
        stop = self.seg.stop - 1
        emitting = _set_stubs(stubs, recorded, range(self.seg.start, self.seg.stop), stop=stop,
                              emit=self.previous.stop - 1, hidden=carry[0])
        assert emitting is not None
        emitting._rewind = _rewinder(carry[0], self._host)
        x = self.before.inputs.rebuild(carry)
        args, kwargs = call_arguments(call.module, x)
        stand_ins = self.placeholders.make(tensors)
        guard = _guard(self.name, stand_ins, lambda: emitting._emitted, self.between)
        _follow_passed_outputs(guard, stubs[: self.previous.stop - 1], stubs[self.seg.start:stop])
        try:
            _run_to_stop(call, {**tensors, **stand_ins}, args, kwargs, guard, stubs, stop)
        finally:
            _clear_stubs(stubs)
        _refuse_unreached(emitting, self.name)
        out = _carry_of_segment(self.layout, self.seg, recorded, x, tensors)
        if isinstance(guard, StandInGuard):
            guard.check_returned(out)
        return out

    def __repr__(self) -> str:
        return f"bridge({type(self.replicas.module).__name__} between units {self.between})"


def _own_copies(carry: tuple[Tensor, ...], params: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """``carry`` with each tensor that lives in the memory of the layer's parameters copied (autograd
    follows the copy back to them). A parameter the code before the units hands on as it is, or a view
    of it (DeBERTa's rel_embeddings table, given to every layer), would otherwise travel as the
    parameter's own memory: ZeRO-3 frees a unit's gathered parameters after its forward, and the next
    layer read a freed buffer."""
    own = {storage_key(t) for t in params.values() if isinstance(t, Tensor)}
    if not own:
        return carry
    return tuple(t.clone() if isinstance(t, Tensor) and storage_key(t) in own else t for t in carry)


class UnitFn:
    """One unit on the carry: ``unit(hidden, **its arguments)``; the carry with the new hidden state."""

    def __init__(
        self, unit: nn.Module, path: str, index: int, layout: Layout, slot: Slot,
        writes: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.replicas = ThreadReplicas(unit, prefix=path + ".")
        self.path, self.index, self.layout, self.slot = path, index, layout, slot
        self.writes = writes  # (output index, carry index): what it hands the later units (_carry_writes)
        # Read off the model's own unit (its skeleton is a copy: the config it shares with the other
        # units would compare unequal): units of one kind, called alike, compute alike.
        signature = module_signature(unit)
        self._reuse_key = None if signature is None else (UnitFn, signature, slot, layout.units[index], writes)

    def reuse_key(self) -> Hashable | None:
        """Equal for units that compute alike (see ``engine/model/reuse.py``)."""
        return self._reuse_key

    def __call__(self, tensors: dict[str, Tensor], carry: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        rest_args, rest_kwargs = self.layout.units[self.index].rebuild(carry)
        args, kwargs = with_hidden(carry[0], self.slot, rest_args, rest_kwargs)
        out = self.replicas.get().call(tensors, args, kwargs)
        new = [hidden_of_output(self.path, out), *carry[1:]]
        if not self.writes:
            return tuple(new)
        for k, where in self.writes:
            part = (output_parts(out) or ())[k]  # a tuple or ModelOutput, as recorded
            new[where] = absent_marker() if part is None else part
        # What it hands on may be (a view of) its own parameter, which ZeRO-3 frees after this forward.
        return _own_copies(tuple(new), tensors)

    def __repr__(self) -> str:
        return f"functional_call({type(self.replicas.module).__name__})"


class HeadFn:
    """``root(x)`` with the units stubbed and the last one giving the carried hidden state."""

    def __init__(self, stubbed: nn.Module, layout: Layout, placeholders: _Placeholders) -> None:
        self.replicas = ThreadReplicas(stubbed)
        self.layout, self.placeholders = layout, placeholders
        self._host = [True, True]  # whether its replay draws from Python's / numpy's generators; unknown yet

    def reuse_key(self) -> Hashable | None:
        """Itself: one of a chain (nothing else computes alike), the same under every layout of a plan
        search (``engine/model/reuse.py``'s ``sharing_runs``); the key holds it, so it stays itself."""
        return (HeadFn, self)

    def __call__(self, tensors: dict[str, Tensor], carry: tuple[Tensor, ...]) -> Any:
        call = self.replicas.get()
        stubs = _stubs(call.module)
        last = _set_stubs(stubs, emit=len(stubs) - 1, hidden=carry[0])
        assert last is not None
        last._rewind = _rewinder(carry[0], self._host)
        x = self.layout.inputs.rebuild(carry)
        args, kwargs = call_arguments(call.module, x)
        stand_ins = self.placeholders.make(tensors)
        guard = _guard(HEAD, stand_ins, lambda: last._emitted)
        _follow_passed_outputs(guard, stubs[:-1], [])
        try:
            with guard:
                out = call.call({**tensors, **stand_ins}, args, kwargs)
        finally:
            _clear_stubs(stubs)
        _refuse_unreached(last, HEAD)
        if isinstance(guard, StandInGuard):
            guard.check_returned(out)
        return register_output_types(out)

    def __repr__(self) -> str:
        return f"head({type(self.replicas.module).__name__} after its last unit)"


BRIDGE = "bridge"


def split_by_calls(
    root: nn.Module, paths: list[str], example: Any, ordered: bool, fake_units: bool = False
) -> list[tuple[str, Piece]]:
    """``embed``, one piece per unit, ``head``, and a ``bridge`` between two segments of units (an
    encoder's layers and a decoder's): the layers of the call-recording split.

    ``ordered``: the paths were listed by the user, and must be in execution order.
    ``fake_units``: record the units and the code after them on fake tensors (see ``_record``)."""
    _refuse_clash(paths, (EMBED, HEAD))
    _refuse_layerdrop(root)
    recording = _record(root, paths, example, fake_units)
    if recording.executed != paths:
        if ordered:
            raise FunctionalizeError(
                "functionalize: units must be listed in the order forward runs them; forward runs "
                f"{recording.executed}"
            )
        paths = recording.executed
        recording = _record(root, paths, example, fake_units)
    _refuse_read_extras(recording)
    segments = segments_of(paths, recording.calls)
    bridges = _bridge_names(len(segments))
    _refuse_clash(paths, bridges)
    layouts = [
        Layout(paths[seg.start:seg.stop], recording.calls[seg.start:seg.stop], seg.slot, example) for seg in segments
    ]
    writes = _carry_writes(paths, recording, segments, layouts)
    stubbed = _stubbed_root(root, paths, recording, segments)
    owned = _phase_params(root, paths, recording, segments)
    params = list(stubbed.named_parameters())
    buffers = list(stubbed.named_buffers())

    def phase(ids: set[int]) -> tuple[list[tuple[str, Tensor]], _Placeholders]:
        real: list[tuple[str, Tensor]] = [(n, p) for n, p in params if id(p) in ids or not p.requires_grad]
        fake = {n: (p.shape, p.dtype) for n, p in params if not (id(p) in ids or not p.requires_grad)}
        return real, _Placeholders(fake, {n: p.dtype for n, p in real if p.is_floating_point()})

    pieces: list[tuple[str, Piece]] = []
    for k, (seg, layout) in enumerate(zip(segments, layouts, strict=True)):
        real, fake = phase(owned[k])
        if k == 0:
            pieces.append((EMBED, Piece(EmbedFn(stubbed, layout, seg, fake), real, buffers)))
        else:
            replay = _eval_ran_before(stubbed, recording, seg.start)
            previous = (layouts[k - 1], segments[k - 1])
            fn = BridgeFn(replay, bridges[k - 1], previous, (layout, seg), fake)
            pieces.append((bridges[k - 1], Piece(fn, real, buffers)))
        for i in range(seg.start, seg.stop):
            unit, path = root.get_submodule(paths[i]), paths[i]
            pieces.append((path, Piece(
                UnitFn(unit, path, i - seg.start, layout, seg.slot, writes.get(i, ())),
                list(unit.named_parameters(prefix=path)),
                list(unit.named_buffers(prefix=path)),
            )))
    head_params, head_fake = phase(owned[-1])
    head_root = _eval_ran_before(stubbed, recording, len(paths))
    pieces.append((HEAD, Piece(HeadFn(head_root, layouts[-1], head_fake), head_params, buffers)))
    return pieces


def _bridge_names(segments: int) -> list[str]:
    """The name of each bridge: ``"bridge"`` for the one between two segments, else ``"bridge.1"``, ..."""
    if segments <= 2:
        return [BRIDGE] * (segments - 1)
    return [f"{BRIDGE}.{k}" for k in range(1, segments)]


def _refuse_clash(paths: list[str], names: Sequence[str]) -> None:
    clash = [path for path in paths if path in names]
    if not clash:
        return
    what = {EMBED: "before the first unit", HEAD: "after the last unit"}.get(clash[0], "between two segments of units")
    raise FunctionalizeError(
        f"functionalize(units=...): the unit {clash[0]!r} has the name of the layer functionalize makes of "
        f"the code {what} ({EMBED!r}, {HEAD!r} and {BRIDGE!r} hold what runs around the units): leave "
        f"{clash[0]!r} out of units, and that layer holds it"
    )


def _region(gap: Gap, segments: list[Segment], units: int) -> int:
    """Which layer runs the code of ``gap`` for real: 0 ``embed``, k the bridge into segment k (the code
    between two of its units included: it records their calls), ``len(segments)`` ``head``."""
    if gap == units:
        return len(segments)
    return next(k for k, seg in enumerate(segments) if seg.start <= gap < seg.stop)


def _phase_params(
    root: nn.Module, paths: list[str], recording: _Recording, segments: list[Segment]
) -> list[set[int]]:
    """ids of the params each layer around the units really uses: ``embed``, each bridge, ``head`` (by
    :func:`_region`): those the code it runs reads, and those of modules run there; a module that holds
    units (the root, ``transformer``) may read its own params anywhere, so every one gets them; a param
    nothing reads goes to ``head`` (it holds the rest). Reads, not module calls, decide: DeBERTa's
    encoder reads ``rel_embeddings.weight`` by attribute before its layers and never calls the module.
    A param two of them read (BART's shared embedding table, read before the encoder and in the bridge
    to the decoder) is in both: the first owns it, the later ones tie to it."""
    by_name = dict(root.named_parameters())
    units = len(paths)
    owned: list[set[int]] = [set() for _ in range(len(segments) + 1)]
    for gap, names in recording.param_reads.items():
        owned[_region(gap, segments, units)].update(id(by_name[n]) for n in names)
    starts = {seg.start for seg in segments}
    rest: list[int] = []
    for path, sub in root.named_modules():
        if path in paths or any(path.startswith(p + ".") for p in paths):
            continue
        own = [id(p) for p in sub.parameters(recurse=False)]
        holds_units = any(p.startswith(path + ".") or not path for p in paths)
        seen = recording.phase.get(path, set())
        if own and not holds_units and any(g not in starts and g != units for g in seen):
            raise FunctionalizeError(
                f"functionalize: module {path!r} has parameters and runs between units; make it part of a "
                "unit (list units by path) so that it belongs to one layer."
            )
        for k, ids in enumerate(owned):
            if holds_units or any(_region(g, segments, units) == k for g in seen):
                ids.update(own)
        rest.extend(own)
    claimed = set().union(*owned)
    owned[-1].update(i for i in rest if i not in claimed)
    return owned


def _eval_ran_before(stubbed: nn.Module, recording: _Recording, gap: Gap) -> nn.Module:
    """A copy of ``stubbed`` (sharing tensors) whose modules that only run before ``gap`` are in eval
    mode: a replay from there on (``head``, a bridge) discards their output, so their dropout must not draw."""
    named = [*stubbed.named_parameters(remove_duplicate=False), *stubbed.named_buffers(remove_duplicate=False)]
    copied = copy.deepcopy(stubbed, {**kept_in_copies(stubbed), **{id(t): t for _, t in named}})
    units = [m for m in copied.modules() if isinstance(m, _UnitStub)]
    for path, sub in copied.named_modules():
        holds_units = any(u in units for u in sub.modules())
        seen = recording.phase.get(path)
        if seen and max(seen) < gap and not holds_units:
            sub.train(False)
    return copied
