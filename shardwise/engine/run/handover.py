"""A stage's output handed to the next stage on the same rank, freed once nothing but the backward's root holds it.

Where a stage's backward runs on its own (under ZeRO-3 each unit is a stage, its backward between
the unit's gather and its reduce-scatter), the executor keeps the stage's output as the root of that
backward, and gives the next stage a detached copy as its input. Autograd needs the root's graph, not
its values: where the next stage's forward kept nothing of it (a Linear's output, which the ReLU after
it does not save: a plain torch loop frees it there), holding its memory to the backward would cost
one activation per layer that torch does not hold. :func:`release_unkept` frees that memory (the
storage resized to zero bytes, the tensors staying valid as objects, as ZeRO-3 frees a unit's gathered
parameters); anything that might still read it (a saved input or view, an output kept by its own op,
a Python reference such as a checkpointed layer's arguments) changes the counts :func:`watch` takes
before the forward, and the memory stays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from ..torch_api import free_storage, holders, storage_key

_Counts = tuple[tuple[int, int, int], tuple[int, int, int]]


@dataclass(slots=True)
class Watched:
    output: torch.Tensor  # the stage's output: the root of its backward
    given: torch.Tensor  # its detached copy, the next stage's input leaf
    edge: Any  # the copy's gradient accumulator, made and held here so that its reference is in ``before``
    before: _Counts = ((0, 0, 0), (0, 0, 0))


def watch(handed: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[Watched]:
    """Before the next stage's forward: each (output, detached copy) whose memory only those two hold.
    The caller keeps ``handed`` and the copies as they are until :func:`release_unkept`: the Python
    references are counted in both snapshots."""
    # Two tensors on the storage (the output and its copy), and nothing owning the output but its
    # Python object (no op of its own stage saved it as an input; an output its own op saved, as a
    # ReLU's, is a third tensor on the storage): looked at first, as it costs less than the rest.
    watched = [_watched(output, given) for output, given in handed
               if given.requires_grad and holders(output)[:2] == (2, 1) and storage_key(output) == storage_key(given)]
    for w in watched:
        w.before = _counts(w)
    return watched


def release_unkept(watched: list[Watched]) -> None:
    """After the next stage's forward: free each watched output's memory that the forward kept nothing of."""
    for w in watched:
        if _counts(w) == w.before:
            free_storage(w.output)


def _watched(output: torch.Tensor, given: torch.Tensor) -> Watched:
    return Watched(output, given, get_gradient_edge(given))


def _counts(w: Watched) -> _Counts:
    return holders(w.output), holders(w.given)
