"""The stubs standing where the units were in the replays of the call-recording split (``capture.py``):
each records its call, passes the hidden state on, ends forward (``embed``) or returns the carried state
(``head``, a bridge); and the stubbed copies of the model those replays run."""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Iterator
from typing import Any

import optree
from torch import Tensor, nn

from .capture_refusals import read_inside_unit
from .carry import (
    Segment,
    Slot,
    UnitCall,
    output_parts,
    without_hidden,
)
from .fx_split import FunctionalizeError
from .module_call import kept_in_copies
from .pytrees import is_model_output
from .recording import Gap, Recording
from .tensor_reads import StandInGuard


class Stopped(Exception):
    """Raised by the last unit's stub in ``embed``: the rest of forward is ``head``'s."""


class UnitStub(nn.Module):
    """Stands where a unit was: records its call, passes the hidden state on, stops or emits.

    Plain attributes of the unit (``attention_type``, ``layer_idx``) stay readable, since
    forward may consult them, and so do its submodules' (torch's ``nn.TransformerEncoder`` reads
    ``self.layers[0].self_attn.batch_first`` before calling its layers); its tensors are not here: code
    outside the unit that reads one (``F.layer_norm(x, ..., self.h[0].ln_1.weight)``) is refused, naming it."""

    def __init__(self, unit: nn.Module, index: int, slot: Slot, call: UnitCall, path: str = "") -> None:
        super().__init__()
        # The unit's mode, as code around the units reads it (``self.layers[0].training``): a fresh module's is
        # True, which an eval-mode model's glue read as training (a branch on it took the other way).
        self.training = unit.training
        self.index, self.slot, self.path = index, slot, path
        self._unit_type = type(unit)  # (what it stands for: sequence_first.py reads torch's own layers')
        output = call.output
        self.inner = {*unit._parameters, *unit._buffers}  # what only the unit's own call reads
        self.attributes = _plain_attributes(unit)
        self.submodules = {name: _Submodule(path, name, m, self) for name, m in unit._modules.items() if m}
        # None: the unit returns the hidden state itself; else the tuple or ModelOutput type it returns
        # it in (a ModelOutput is built from its fields in order, a tuple from one iterable).
        self.output_type: type | None = None if isinstance(output, Tensor) else type(output)
        self._model_output = is_model_output(output)
        # What it passes on beyond the hidden state, and how it runs now: private, since they are
        # the split's bookkeeping (an example's outputs, the phase that ran last), not what the unit
        # computes, and the agreement check compares a module's public attributes.
        # Tensors there are Nones: the code around the units does not read them (refuse_read_extras), a later
        # unit of the segment that receives one gets it from the carry (carry_writes), and the example's
        # would be held; but one the unit hands back as it was given (T5's blocks after the first return
        # the position bias they receive) is that argument of this call, as in the module: a unit after
        # it receives it (T5 split at its later blocks only, the first computing the bias before them).
        parts = output_parts(output) or ()
        # A unit given one dtype that returns another (an embedding named a unit): said where the check fails.
        self.dtype_change = dtype_change(path or type(unit).__name__, call, slot, parts[0] if parts else output)
        self._output_rest = tuple(None if isinstance(v, Tensor) else v for v in parts[1:])
        given = {id(t): j for j, t in enumerate(_argument_leaves(call, slot)) if isinstance(t, Tensor)}
        self._handed_back = tuple(given.get(id(v)) if isinstance(v, Tensor) else None for v in parts[1:])
        self._mode = "pass"  # pass | stop | emit
        self._recorded: list[UnitCall] | None = None
        self._emit: Tensor | None = None
        self._emitted = False  # in head: whether forward has reached this (the last) unit yet
        self._rewind: Callable[[], None] | None = None  # on emitting: the replay's random draws so far undone
        # Under the check on the example: the guard that follows what it passes on, and whether a layer is
        # recording the next units' calls through it (embed, a bridge) or replaying up to its carried state.
        self._stale: tuple[StandInGuard, bool] | None = None

    def train(self, mode: bool = True) -> UnitStub:
        """As a module's: its views (its submodules) take this mode too, from now on."""
        self._mode_set = True
        return super().train(mode)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            attributes = self.__dict__.get("attributes", {})
            if name in attributes:
                return attributes[name]
            if name in self.__dict__.get("submodules", {}):
                return self.__dict__["submodules"][name]
            if name in self.__dict__.get("inner", ()):
                raise FunctionalizeError(read_inside_unit(self.__dict__["path"], name)) from None
            raise

    def __getitem__(self, index: Any) -> Any:  # a Sequential or ModuleList unit indexed outside its call
        raise FunctionalizeError(read_inside_unit(self.path, str(index)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = UnitCall(args, kwargs)
        if self._recorded is not None:
            self._recorded.append(call)
        if self._mode == "stop":
            raise Stopped
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
            guard.mark(hidden, UnitOutput(self.path, recording))
        if self.output_type is None:
            return hidden
        rest = self._output_rest
        if any(j is not None for j in self._handed_back):
            given = _argument_leaves(call, self.slot)
            rest = tuple(v if j is None else given[j] for v, j in zip(rest, self._handed_back, strict=True))
        if self._model_output:
            return self.output_type(hidden, *rest)
        return self.output_type((hidden, *rest))


def _plain_attributes(module: nn.Module, private: bool = False) -> dict[str, Any]:
    """A module's public attributes that are neither modules nor tensors (``layer_idx``, ``batch_first``), and
    with ``private``, its private flags and numbers but nn.Module's own (``_qkv_same_embed_dim``)."""
    plain = {
        k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, (nn.Module, Tensor))
    }
    if private:
        plain.update(
            (k, v) for k, v in vars(module).items()
            if k.startswith("_") and k not in _MODULE_OWN and isinstance(v, bool | int | float | str | type(None))
        )
    return plain


_MODULE_OWN = frozenset(vars(nn.Module()))


class _Submodule:
    """A unit's submodule, read outside the unit's call: its plain attributes (taken at the split, as the stub's
    are; its mode its own at the split, the stub's once a train() or eval() reached the stub), its own submodules
    alike; its tensors and a call of it are refused."""

    def __init__(self, unit: str, name: str, module: nn.Module, stub: UnitStub) -> None:
        self._unit, self._name, self._stub, self._type = unit, name, stub, type(module)  # (name: in the unit)
        # Its mode at the split (a submodule may be in another than its unit's); the stub's once a train() or
        # eval() reached the stub, as it would have set this submodule's (UnitStub.train).
        self._mode_at_split = module.training
        self._attributes = _plain_attributes(module, private=True)
        # (its tensors, and what it holds that a view does not keep: a private container, its hooks)
        self._inner = {*module._parameters, *module._buffers, *vars(module)}
        self._submodules = {n: _Submodule(unit, f"{name}.{n}", m, stub) for n, m in module._modules.items() if m}

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(view, nn.MultiheadAttention), as on the module
        return self._type

    def __reduce__(self) -> tuple[Any, ...]:  # (pickle would build the class __class__ names)
        return _Submodule._restored, (dict(vars(self)),)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Submodule:
        # A copy of the stubbed model (eval_ran_before) copies its stand-ins: their views are of the copy.
        view = object.__new__(_Submodule)
        vars(view).update(vars(self))
        view._stub = memo.get(id(self._stub), self._stub)
        view._submodules = {name: copy.deepcopy(sub, memo) for name, sub in self._submodules.items()}
        memo[id(self)] = view
        return view

    @staticmethod
    def _restored(state: dict[str, Any]) -> _Submodule:
        view = object.__new__(_Submodule)
        vars(view).update(state)
        return view

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "training":
            mode = vars(self).get("_mode_at_split")  # (None: a view pickled before it, which reads the stub's)
            return self._stub.training if mode is None or vars(self._stub).get("_mode_set") else mode
        if name in self._attributes:
            return self._attributes[name]
        if name in self._submodules:
            return self._submodules[name]
        if name in self._inner or hasattr(self._type, name):  # a tensor, or a method (a call of the submodule)
            raise FunctionalizeError(read_inside_unit(self._unit, f"{self._name}.{name}"))
        raise AttributeError(f"{self._type.__name__!r} object at {self._unit}.{self._name} has no attribute {name!r}")

    def __getitem__(self, index: Any) -> Any:
        raise FunctionalizeError(read_inside_unit(self._unit, f"{self._name}.{index}"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise FunctionalizeError(read_inside_unit(self._unit, self._name))


def dtype_change(path: str, call: UnitCall, slot: Slot, hidden_out: Any) -> str | None:
    """What to say of a unit whose hidden state out has another dtype than the one it is given, where the check
    of the split on the example fails: the replays pass each unit's input on in its place, so an embedding named
    a unit hands the code after it the token ids as its output (Llama's rotary cos and sin cast to int64: 2e-3
    off, refused as a difference; a mask built from an integer dtype: torch's raw error). None for a unit that
    keeps the dtype; a unit whose output only passes on to the next unit (nanoGPT's embedding) trains as is."""
    kind, where = slot
    given = call.args[where] if kind == "arg" else call.kwargs.get(where)  # type: ignore[index, arg-type]
    if not (isinstance(given, Tensor) and isinstance(hidden_out, Tensor)) or given.dtype == hidden_out.dtype:
        return None
    return (
        f"unit {path!r} is given a {given.dtype} tensor and returns a {hidden_out.dtype} one: the layers around "
        "the units are replayed with each unit passing its input on in its place, so code after it that reads "
        "its output (its dtype, for a rotary embedding or a mask) reads its input instead. Leave it out of "
        "units (an embedding runs in 'embed'), and name the blocks that carry the hidden state."
    )


def _argument_leaves(call: UnitCall, slot: Slot) -> list[Any]:
    """A unit's arguments but its hidden state, as leaves (Nones among them, so that places agree)."""
    return optree.tree_leaves(without_hidden(call, slot), none_is_leaf=True)  # type: ignore[arg-type]


class UnitOutput(str):
    """The name :class:`StandInGuard` follows a unit's output by in a replay that passes it through;
    ``recording``: while a layer records the next units' calls (``embed``, a bridge), where code may read
    it (a loop's glue) but what the units receive must not come from it."""

    recording: bool

    def __new__(cls, path: str, recording: bool) -> UnitOutput:
        name = super().__new__(cls, path)
        name.recording = recording
        return name



def stubbed_root(root: nn.Module, paths: list[str], recording: Recording, segments: list[Segment]) -> nn.Module:
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
            parent._modules[attr] = UnitStub(root.get_submodule(path), i, seg.slot, recording.calls[i], path)
    return stubbed


def stubs_of(module: nn.Module) -> list[UnitStub]:
    return sorted((m for m in module.modules() if isinstance(m, UnitStub)), key=lambda s: s.index)


def set_stubs(
    stubs: list[UnitStub], recorded: list[UnitCall] | None = None, record: range = range(0),
    stop: int | None = None, emit: int | None = None, hidden: Tensor | None = None,
) -> UnitStub | None:
    """Set the stubs for one replay of forward: every one passes its hidden state on, those in ``record``
    record their calls in ``recorded``, the one at ``stop`` ends forward (``Stopped``), the one at
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


def clear_stubs(stubs: list[UnitStub]) -> None:
    """Drop what a replay left on the stubs (the recorded calls, the carried state): not held on."""
    for stub in stubs:
        stub._recorded, stub._emit, stub._rewind, stub._stale = None, None, None, None


_CHECKING = contextvars.ContextVar("checking_the_example", default=False)


@contextlib.contextmanager
def checking_the_example() -> Iterator[None]:
    """Inside the block (functionalize's check of the split on the example), the replays follow what their
    stubs pass on (:func:`follow_passed_outputs`); at a step's calls they do not: the view that follows it
    would be a use of a value tensor parallel leaves unsummed until used (a replayed embedding lookup)."""
    token = _CHECKING.set(True)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def checking() -> bool:
    """Whether functionalize is checking the split on the example (:func:`checking_the_example`)."""
    return _CHECKING.get()


def follow_passed_outputs(guard: Any, before: list[UnitStub], recording: list[UnitStub]) -> None:
    """Under the check on the example, mark what the stubs pass on (their input, not the unit's output):
    the code after the carried state must not use the output of a unit ``before`` it (a skip connection
    from an earlier unit's output into the head), since this layer has only the last one's; and no
    argument of the units ``recording`` records may be computed from one of theirs (a loop's glue making
    the next unit's argument from the hidden state). A unit that computes the identity on the example
    (a zero-initialised residual branch) would compare equal, and train wrong."""
    if isinstance(guard, StandInGuard) and _CHECKING.get():
        for stub in before:
            stub._stale = (guard, False)
        for stub in recording:
            stub._stale = (guard, True)


def eval_ran_before(stubbed: nn.Module, recording: Recording, gap: Gap) -> nn.Module:
    """A copy of ``stubbed`` (sharing tensors) whose modules that only run before ``gap`` are in eval
    mode: a replay from there on (``head``, a bridge) discards their output, so their dropout must not draw."""
    named = [*stubbed.named_parameters(remove_duplicate=False), *stubbed.named_buffers(remove_duplicate=False)]
    copied = copy.deepcopy(stubbed, {**kept_in_copies(stubbed), **{id(t): t for _, t in named}})
    units = [m for m in copied.modules() if isinstance(m, UnitStub)]
    for path, sub in copied.named_modules():
        holds_units = any(u in units for u in sub.modules())
        seen = recording.phase.get(path)
        if seen and max(seen) < gap and not holds_units:
            sub.train(False)
    return copied
