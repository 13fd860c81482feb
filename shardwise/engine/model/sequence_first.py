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
"""

from __future__ import annotations

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
    its own; a hook on the first thread's would not hear them)."""
    found: dict[str, nn.Module] = {}
    for path, module in called_modules(chain, this_thread=True):
        if isinstance(module, SEQUENCE_FIRST) and getattr(module, "batch_first", True) is False:
            found.setdefault(path, module)
    return list(found.items())


def rows_on_sequence_dim(
    modules: list[tuple[str, nn.Module]], run_fake: Callable[[Any], Any], inputs: Any
) -> list[tuple[str, nn.Module | None, tuple[int, ...]]]:
    """Those of ``modules`` (:func:`sequence_first_modules`) whose input's dim 0 follows the rows of
    ``inputs`` (a micro-batch, rows on dim 0), each with the shape it got on the larger run; ``run_fake(inputs)``
    runs the model on fake tensors (None where it stopped: the modules it reached before still count)."""
    if not modules:
        return []
    one = optree.tree_map(lambda t: torch.cat([t, t[:1]]) if _batched(t) else t, inputs)
    two = optree.tree_map(lambda t: torch.cat([t, t[:1]]) if _batched(t) else t, one)
    seen: dict[str, list[tuple[int, ...]]] = {}
    me = threading.get_ident()  # thread ranks share the modules: hear only this rank's fake run

    def hook(path: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if args and isinstance(args[0], PackedSequence):
                return  # its data is [sum of the lengths, ...]: no dim is the rows (pack_padded_sequence read them)
            first = next(_tensors(args, kwargs), None)
            if first is not None and threading.get_ident() == me and len(seen.setdefault(path, [])) < 2:
                seen[path].append(tuple(first.shape))
        return record

    handles = [module.register_forward_pre_hook(hook(path), with_kwargs=True) for path, module in modules]
    packs = _Packs(lambda shape: seen.setdefault(PACKED, []).append(shape) if len(seen.get(PACKED, [])) < 2 else None)
    try:
        for rows in (one, two):
            before = {path: len(shapes) for path, shapes in seen.items()}
            with packs:
                run_fake(rows)
            for path in seen:  # a module called more than once per forward: its first call of each run
                del seen[path][before.get(path, 0) + 1:]
    finally:
        for handle in handles:
            handle.remove()
    found = []
    for path, module in [*modules, (PACKED, None)]:
        shapes = seen.get(path, [])
        if len(shapes) != 2:
            continue  # reached by one run only (the other stopped before it): nothing to compare
        if len(shapes[0]) == len(shapes[1]) and shapes[0] and shapes[0][0] != shapes[1][0]:
            found.append((path, module, shapes[1]))
    return found


# What :func:`rows_on_sequence_dim` names a time-major pack by: pack_padded_sequence(batch_first=False) reads the
# sequence on dim 0 of its padded input, whatever the RNN it feeds was built with (a packed input has no layout).
PACKED = "pack_padded_sequence(batch_first=False)"


class _Packs(TorchFunctionMode):
    """Hears torch's packing of a padded batch (pack_padded_sequence, pack_sequence) with batch_first=False and
    reports its input's shape: on fake tensors it stops there (the packed data's length is the lengths' sum)."""

    def __init__(self, report: Callable[[tuple[int, ...]], None]) -> None:
        super().__init__()
        self.report, self.thread = report, threading.get_ident()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "_pack_padded_sequence" and threading.get_ident() == self.thread:
            first = args[2] if len(args) > 2 else kwargs.get("batch_first", False)
            if not first and isinstance(args[0], torch.Tensor):
                self.report(tuple(args[0].shape))
        return func(*args, **kwargs)


def _batched(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors a module is called with, positional first (its input, query, src)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
