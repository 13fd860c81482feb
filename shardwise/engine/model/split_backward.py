"""A stage's backward split in two, for zero-bubble schedules: the input part (I), then the weight part (W).

I computes the gradients of the stage's inputs (what the stage below waits for) and nothing else of
the weights'. W computes the weights' gradients later, when the rank would otherwise be idle. Run
naively, W is a second backward from the stage's outputs to its weights, and that goes again through
every node on the way from the outputs to the inputs, since the earlier layers' weights lie behind
them: I + W then cost about 1.3x one whole backward (measured on the small GPT, 2 stages: I 7.5 ms,
W 25.4 ms, B 25.4 ms).

Instead, as torch's ``pipelining`` does (``_backward.stage_backward_input`` / ``_weight``), I records
the gradient reaching each node of the input's path where a weight's branch leaves it (a linear's
matmul node: its input's gradient was computed in I, its weight's was skipped), and W starts from
those nodes with those gradients, so it runs only the weights' branches. The values are those of the
whole backward bit for bit: every node computes from the same incoming gradient, and a leaf's
gradient is accumulated as the whole backward accumulates it.

A weight whose branch does not meet the input's path, or also reaches an output that does not
depend on an input, gets its gradient in W from the outputs as before (what of the input's path that
goes through runs again). So does every weight of a stage that recomputes in its backward (a remat
region: ``recomputes``), taken ``whole``: each branch's pass would run the region's forward again.
A weight used at two places of the input's path with input-path nodes between them gets its gradient
right, but its pass runs those nodes again (their result is replaced by what I recorded).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Group:
    """Weights whose branches leave the input's path at the same nodes (merged when they share one)."""

    leaves: list[torch.Tensor]
    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


@dataclass
class WeightPart:
    """What I left for W: the groups with the gradients recorded at their nodes, and the weights
    that W takes from the stage's outputs (``outputs`` and ``seeds``, whose graph I retained)."""

    groups: list[_Group]
    rest: list[torch.Tensor]
    outputs: list[torch.Tensor]
    seeds: list[torch.Tensor]


def _node(t: torch.Tensor) -> Node:
    return get_gradient_edge(t).node


