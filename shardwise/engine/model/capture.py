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
segments and lays out the carry. This module cuts the model and decides which layer holds which
parameter; ``recording.py`` records the example run, ``unit_stubs.py`` the stubs standing in for the
units, ``replay.py`` the ``embed``, bridge and ``head`` layers that replay forward around them,
``unit_layer.py`` a unit's own layer, ``stand_ins.py`` the parameters a replay does not hold, and
``capture_refusals.py`` what is refused about the model as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from .capture_refusals import refuse_clash, refuse_layerdrop
from .carry import (
    BRIDGE,
    EMBED,
    HEAD,
    Layout,
    Segment,
    segments_of,
)
from .fx_split import FunctionalizeError
from .recording import Gap, Recording, carry_writes, record_calls, refuse_read_extras
from .replay import BridgeFn, EmbedFn, HeadFn
from .stand_ins import Placeholders
from .unit_layer import UnitFn
from .unit_stubs import eval_ran_before, stubbed_root

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


def split_by_calls(
    root: nn.Module, paths: list[str], example: Any, ordered: bool, fake_units: bool = False
) -> list[tuple[str, Piece]]:
    """``embed``, one piece per unit, ``head``, and a ``bridge`` between two segments of units (an
    encoder's layers and a decoder's): the layers of the call-recording split.

    ``ordered``: the paths were listed by the user, and must be in execution order.
    ``fake_units``: record the units and the code after them on fake tensors (see ``record_calls``)."""
    refuse_clash(paths, (EMBED, HEAD))
    refuse_layerdrop(root)
    recording = record_calls(root, paths, example, fake_units)
    if recording.executed != paths:
        if ordered:
            raise FunctionalizeError(
                "functionalize: units must be listed in the order forward runs them; forward runs "
                f"{recording.executed}"
            )
        paths = recording.executed
        recording = record_calls(root, paths, example, fake_units)
    refuse_read_extras(recording, root, paths)
    segments = segments_of(paths, recording.calls)
    bridges = _bridge_names(len(segments))
    refuse_clash(paths, bridges)
    layouts = [
        Layout(paths[seg.start:seg.stop], recording.calls[seg.start:seg.stop], seg.slot, example) for seg in segments
    ]
    writes = carry_writes(paths, recording, segments, layouts)
    stubbed = stubbed_root(root, paths, recording, segments)
    owned = _phase_params(root, paths, recording, segments)
    params = list(stubbed.named_parameters())
    buffers = list(stubbed.named_buffers())

    def phase(ids: set[int]) -> tuple[list[tuple[str, Tensor]], Placeholders]:
        real: list[tuple[str, Tensor]] = [(n, p) for n, p in params if id(p) in ids or not p.requires_grad]
        fake = {n: (p.shape, p.dtype) for n, p in params if not (id(p) in ids or not p.requires_grad)}
        return real, Placeholders(fake, {n: p.dtype for n, p in real if p.is_floating_point()})

    pieces: list[tuple[str, Piece]] = []
    for k, (seg, layout) in enumerate(zip(segments, layouts, strict=True)):
        real, fake = phase(owned[k])
        if k == 0:
            pieces.append((EMBED, Piece(EmbedFn(stubbed, layout, seg, fake, recording.changed), real, buffers)))
        else:
            replay = eval_ran_before(stubbed, recording, seg.start)
            previous = (layouts[k - 1], segments[k - 1])
            fn = BridgeFn(replay, bridges[k - 1], previous, (layout, seg), fake, recording.changed)
            pieces.append((bridges[k - 1], Piece(fn, real, buffers)))
        for i in range(seg.start, seg.stop):
            unit, path = root.get_submodule(paths[i]), paths[i]
            pieces.append((path, Piece(
                UnitFn(unit, path, i - seg.start, layout, seg.slot, writes.get(i, ())),
                list(unit.named_parameters(prefix=path)),
                list(unit.named_buffers(prefix=path)),
            )))
    head_params, head_fake = phase(owned[-1])
    head_root = eval_ran_before(stubbed, recording, len(paths))
    pieces.append((HEAD, Piece(HeadFn(head_root, layouts[-1], head_fake, recording.changed), head_params, buffers)))
    return pieces


def _bridge_names(segments: int) -> list[str]:
    """The name of each bridge: ``"bridge"`` for the one between two segments, else ``"bridge.1"``, ..."""
    if segments <= 2:
        return [BRIDGE] * (segments - 1)
    return [f"{BRIDGE}.{k}" for k in range(1, segments)]



def _region(gap: Gap, segments: list[Segment], units: int) -> int:
    """Which layer runs the code of ``gap`` for real: 0 ``embed``, k the bridge into segment k (the code
    between two of its units included: it records their calls), ``len(segments)`` ``head``."""
    if gap == units:
        return len(segments)
    return next(k for k, seg in enumerate(segments) if seg.start <= gap < seg.stop)


def _phase_params(
    root: nn.Module, paths: list[str], recording: Recording, segments: list[Segment]
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
