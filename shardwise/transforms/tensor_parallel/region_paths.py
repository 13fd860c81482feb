"""Whether a Region's input reaches its output only through split layers, read off the autograd graph.

A :class:`~.styles.Region` enters its input into the parallel region once (Megatron's f): identity
forward, the gradient summed over the axis backward. That sum is right only for a gradient each
rank holds a part of, which is what a path through a split layer gives: a Colwise (each rank
multiplies by its slice of the weight), or a Rowwise's sum (replicated keys and values beside split
queries, as multi-query attention keeps them, reach it). A path through neither, a residual
connection inside the module (BERT's ``BertAttention`` computes ``LayerNorm(dense(attention(x)) +
x)``), hands every rank the whole of its gradient, and the sum would count it once per rank: every
rank alike, so no check between the ranks would see it, and the model would train on gradients
several times too large.

:func:`bypasses_split` walks the graph back from the Region's outputs, stopping at the split
layers' outputs and at the input as it was before entering; reaching the entered input means such
a path. The walk runs once per Region module and rank, on its first forward that records a graph
(the Plan's prediction, or the first step), over the Region's own nodes.

:func:`parameter_sides` reads the same graph for the Region's replicated parameters. One used behind
a split layer's output (a norm on each rank's heads, a gain before the Rowwise, a norm on the input
before the Colwise) acts on per-rank values, or on values whose gradient each rank holds a part of:
its gradient is that rank's part, to be summed over the axis. One used only after every split
layer (a LayerNorm or a gain after the Rowwise's sum, a projection on a gathered Colwise output)
acts on whole values whose gradient every rank already holds whole: summed, it would be counted
once per rank, on every rank alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import optree
from torch import Tensor


def bypasses_split(
    outputs: Any, entered: Iterable[Tensor], ends: Iterable[Any], before: Iterable[Tensor]
) -> bool | None:
    """Whether a path leads from the first tensor of ``outputs`` back to one of ``entered`` (the Region's
    input after entering) through none of ``ends`` (the grad_fn nodes of the split layers' outputs:
    a Colwise's, a Rowwise's sum; a gradient through either comes back partial) nor ``before`` (the
    inputs before entering); None when there is no graph to read (no gradient recorded, or none needed)."""
    targets = {t.grad_fn for t in entered if t.grad_fn is not None}
    if not targets:
        return None
    blocked = set(ends) | {t.grad_fn for t in before if isinstance(t, Tensor) and t.grad_fn is not None}
    # The hidden states alone: what the caller goes on with (an attention's weights, returned beside
    # them and dropped, may reach the input through replicated keys and carry no gradient).
    first = next((t for t in optree.tree_leaves(outputs) if isinstance(t, Tensor)), None)
    if first is None or first.grad_fn is None:
        return None
    return any(node in targets for node in _reached([first.grad_fn], lambda node: node in targets or node in blocked))


def parameter_sides(
    outputs: Any, ends: Iterable[Any], stops: Iterable[Tensor], names: Mapping[Any, str]
) -> tuple[set[str], set[str]]:
    """The parameters (``names``: their grad_fn nodes, as ``vary`` made them, by name) that the first
    tensor of ``outputs`` reaches before any of ``ends`` (the split layers' outputs: whole values,
    whole gradients) and those it reaches behind one (per-rank values, or partial gradients); the walk
    stops at ``stops`` (the Region's input, before and after entering)."""
    first = next((t for t in optree.tree_leaves(outputs) if isinstance(t, Tensor)), None)
    before: set[str] = set()
    behind: set[str] = set()
    if first is None or first.grad_fn is None:
        return before, behind
    ended = set(ends)
    stopped = {t.grad_fn for t in stops if isinstance(t, Tensor) and t.grad_fn is not None}
    frontier: list[tuple[Any, bool]] = [(first.grad_fn, False)]
    seen: set[tuple[object, bool]] = set()
    while frontier:
        node, past = frontier.pop()
        if node is None or (node, past) in seen:
            continue
        seen.add((node, past))
        name = names.get(node)
        if name is not None:
            (behind if past else before).add(name)
        if node in stopped:
            continue
        past = past or node in ended
        frontier.extend((next_node, past) for next_node, _ in node.next_functions)
    return before, behind


def summed_on_entry(arguments: Iterable[Tensor], names: Mapping[Any, str]) -> set[str]:
    """The parameters (``names``: their grad_fn nodes, as ``vary`` made them, by name) that a Region's per-head
    arguments (``HeadsAlong``, before they enter) are computed from. Each such argument enters with its gradient
    summed over the axis (head_arguments.py), so what reaches these parameters through it is whole on every
    rank: summed again by ``vary`` (as the sequence-parallel block's parameters all are) it would count tp
    times (learned ALiBi slopes built in the block, review6). One that also acts on the block's slice of the
    sequence gets a part there that must be summed: :meth:`Sides.on_slice` refuses it by name (review6 r11)."""
    starts = [t.grad_fn for t in arguments if isinstance(t, Tensor)]
    return {names[node] for node in _reached(starts, lambda node: node in names) if node in names}


def _reached(starts: Iterable[Any], stop: Callable[[Any], bool]) -> Iterator[Any]:
    """Each autograd node reached from ``starts`` once (depth first), not walking on past one that ``stop``
    says ends the walk there."""
    frontier: list[Any] = list(starts)
    seen: set[object] = set()
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        if not stop(node):
            frontier.extend(next_node for next_node, _ in node.next_functions)


class Sides:
    """Where the Regions of one layer's forward use the replicated parameters the layer varies
    (layer_rewrite.VaryFn): ``names`` maps each varied tensor's grad_fn node to its name; ``whole`` and
    ``partial`` collect those used after every split layer and those used behind one
    (:func:`parameter_sides`), ``where`` the Region that said so, for errors."""

    def __init__(self) -> None:
        self.names: dict[Any, str] = {}
        self.whole: set[str] = set()
        self.partial: set[str] = set()
        self.where: dict[str, str] = {}
        # In a sequence-parallel block: the parameters that build a per-head argument, each with (the argument,
        # its Region), and the arguments' nodes after entering, where the walk of :meth:`on_slice` stops.
        self.arguments: dict[str, tuple[str, str]] = {}
        self.entries: set[Any] = set()

    def add(self, region: str, whole: set[str], partial_: set[str]) -> None:
        self.whole |= whole
        self.partial |= partial_
        for name in whole | partial_:
            self.where.setdefault(name, region)

    def built(self, names: Iterable[str], argument: str, region: str, entered: Tensor) -> None:
        """``names`` build the per-head argument ``argument`` of ``region`` in a sequence-parallel block, which
        entered it as ``entered``."""
        for name in names:
            self.arguments.setdefault(name, (argument, region))
        if entered.grad_fn is not None:
            self.entries.add(entered.grad_fn)

    def on_slice(self, outputs: Any, inputs: Any, layer: str) -> None:
        """Refuse a parameter that builds a per-head argument in a sequence-parallel block (its gradient through
        the argument whole on every rank: not summed) and acts on the block's slice of the sequence too (its
        gradient there this rank's part: to be summed). Every value the first tensor of ``outputs`` reaches
        before the layer's ``inputs`` but not through an argument is a slice, or a rank's heads of it."""
        first = next((t for t in optree.tree_leaves(outputs) if isinstance(t, Tensor)), None)
        if not self.arguments or first is None or first.grad_fn is None:
            return
        stops = self.entries | {t.grad_fn for t in optree.tree_leaves(inputs) if isinstance(t, Tensor)}
        reached = _reached([first.grad_fn], lambda node: node in stops or node in self.names)
        both = sorted({self.names[node] for node in reached if node in self.names} & set(self.arguments))
        if both:
            raise ValueError(built_and_sliced_message(both[0], *self.arguments[both[0]], layer))

    def mixed(self) -> None:
        """Refuse a parameter used on both sides: no sum over the axis makes its gradient right."""
        both = self.whole & self.partial
        if both:
            raise ValueError(mixed_sides_message(both, self.where[min(both)]))


def mixed_sides_message(names: Iterable[str], region: str) -> str:
    """The refusal of a replicated parameter used both on per-rank values and on whole ones."""
    return (
        f"tensor_parallel: the replicated parameters {sorted(names)} act inside Region {region!r} both on per-rank "
        "values (between its Colwise and the Rowwise that sums them, or on the input those split) and on whole "
        "values (after the sum, or on a gathered output): the gradient of the one use is each rank's part, of the "
        "other whole on every rank, and no sum over the axis makes both right. Give the two uses parameters of "
        "their own, or leave the Region out"
    )


def built_and_sliced_message(name: str, argument: str, region: str, layer: str) -> str:
    """The refusal of a parameter that builds a per-head argument and acts on the sequence's slice too."""
    return (
        f"tensor_parallel: the replicated parameter {name!r} builds {argument!r}, the per-head argument (HeadsAlong) "
        f"of Region {region!r}, and also acts on this rank's slice of the sequence in the sequence-parallel block "
        f"{layer!r}. The argument enters the Region with its gradient summed over the axis, so what {name!r} gets "
        "through it is whole on every rank, and what it gets from the slice is each rank's part: no sum over the axis "
        f"makes both right. Give the two uses parameters of their own (one that builds {argument!r}, another for the "
        f"use on the slice), or leave {layer!r} out of sequence_parallel={_alike(layer)} (its values are then whole on "
        "every rank, and so are both gradients)"
    )


def _alike(layer: str) -> str:
    """The pattern of the layers built alike (``'blocks.*'`` for ``'blocks.0'``): a refusal at the first layer's call
    stands for every one of them, which would be refused in turn."""
    pattern = re.sub(r"\.\d+(?=\.|$)", ".*", layer)
    return f", and each layer built alike ({pattern!r})" if pattern != layer else ""


def bypass_message(path: str, module_type: str, parts: int, layers: Iterable[str]) -> str:
    """The refusal of a Region whose input reaches its output by a path no Colwise splits."""
    split = sorted(set(layers))
    inside = f" (its split layers: {', '.join(repr(s) for s in split)})" if split else ""
    return (
        f"tensor_parallel: Region {path!r} ({module_type}) passes its input to its output by a path that no Colwise "
        f"or Rowwise layer splits, such as a residual connection inside the module{inside}. The Region sums its "
        f"input's gradient over the axis, which would count that path's gradient {parts} times over, on every rank "
        "alike. Put the Region on the modules inside it that each hold a Colwise / Rowwise pair without the residual "
        "add (a Llama decoder layer's 'self_attn' and 'mlp', as sw.tp.llama_plan() does), or leave the Region out: "
        "each Colwise then enters the region itself (Hugging Face BERT, whose 'attention' holds its residual add)"
    )
