"""A stage's output handed to the next stage on the same rank, freed once nothing but the backward's root holds it.

Where a stage's backward runs on its own (under ZeRO-3 each unit is a stage, its backward between
the unit's gather and its reduce-scatter; a zero-bubble pipeline's two stages on one rank), the
executor keeps the stage's output as the root of that backward, and gives the next stage a detached
copy as its input. Autograd needs the root's graph, not its values: where the next stage's forward
kept nothing of it (a Linear's output, which the ReLU after it does not save: a plain torch loop
frees it there), holding its memory to the backward would cost one activation per layer that torch
does not hold. :func:`release_unkept` frees that memory (the storage resized to zero bytes, the
tensors staying valid as objects, as ZeRO-3 frees a unit's gathered parameters); anything that might
still read it keeps it: a saved input or view, an output kept by its own op (tensors on its storage,
owners of the copy: counted before and after the forward), a Python reference such as a checkpointed
layer's arguments, a custom Function's ``ctx`` attribute or a hook's closure (on the output or its
copy, held by no one but the executor's own containers, whose references are counted on stand-ins
held the same way: an exact match, so that the executor holding them in one place more or less frees
nothing rather than too much).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from ..torch_api import free_storage, holders, storage_key

_Counts = tuple[tuple[int, int], tuple[int, int]]


@dataclass(slots=True)
class Watched:
    output: torch.Tensor  # the stage's output: the root of its backward
    given: torch.Tensor  # its detached copy, the next stage's input leaf
    edge: Any  # the copy's gradient accumulator, made and held here so that its reference is in ``before``
    before: _Counts = ((0, 0), (0, 0))


def watch(handed: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[Watched]:
    """Before the next stage's forward: each (output, detached copy) whose memory only those two hold."""
    # Two tensors on the storage (the output and its copy), and nothing owning the output but its
    # Python object (no op of its own stage saved it as an input; an output its own op saved, as a
    # ReLU's, is a third tensor on the storage): looked at first, as it costs less than the rest.
    # An output no op of the stage made (a leaf: a parameter the layer hands on as it is, as DeBERTa's
    # embeddings hand their rel_embeddings table to every layer) is the state's own tensor: never freed.
    watched = [_watched(output, given) for output, given in handed
               if given.requires_grad and output.grad_fn is not None and holders(output)[:2] == (2, 1)
               and storage_key(output) == storage_key(given)]
    for w in watched:
        w.before = _counts(w)
    return watched


def release_unkept(watched: list[Watched]) -> None:
    """After the next stage's forward, the caller holding each output and its copy only where the
    executor holds them (its producing stage's saved outputs, the next stage's inputs, the list of
    pairs :func:`watch` was given; the tree the layers were given dropped): free each output's memory
    that nothing else holds."""
    expected = _executor_references()
    for w in watched:
        if _counts(w) == w.before and _references(w) == expected:
            free_storage(w.output)


def _watched(output: torch.Tensor, given: torch.Tensor) -> Watched:
    return Watched(output, given, get_gradient_edge(given))


def _counts(w: Watched) -> _Counts:
    """The tensors on the output's storage and the owners of each (not the Python references)."""
    (on_storage, owners, _), (_, given_owners, _) = holders(w.output), holders(w.given)
    return (on_storage, owners), (on_storage, given_owners)


def _references(w: Watched) -> tuple[int, int]:
    return sys.getrefcount(w.output), sys.getrefcount(w.given)


def _executor_references() -> tuple[int, int]:
    """The Python references :func:`_references` finds on an output and its copy held only as the
    executor holds them: in its producing stage's saved outputs, the next stage's inputs, the pairs
    handed over and the :class:`Watched`, with its gradient accumulator (a tensor some C++ object
    owns besides its Python object holds a reference to that object too)."""
    output, given = torch.empty(0), torch.empty(0, requires_grad=True)
    held = ([output], [given], [(output, given)])
    w = _watched(output, given)
    del output, given
    found = _references(w)
    del held
    return found
