"""The layers of the call-recording split (``capture.py``) that replay the model's forward with its units
stubbed: ``embed`` up to the first segment's last unit, a bridge between two segments, ``head`` after the
last unit; and what each replay needs: the generators put back where it reaches its carried state, a
forward ended at a stub, the carry read off the calls it recorded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

from ..torch_api import is_fake
from . import host_random
from .capture_refusals import WHICH_UNITS_RUN
from .carry import (
    EMBED,
    HEAD,
    Layout,
    Segment,
    UnitCall,
)
from .changed_inputs import LeafIndices, replaying_changed, with_copies
from .fx_split import FunctionalizeError
from .module_call import ModuleCall, ThreadReplicas, call_arguments
from .pytrees import register_output_types
from .stand_ins import Placeholders, stand_in_guard
from .tensor_reads import StandInGuard
from .unit_layer import own_copies
from .unit_stubs import Stopped, UnitStub, clear_stubs, follow_passed_outputs, set_stubs, stubs_of


def rewinder(carried: Tensor, host: list[bool] | None = None) -> Callable[[], None]:
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


def in_turn(*steps: Callable[[], None]) -> Callable[[], None]:
    """One call that makes each of ``steps`` in turn."""

    def run() -> None:
        for step in steps:
            step()

    return run


def run_to_stop(
    call: ModuleCall, tensors: dict[str, Tensor], args: Any, kwargs: Any,
    guard: contextlib.AbstractContextManager[Any], stubs: list[UnitStub], stop: int,
) -> None:
    """Forward up to the stub at ``stop``, which ends it."""
    try:
        with guard:
            call.call(tensors, args, kwargs)
    except Stopped:
        return
    raise FunctionalizeError(
        f"functionalize: forward did not reach unit {stubs[stop].path!r} on this input, as it did on the example"
        f"{WHICH_UNITS_RUN}"
    )


def refuse_unreached(stub: UnitStub, layer: str) -> None:
    """A replay that never reached the unit giving the carried state computed without it (the code after a
    skipped last unit reads what the replay passed through instead): refused, not returned."""
    if not stub._emitted:
        raise FunctionalizeError(
            f"functionalize: layer {layer!r} replayed forward, which did not reach unit {stub.path!r} this time "
            f"(it did on the example), so it would compute without the state carried to it{WHICH_UNITS_RUN}"
        )


def carry_of_segment(
    layout: Layout, seg: Segment, recorded: list[UnitCall], x: Any, tensors: dict[str, Tensor]
) -> tuple[Tensor, ...]:
    """The carry of the units of ``seg`` from the calls a replay recorded of them."""
    if len(recorded) != seg.stop - seg.start:
        raise FunctionalizeError(
            f"functionalize: forward called {len(recorded)} of the units {layout.paths[0]!r} .. "
            f"{layout.paths[-1]!r} on this input, but {seg.stop - seg.start} on the example{WHICH_UNITS_RUN}"
        )
    kind, where = seg.slot
    first = recorded[0]
    hidden = first.args[where] if kind == "arg" else first.kwargs[where]  # type: ignore[index]
    return own_copies(layout.carry(hidden, recorded, x), tensors)


class EmbedFn:
    """``root(x)`` up to the last unit of the first segment: returns its carry."""

    def __init__(
        self, stubbed: nn.Module, layout: Layout, seg: Segment, placeholders: Placeholders, changed: LeafIndices = (),
    ) -> None:
        self.replicas = ThreadReplicas(stubbed)
        self.layout, self.seg, self.placeholders = layout, seg, placeholders
        self.changed = changed  # the input's tensors forward changes in place: it changes copies

    def reuse_key(self) -> Hashable | None:
        """Itself: one of a chain (nothing else computes alike), the same under every layout of a plan
        search (``engine/model/reuse.py``'s ``sharing_runs``); the key holds it, so it stays itself."""
        return (EmbedFn, self)

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> tuple[Tensor, ...]:
        call = self.replicas.get()
        stubs = stubs_of(call.module)
        recorded: list[UnitCall] = []
        stop = self.seg.stop - 1
        set_stubs(stubs, recorded, range(self.seg.start, self.seg.stop), stop=stop)
        x, _ = with_copies(x, self.changed)
        args, kwargs = call_arguments(call.module, x)
        stand_ins = self.placeholders.make(tensors)
        guard = stand_in_guard(EMBED, stand_ins, lambda: True)
        follow_passed_outputs(guard, [], stubs[self.seg.start:stop])
        try:
            run_to_stop(call, {**tensors, **stand_ins}, args, kwargs, guard, stubs, stop)
        finally:
            clear_stubs(stubs)
        out = carry_of_segment(self.layout, self.seg, recorded, x, tensors)
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
        placeholders: Placeholders, changed: LeafIndices = (),
    ) -> None:
        self.replicas = ThreadReplicas(stubbed)
        self.name, self.placeholders = name, placeholders
        self.changed = changed  # as HeadFn's
        (self.before, self.previous), (self.layout, self.seg) = before, after
        self.between = f"{self.before.paths[-1]!r} and {self.layout.paths[0]!r}"
        self._host = [True, True]  # as HeadFn's

    def reuse_key(self) -> Hashable | None:
        """Itself, as ``embed``'s and ``head``'s."""
        return (BridgeFn, self)

    def __call__(self, tensors: dict[str, Tensor], carry: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        call = self.replicas.get()
        stubs = stubs_of(call.module)
        recorded: list[UnitCall] = []
        stop = self.seg.stop - 1
        emitting = set_stubs(stubs, recorded, range(self.seg.start, self.seg.stop), stop=stop,
                              emit=self.previous.stop - 1, hidden=carry[0])
        assert emitting is not None
        rewind = rewinder(carry[0], self._host)
        stand_ins = self.placeholders.make(tensors)
        guard = stand_in_guard(self.name, stand_ins, lambda: emitting._emitted, self.between)
        x, put_back = replaying_changed(self.before.inputs.rebuild(carry), self.changed, guard)
        emitting._rewind = in_turn(rewind, put_back)
        args, kwargs = call_arguments(call.module, x)
        follow_passed_outputs(guard, stubs[: self.previous.stop - 1], stubs[self.seg.start:stop])
        try:
            run_to_stop(call, {**tensors, **stand_ins}, args, kwargs, guard, stubs, stop)
        finally:
            clear_stubs(stubs)
        refuse_unreached(emitting, self.name)
        out = carry_of_segment(self.layout, self.seg, recorded, x, tensors)
        if isinstance(guard, StandInGuard):
            guard.check_returned(out)
        return out

    def __repr__(self) -> str:
        return f"bridge({type(self.replicas.module).__name__} between units {self.between})"


class HeadFn:
    """``root(x)`` with the units stubbed and the last one giving the carried hidden state."""

    def __init__(
        self, stubbed: nn.Module, layout: Layout, placeholders: Placeholders, changed: LeafIndices = (),
    ) -> None:
        self.replicas = ThreadReplicas(stubbed)
        self.layout, self.placeholders = layout, placeholders
        # The input's tensors forward changes in place: its replay changes copies of the carried ones, and
        # puts the carried values back into them at the carried state (changed_inputs.py).
        self.changed = changed
        self._host = [True, True]  # whether its replay draws from Python's / numpy's generators; unknown yet

    def reuse_key(self) -> Hashable | None:
        """Itself: one of a chain (nothing else computes alike), the same under every layout of a plan
        search (``engine/model/reuse.py``'s ``sharing_runs``); the key holds it, so it stays itself."""
        return (HeadFn, self)

    def __call__(self, tensors: dict[str, Tensor], carry: tuple[Tensor, ...]) -> Any:
        call = self.replicas.get()
        stubs = stubs_of(call.module)
        last = set_stubs(stubs, emit=len(stubs) - 1, hidden=carry[0])
        assert last is not None
        rewind = rewinder(carry[0], self._host)
        stand_ins = self.placeholders.make(tensors)
        guard = stand_in_guard(HEAD, stand_ins, lambda: last._emitted, always=False)
        x, put_back = replaying_changed(self.layout.inputs.rebuild(carry), self.changed, guard)
        last._rewind = in_turn(rewind, put_back)
        args, kwargs = call_arguments(call.module, x)
        follow_passed_outputs(guard, stubs[:-1], [])
        try:
            with guard:
                out = call.call({**tensors, **stand_ins}, args, kwargs)
        finally:
            clear_stubs(stubs)
        refuse_unreached(last, HEAD)
        if isinstance(guard, StandInGuard):
            guard.check_returned(out)
        return register_output_types(out)

    def __repr__(self) -> str:
        return f"head({type(self.replicas.module).__name__} after its last unit)"