def _downstream(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots`` (the outputs' nodes) through ``next_functions``: the
    nodes that pass a gradient to it (its consumers in the forward)."""
    consumers: dict[Node, list[Node]] = {}
    queue: deque[Node] = deque()
    for root in roots:
        if root not in consumers:
            consumers[root] = []
            queue.append(root)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in consumers:
                consumers[nxt] = []
                queue.append(nxt)
            consumers[nxt].append(node)
    return consumers


def _forward_reach(
    starts: Sequence[Node], consumers: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], list[Node]]:
    """The nodes reached from ``starts`` through their consumers, not going past a node of ``stop``;
    and the ``stop`` nodes met, in the order met (the graph's, the same in every run)."""
    seen: set[Node] = set()
    met: dict[Node, None] = {}
    queue = deque(n for n in starts if n in consumers)
    seen.update(queue)
    while queue:
        for consumer in consumers[queue.popleft()]:
            if consumer in stop:
                met[consumer] = None
            elif consumer not in seen:
                seen.add(consumer)
                queue.append(consumer)
    return seen, list(met)


def _backward_order(roots: Sequence[Node], consumers: dict[Node, list[Node]]) -> dict[Node, int]:
    """Each node's place in an order where it comes after every node that passes it a gradient (Kahn's,
    first in first out from the outputs): the same for the same graph, in every process."""
    waiting = {node: len(passers) for node, passers in consumers.items()}
    queue = deque(dict.fromkeys(r for r in roots if waiting.get(r) == 0))
    order: dict[Node, int] = {}
    while queue:
        node = queue.popleft()
        order[node] = len(order)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt in waiting:
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    queue.append(nxt)
    return order


def recomputes(fns: Iterable[Any]) -> bool:
    """Whether one of the layer functions ``fns`` runs its forward again in its backward (says so with
    ``recomputes_in_backward``, on itself or a function it wraps: ``__wrapped__``)."""
    for fn in fns:
        for _ in range(64):
            if fn is None:
                break
            if getattr(fn, "recomputes_in_backward", False):
                return True
            fn = getattr(fn, "__wrapped__", None)
    return False


def input_part(
    outputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor], *, whole: bool = False,
) -> tuple[list[torch.Tensor | None], WeightPart]:
    """The gradients of ``inputs`` (None for one the outputs do not reach) from ``outputs`` seeded with
    ``seeds``, keeping the graph; and what :func:`weight_part` needs to add the gradients of ``leaves``
    (the stage's weights) into their ``.grad``. ``whole``: W is a backward from the outputs to every
    leaf, nothing recorded (a stage that ``recomputes``); so is it without ``inputs`` (the first
    stage's: I has nothing to compute)."""
    if not inputs:
        return [], WeightPart([], list(leaves), list(outputs), list(seeds))
    if whole:
        got = torch.autograd.grad(list(outputs), list(inputs), list(seeds), retain_graph=True, allow_unused=True)
        return list(got), WeightPart([], list(leaves), list(outputs), list(seeds))
    roots = [_node(o) for o in outputs]
    consumers = _downstream(roots)
    input_path, _ = _forward_reach([_node(x) for x in inputs], consumers, set())
    off_path = {r for r in roots if r not in input_path}  # outputs that do not depend on an input
    by_node: dict[Node, _Group] = {}
    rest: list[torch.Tensor] = []
    for leaf in leaves:
        start = _node(leaf)
        if start not in consumers:
            continue  # the outputs do not depend on it: no gradient, as in the whole backward
        seen, met = _forward_reach([start], consumers, input_path)
        if not met or seen & off_path:
            # Some of its gradient comes from an output the input's path does not lead to: taken
            # whole from the outputs in W.
            rest.append(leaf)
            continue
        merged = _Group([leaf], met)
        for joined in {id(g): g for g in (by_node.get(n) for n in met) if g is not None}.values():
            merged.leaves = [*joined.leaves, *merged.leaves]
            merged.nodes = [*joined.nodes, *(n for n in merged.nodes if n not in joined.nodes)]
        for n in merged.nodes:
            by_node[n] = merged
    # In the order a backward may run them (every node after the nodes that pass it a gradient), whatever
    # the order of ``leaves``: collectives in the weights' branches are issued in W in this order on
    # every rank, and the Plan predicts them in it (plan/inside.py; layer by layer, a later layer's
    # before an earlier one's, as here: tensor_parallel/predict.py).
    order = _backward_order(roots, consumers)
    groups = sorted({id(g): g for g in by_node.values()}.values(), key=lambda g: min(order[n] for n in g.nodes))
    handles = []
    try:
        for group in groups:
            group.grads = [None] * len(group.nodes)
            for i, node in enumerate(group.nodes):
                handles.append(node.register_prehook(_recorder(group, i)))
        got = torch.autograd.grad(list(outputs), list(inputs), list(seeds), retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return list(got), WeightPart(groups, rest, list(outputs), list(seeds))


def _recorder(group: _Group, i: int) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.grads[i] = grad_outputs

    return record


def weight_part(part: WeightPart) -> None:
    """The weights' gradients, added into their ``.grad`` as a whole backward adds them, from where
    :func:`input_part` left them; the graph is released with the stage's outputs, after."""
    if part.rest:
        # First, keeping the graph: its way from the outputs may pass the groups' nodes.
        torch.autograd.backward(part.outputs, part.seeds, inputs=part.rest, retain_graph=True)
    for group in part.groups:
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for node, recorded in zip(group.nodes, group.grads, strict=True):
            for i, grad in enumerate(recorded or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        if not edges:
            continue  # no gradient reached its nodes in I: none reaches its weights either
        handles = []
        try:
            # Each node's incoming gradients replaced by what it got in I: a node of the group below
            # another gets, besides its own, what flows into it from the one above, and a gradient hook
            # on the tensor it computes (which runs before a node's prehooks) would apply again to the
            # recorded gradient, which it already shaped. So nothing counts twice.
            for node, recorded in zip(group.nodes, group.grads, strict=True):
                handles.append(node.register_prehook(lambda _, got=recorded: got))
            # The graph kept to the part's end: a remat region's nodes may lie in several groups, and
            # each group's pass recomputes the region from inputs the region holds (not each node).
            torch.autograd.backward(edges, grads, inputs=group.leaves, retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        group.grads = []
