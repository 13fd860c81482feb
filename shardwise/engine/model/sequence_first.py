"""torch modules that take the sequence on dim 0 (``batch_first=False``), and whether a batch's rows reach them there.

``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` / ``DecoderLayer``, ``nn.Transformer`` and the
recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) read ``(seq, batch, ...)`` unless built with
``batch_first=True``: their default. A step that cuts the batch cuts dim 0 of every batch tensor (its
rows). Fed time-major batches (``(seq, batch, ...)`` as those modules want them), each part then holds a
slice of every sequence, and the module attends over (or runs its recurrence along) that slice alone:
another model than the single-device step's, without an error. A model that transposes the rows to dim 1
before calling such a module (Hugging Face's Encodec and BridgeTower do) is cut correctly.

:func:`rows_on_sequence_dim` tells the two apart from shapes alone: it runs the chain on fake tensors
(``run_fake``) on a micro-batch with its first row added once and twice (shapes the step's run never has,
so a layer that watches its first call per input shape, context parallel's, still watches the run's), and
reads the input each such module gets. The dims that change are where the rows went; dim 0 among them
means the rows are the module's sequence. A run that stops (data-dependent code on fake tensors) still
answers for the modules it reached in both.

torch functionals that are time-major by contract are heard the same way, by a TorchFunctionMode over both runs:
``F.multi_head_attention_forward`` (query, key and value are always ``(L, N, E)``; Hugging Face's WavLM and a
user's layer holding the weights as parameters call it), ``F.ctc_loss`` (log-probabilities ``(T, N, C)``) and
the packing of a padded batch with ``batch_first=False``. A call is named by its call site (the first frame
outside torch), so two calls are two entries. Where nothing time-major is called, the first run answers
(no second one); engine/step/sequence_cut.py runs this only where the model holds a sequence-first module or its
code names such a functional (time_major_code.py), once per layout and rank.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.overrides import TorchFunctionMode

from .chain import Chain
from .whole_batch import called_modules

# Modules whose batch_first=False (the default) reads the sequence on dim 0 of a batched input, and
# the sequence on dim 0 of an unbatched one either way.
SEQUENCE_FIRST = (nn.RNNBase, nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                  nn.Transformer)


def sequence_first_modules(chain: Chain) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module of ``chain`` that takes its sequence on dim 0 (``batch_first=False``): the
    calling thread's copies, which its calls run (a thread rank that ran the chain before, for a Plan, holds
    its own; a hook on the first thread's would not hear them). Looked for first in the modules the chain
    holds, whose copies have their types and settings: a thread makes no copy of a module it may never call
    (a pipeline rank, another stage's) where none is found."""
    if not any(_sequence_first(module) for _, module in called_modules(chain)):
        return []
    found: dict[str, nn.Module] = {}
    for path, module in called_modules(chain, this_thread=True):
        if _sequence_first(module):
            found.setdefault(path, module)
    return list(found.items())


# Their layers' batch_first says theirs: a stack of sequence-first layers takes (seq, batch, ...) too. Heard on the
# stack itself: its forward compares a float mask with a causal one (torch's _detect_is_causal_mask), data a fake
# run cannot read, so the run stops there, before the layers' attentions (PyTorch's language-model tutorial).
SEQUENCE_FIRST_STACKS = (nn.TransformerEncoder, nn.TransformerDecoder)


def _sequence_first(module: nn.Module) -> bool:
    if isinstance(module, SEQUENCE_FIRST_STACKS):
        # torch's own layers only (or their stand-ins in a split): a layer of the user's may hold a sequence-first
        # attention and transpose batch-first rows around it, where the stack's input is batch-first.
        try:
            first = module.layers[0]
            if type(first).forward not in (nn.TransformerEncoderLayer.forward, nn.TransformerDecoderLayer.forward) \
                    and not _stands_in_for_torchs_layer(first):
                return False
            return first.self_attn.batch_first is False
        except (AttributeError, IndexError, TypeError):  # (layers of another kind: their attentions are heard)
            return False
    return isinstance(module, SEQUENCE_FIRST) and getattr(module, "batch_first", True) is False


