"""The zero stand-ins for the parameters a replay of the call-recording split (``capture.py``) does not
hold, and the guard that refuses a use of one (or, on the example, of a unit's output passed through) that
could reach the layer's output, naming it: on functionalize's example in every replay, and at every call
after it in ``embed`` and the bridges (``head`` holds every parameter the code before the units reads)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .carry import (
    EMBED,
)
from .changed_inputs import ChangedInput
from .fx_split import FunctionalizeError
from .tensor_reads import StandInGuard
from .unit_stubs import UnitOutput, checking


class Placeholders:
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


def stand_in_guard(
    layer: str, stand_ins: dict[str, Tensor], counts: Callable[[], bool], between: str = "", always: bool = True
) -> contextlib.AbstractContextManager[Any]:
    """A :class:`StandInGuard` over ``layer``'s stand-ins: on the example (functionalize's check: a stand-in
    that happens to equal the weight, a zero-initialised one, would pass the comparison with the module),
    and, where ``always``, on every batch after it, which may take a branch the example did not (a projector
    that runs only on rows holding a special token, before the units: its parameter's stand-in read as
    zeros in ``embed``, and its gradient dropped, without an error). ``head`` guards on the example only: it
    replays the code before the units too (discarded), and under the guard's Python mode that cost a tiny
    model's step 12 to 18%; it holds every parameter that code reads, so its stand-ins are the tables read
    only before the units. ``between``: for a bridge, the two units it runs between (``'a' and 'b'``)."""
    if not always and not checking():
        return contextlib.nullcontext()

    def refuse(name: str, op: str) -> FunctionalizeError | None:
        if isinstance(name, UnitOutput):
            return None if name.recording and op != "return" else stale_output_read(layer, name, op, between)
        if isinstance(name, ChangedInput):
            return changed_input_read(layer, name, op, between)
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
                "units=(EncoderLayer, DecoderLayer), its model called with use_cache=False: the decoder's "
                "key/value cache is such a value too), or pass as units layers that run before the code computing "
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
            "that reads it run the same way on every call, pass functionalize an example_input on which it runs "
            "as here (a batch that takes every branch), or split with units=None (one layer holds every "
            "parameter)."
        )

    return StandInGuard(stand_ins, counts, refuse)


def stale_output_read(layer: str, unit: UnitOutput, op: str, between: str) -> FunctionalizeError:
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
               "model's own loss; an encoder-decoder's model called with use_cache=False: the decoder's "
               "key/value cache is such a value too)")
    where = f"the code between units {between}" if between else "the code after the last unit"
    return FunctionalizeError(
        f"functionalize: {where} (layer {layer!r}) uses the output of unit {unit!r} and {how}, but only the "
        "hidden state of the last unit before that code passes into the layer: there it sees the input unit "
        f"{unit!r} was given instead. {fix}, or pass units that keep the code and what it reads together "
        "(a larger unit, or units=None for one layer)."
    )


def changed_input_read(layer: str, name: str, op: str, between: str) -> FunctionalizeError:
    """The refusal of the code after a replay's carried state using a value the code before it computed
    from an input forward changes in place (``changed_inputs.py``)."""
    where = f"the code between units {between}" if between else "the code after the last unit"
    how = "hands the units after it" if op == "return" and between else (
        "returns" if op == "return" else f"reads (in {op}())")
    return FunctionalizeError(
        f"functionalize: {where} (layer {layer!r}) {how} a value that forward computes, before the units, from "
        f"the input {name!r}, which forward changes in place (as Whisper's SpecAugment masks input_features). "
        f"Layer {layer!r} runs that code again on the input as an earlier layer left it, changed already, and "
        "changes it again with its own random draws, so the value is not the module's. Compute it from a copy "
        "(x = x.clone() before the in-place change), or turn the in-place change off (config.apply_spec_augment"
        "=False), or split with units=None (one layer)."
    )
