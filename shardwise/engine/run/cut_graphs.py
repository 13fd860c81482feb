"""A backward whose graph leads into another stage's graph, or another rank's: refused on a step's first call.

The executor cuts each stage's graph at its input (a detached leaf) and runs the stage's backward for its
own leaves only (``accumulate_backward(inputs=)``): under ``shard_params(stage=3)`` every layer is a stage of
its own, under a pipeline every stage, under ZeRO-2 every gradient bucket's run of layers. A value that one
stage's forward computed and kept outside the chain's flow (a forward hook that appends a layer's output
to a list, a module attribute a forward sets) and that the loss, or a later layer, reads, leads that
backward into the other stage's graph, and the gradient along that way is dropped without an error: an
activation penalty on a hooked feature trained as if it were detached (its share of the gradient norm,
3e-3, gone). On thread ranks the hook's list is shared, and a rank may read another rank's activation.

On a step's first call on a thread, every stage's leaves are noted here (parameters and stage inputs,
with their names and rank), and every backward's graph is walked before it runs: a leaf it reaches that
it does not compute, and that a stage of a step made, is refused, naming both. Later calls cost nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import optree
import torch

from ..torch_api import is_fake

_LOCK = threading.Lock()
# id(leaf) -> (weak reference, its words, rank): the watched steps' leaves, in this process (thread ranks
# see each other's); a dead entry is skipped by ``_noted`` and dropped when the table grows.
_LEAVES: dict[int, tuple[weakref.ReferenceType[torch.Tensor], str, int]] = {}
_PRUNE_AT = [4096]


def note_leaves(leaves: Iterable[tuple[torch.Tensor, str]], rank: int) -> None:
    """Note a watched step's leaves (its parameters' and a stage's inputs), each with its words
    ("parameter 'weight' of layer '2'")."""
    with _LOCK:
        for t, words in leaves:
            _LEAVES[id(t)] = (weakref.ref(t), words, rank)
        if len(_LEAVES) > _PRUNE_AT[0]:
            for key in [k for k, (ref, _, _) in _LEAVES.items() if ref() is None]:
                del _LEAVES[key]
            _PRUNE_AT[0] = max(4096, 2 * len(_LEAVES))


def _noted(t: torch.Tensor) -> tuple[str, int] | None:
    entry = _LEAVES.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1], entry[2]


def reached_elsewhere(outputs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor]) -> tuple[str, int] | None:
    """The words and rank of a noted leaf that the graph from ``outputs`` reaches and ``wrt`` (the leaves
    its backward computes) does not hold; None where there is none."""
    mine = {id(t) for t in wrt}
    nodes = []
    for o in outputs:
        if o.grad_fn is not None:
            nodes.append(o.grad_fn)
        elif id(o) not in mine and (found := _noted(o)) is not None:  # an output that is itself a leaf
            return found
    seen = set(nodes)
    while nodes:
        node = nodes.pop()
        variable = getattr(node, "variable", None)  # (an AccumulateGrad node: a leaf's gradient goes there)
        if isinstance(variable, torch.Tensor):
            if id(variable) not in mine and (found := _noted(variable)) is not None:
                return found
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                nodes.append(nxt)
    return None


def refuse_reached_elsewhere(
    outputs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor], what: str, rank: int, alone: str
) -> None:
    """Refuse a backward (of ``what``: "the loss", "layer 'x'") that would reach a leaf it does not compute;
    ``alone`` says which backward runs alone ("the step runs the backward of layer 'x' alone")."""
    found = reached_elsewhere(outputs, wrt)
    if found is None:
        return
    words, owner_rank = found
    if owner_rank != rank:
        raise ValueError(
            f"the backward of {what} on rank {rank} reaches rank {owner_rank}'s {words}: it reads an activation "
            "that another rank computed, kept in an object the rank threads share (a forward hook that appends a "
            "layer's output to a list, a module attribute a forward sets), so this rank's loss would differ from "
            "the single-device step's. Pass the value along the chain instead: return it with the layer's output "
            "(and the model's) and compute the term in loss_fn from the output"
        )
    raise ValueError(
        f"the backward of {what} reaches {words}, outside the layers it runs backward through: it reads a "
        "value another layer's forward computed and kept outside the chain's flow (a forward hook that appends a "
        f"layer's output to a list, a module attribute a forward sets), and {alone}, so "
        "the gradient through that value would be dropped (the single-device step keeps it). Pass the value "
        "along the chain instead: return it with the layer's output (and the model's) and compute the term in "
        "loss_fn from the output, or compute the term inside the layer that makes the value"
    )


class ReadsOutsideChain(ValueError):
    """loss_fn returned a fake tensor (``refuse_fake_loss``)."""


def refuse_fake_loss(got: Any) -> None:
    """Refuse a loss_fn whose result is a fake tensor: it read a value that a run of the layers on fake tensors
    (the step predicting its outputs' shapes) left outside the chain, where the layers' forwards keep values."""
    if any(is_fake(t) for t in optree.tree_leaves(got)):
        raise ReadsOutsideChain(
            "loss_fn returned a fake tensor: it, or the model's output it is computed from, read a tensor that a "
            "run of the layers on fake tensors left behind (the step runs them so to predict its outputs' shapes, "
            "before the first call that cuts the batch or splits the model): a value a layer's forward keeps outside "
            "the chain's flow (a forward hook that appends a layer's output to a list, a module attribute a forward "
            "sets, in an object the module holds), which the step cannot tell from its own. Pass the value along the "
            "chain instead: return it with the layer's output (and the "
            "model's) and compute the term in loss_fn from the output, or compute the term inside the layer that "
            "makes the value"
        )