def _stands_in_for_torchs_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a split's stand-in for torch's own encoder or decoder layer (the unit itself is not
    here: the stand-in keeps its type, ``UnitStub._unit_type``)."""
    return getattr(module, "_unit_type", None) in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def rows_on_sequence_dim(
    modules: list[tuple[str, nn.Module]], run_fake: Callable[[Any], Any], inputs: Any,
    unheard: list[tuple[str, nn.Module]] | None = None,
) -> list[tuple[str, nn.Module | None, tuple[int, ...]]]:
    """Those of ``modules`` (:func:`sequence_first_modules`), and the time-major functional calls (named as
    :func:`describe` reads them, with no module), whose input's dim 0 follows the rows of ``inputs`` (a
    micro-batch, rows on dim 0), each with the shape it got on the larger run; ``run_fake(inputs)`` runs the
    model on fake tensors (None where it stopped: what it reached before still counts). Those of ``modules``
    that a run which stopped never reached (code before them reads the batch's values: ``if mask.any()``) go
    into ``unheard``: nothing tells whether the rows reach them on dim 0."""
    one = optree.tree_map(lambda t: torch.cat([t, t[:1]]) if _batched(t) else t, inputs)
    two = optree.tree_map(lambda t: torch.cat([t, t[:1]]) if _batched(t) else t, one)
    seen: dict[str, list[tuple[int, ...]]] = {}
    me = threading.get_ident()  # thread ranks share the modules: hear only this rank's fake run

    def note(path: str, shape: tuple[int, ...]) -> None:
        if threading.get_ident() == me and len(seen.setdefault(path, [])) < 2:
            seen[path].append(shape)

    def hook(path: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if args and isinstance(args[0], PackedSequence):
                return  # its data is [sum of the lengths, ...]: no dim is the rows (pack_padded_sequence read them)
            first = next(_tensors(args, kwargs), None)
            if first is not None:
                note(path, tuple(first.shape))
        return record

    handles = [module.register_forward_pre_hook(hook(path), with_kwargs=True) for path, module in modules]
    calls = _TimeMajorCalls(note)
    stopped = False
    try:
        for rows in (one, two):
            before = {path: len(shapes) for path, shapes in seen.items()}
            with calls:
                stopped |= run_fake(rows) is None
            if not seen:
                if stopped and unheard is not None:
                    unheard.extend(modules)
                return []  # nothing time-major was called: no second run
            for path in seen:  # a module (a call site) reached more than once per forward: its first call of each run
                del seen[path][before.get(path, 0) + 1:]
    finally:
        for handle in handles:
            handle.remove()
    if stopped and unheard is not None:
        unheard.extend((path, module) for path, module in modules if not seen.get(path))
    found = []
    for path, module in [*modules, *((path, None) for path in seen if not any(path == p for p, _ in modules))]:
        shapes = seen.get(path, [])
        if len(shapes) != 2:
            continue  # reached by one run only (the other stopped before it): nothing to compare
        if len(shapes[0]) == len(shapes[1]) and shapes[0] and shapes[0][0] != shapes[1][0]:
            found.append((path, module, shapes[1]))
    return found


def describe(path: str, module: nn.Module | None) -> tuple[str, str]:
    """(what takes its sequence on dim 0, how to give it the rows on its batch dim) for a find of
    :func:`rows_on_sequence_dim`."""
    if isinstance(module, SEQUENCE_FIRST_STACKS):
        return (f"{path!r} ({type(module).__name__} of batch_first=False layers)",
                "build its layers with batch_first=True (or transpose the rows to dim 1 in the model's forward before "
                "calling it)")
    if module is not None:
        return (f"{path!r} ({type(module).__name__}, batch_first=False)",
                "build the module with batch_first=True (or transpose the rows to dim 1 in the model's forward before "
                "calling it)")
    if path == PACKED:
        return f"torch's {path}", "pack with batch_first=True"
    return path, "transpose the rows to dim 1 before that call (h.transpose(0, 1); its output back after it)"


# What :func:`rows_on_sequence_dim` names a time-major pack by: pack_padded_sequence(batch_first=False) reads the
# sequence on dim 0 of its padded input, whatever the RNN it feeds was built with (a packed input has no layout).
PACKED = "pack_padded_sequence(batch_first=False)"

# torch functionals whose first argument is time-major by contract ((L, N, E), (T, N, C)), by __name__ (torch's
# own ctc_loss has F.ctc_loss's); an unbatched call ((L, E)) takes its sequence on dim 0 too.
TIME_MAJOR = {"multi_head_attention_forward": "torch.nn.functional.multi_head_attention_forward",
              "ctc_loss": "torch.nn.functional.ctc_loss"}
_TORCH = os.path.dirname(torch.__file__) + os.sep
_DISPATCH = {torch.overrides.__file__, torch.nn.functional.__file__}


class _TimeMajorCalls(TorchFunctionMode):
    """Hears the calls of the TIME_MAJOR functionals and torch's packing of a padded batch (pack_padded_sequence,
    pack_sequence) with batch_first=False, reporting each its input's shape (on fake tensors a pack stops there:
    the packed data's length is the lengths' sum)."""

    def __init__(self, report: Callable[[str, tuple[int, ...]], None]) -> None:
        super().__init__()
        self.report = report

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "_pack_padded_sequence":
            first = args[2] if len(args) > 2 else kwargs.get("batch_first", False)
            if not first and isinstance(args[0], torch.Tensor):
                self.report(PACKED, tuple(args[0].shape))
        elif name in TIME_MAJOR and args and isinstance(args[0], torch.Tensor):
            site = _call_site()
            if site is not None:
                self.report(f"{TIME_MAJOR[name]} (called at {site})", tuple(args[0].shape))
        return func(*args, **kwargs)


def _call_site() -> str | None:
    """``file:line in function`` of the first frame outside torch that led to the functional's call (for
    nn.CTCLoss's call of F.ctc_loss, the code that called the loss module); None where a sequence-first module
    (nn.MultiheadAttention) made the call: it is heard as a module (batch_first=False), or moved its batch to
    dim 1 itself (True)."""
    frame = sys._getframe(2)  # past __torch_function__
    while frame.f_back is not None and (frame.f_code.co_filename in _DISPATCH
                                        or frame.f_code.co_name == "__torch_function__"):
        frame = frame.f_back  # torch's dispatch to the modes (another one may be the caller), then the functional
    if isinstance(frame.f_locals.get("self"), SEQUENCE_FIRST):
        return None
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _batched(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors a module is called with, positional first (its input, query, src)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
