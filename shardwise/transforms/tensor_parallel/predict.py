"""Which collectives each compute of a tensor-parallel step issues, predicted on fake tensors.

The layers are run forward and backward (as one ``B``, and with ``split_backward``, which the Plan
asks for where its schedule has zero-bubble's ``W``, as ``I`` then ``W``), on fake tensors (no data,
no arithmetic) inside ``recording`` (the step's ``in_layer.predicting`` block, every split's axes):
every in-layer operation records the collective it would issue. Remat and the
precision casts are part of the rewritten layers, so a recomputed forward's
collectives show in the backward, as they run. The lowering lists these after
each compute, and the contract test holds the ledger to them. This is the
spec's own prediction (``TPSpec.inner_collectives``), in place of the engine's.

Layer by layer (the default). A stage's forward issues its layers' forwards in
layer order, and its backward passes issue each layer's backward collectives in
reverse layer order (autograd runs the nodes of a later layer before those of an
earlier one: they are the only ones ready). So each layer is run on its own, on
its input as the stage gives it (which leaves need a gradient, and whether each
comes from the stage's input, for ``I``, or from a parameter alone, for ``W``;
``I`` and ``W`` run as the executor splits them: engine/model/split_backward.py), and a
stage's lists are composed of its layers'; a layer identical to one run before
(engine/model/reuse.py) on a like input is not run again: a 70B's 80 blocks run
once. ``by_layer=False`` runs each stage whole (stages alike still reused): the
reference the tests hold the layer-by-layer lists to.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import optree
import torch

from ...engine.layout.state_layout import Placement
from ...engine.model import reuse as layer_reuse  # the module: a test switches its keys off
from ...engine.model.chain import Chain
from ...engine.model.reuse import LayerMemo, tree_signature
from ...engine.model.split_backward import input_part, recomputes, weight_part
from ...engine.plan.inside import Predicted, Recording, run_layer
from ...engine.stack import in_layer
from ...engine.stack.batch_term import loss_tensor
from ...engine.stack.in_layer import Issued
from ...engine.torch_api import fake_tensors


def _cut(t: Any, grad: bool) -> Any:
    return t.detach().requires_grad_(grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def predict(
    chain: Chain,
    placement: Placement,
    shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
    loss_fn: Callable[[Any, Any], Any],
    inputs: Any,
    targets: Any,
    recording: Recording,
    *,
    by_layer: bool = True,
    split_backward: bool | None = None,
) -> Predicted:
    """For every stage: the collectives of its forward, of the loss (last stage), and of its
    backward as ``B``, and with ``split_backward`` as ``I`` and ``W`` too (None: under a pipeline,
    ``placement.axis``; a schedule without ``W`` never reads them, and they take a second run of every
    layer); ``by_layer=False``: each stage run whole (see the module docstring)."""
    split = placement.axis is not None if split_backward is None else split_backward
    if by_layer and not any(chain[n].ties for n in chain.names):  # a tie's owner may sit in another stage
        composed = _predict_by_layer(chain, placement, shapes, loss_fn, inputs, targets, recording, split)
        if composed is not None:
            return composed
    out: Predicted = {}
    stages = LayerMemo()  # a stage like one predicted before (the middle of a stack of blocks) issues alike
    with fake_tensors() as fake, recording() as issued:
        x = optree.tree_map(fake, inputs)
        y_targets = optree.tree_map(fake, targets)
        for s, layers in enumerate(placement.stages):
            key = _stage_key(chain, layers, shapes, x, s, s == placement.last)
            found = stages.lookup(key, x)
            if found is not None:
                y, (earlier, predicted) = found
                names = dict(zip(earlier, layers, strict=True))
                for kind, listed in predicted.items():
                    out[(kind, s)] = [_renamed(entry, names) for entry in listed]
                x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
                continue
            runs = []
            for _ in range(2 if split else 1):  # one graph for B, one for I then W
                params = {
                    (layer, k): torch.empty(shape, dtype=dtype).requires_grad_(dtype.is_floating_point)
                    for layer in {*layers, *(o for n in layers for o, _ in chain[n].ties.values())}
                    for k, (shape, dtype) in shapes.get(layer, {}).items()
                }
                # As the executor: a stage's input needs a gradient only when it came from a stage before.
                x_in = optree.tree_map(functools.partial(_cut, grad=s > 0), x)
                start = len(issued)
                with torch.enable_grad():
                    y = x_in
                    for name in layers:
                        layer = chain[name]
                        tensors = {local: params[layer.ties.get(local, (name, local))] for local in layer.param_names}
                        y = run_layer(layer, tensors, y, issued)
                    forward = issued[start:]
                    del issued[start:]
                    if s == placement.last:
                        loss = loss_fn(y, y_targets)
                        loss = loss_tensor(loss)
                        out[("loss", s)] = issued[start:]
                        del issued[start:]
                        outputs = [loss]
                    else:
                        outputs = _floats(y)
                out[("forward", s)] = forward
                runs.append(
                    (outputs, _floats(x_in) if s > 0 else [], [p for p in params.values() if p.requires_grad], y)
                )
            outputs, ins, ps, y = runs[0]
            used = [o for o in outputs if o.requires_grad]
            start = len(issued)
            if used and (ins or ps):
                torch.autograd.backward(used, [torch.ones_like(o) for o in used], inputs=ins + ps)
            out[("backward", s)] = issued[start:]
            del issued[start:]
            if split:
                outputs2, ins2, ps2, _ = runs[1]
                used2 = [o for o in outputs2 if o.requires_grad]
                out[("backward_input", s)], out[("backward_weight", s)] = _split_backward(
                    used2, ins2, ps2, issued, start, recomputes(chain[n].fn for n in layers)
                )
            kinds = ("forward", "loss", "backward", "backward_input", "backward_weight")
            stages.store(key, x, y, (tuple(layers), {k: out[(k, s)] for k in kinds if (k, s) in out}))
            x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    return out


@dataclasses.dataclass(frozen=True)
class _LayerIssued:
    """What one layer issues, run on its own on its input as its stage gives it."""

    forward: list[Issued]
    loss: list[Issued] | None  # the last layer of the last stage: the loss's forward
    backward: list[Issued]  # B: the gradients of its inputs and parameters
    to_input: list[Issued]  # I: of its inputs that come from the stage's input
    to_weight: list[Issued]  # W (after I): of its parameters and its inputs that come from a parameter
    # per leaf of its output: does it come from the stage's input, from a parameter
    from_input: tuple[bool, ...]
    from_param: tuple[bool, ...]
    # it hands on a value of parameters alone that the input's path also reaches back to (_origins)
    hands_on_a_parameter: bool = False


def _predict_by_layer(
    chain: Chain,
    placement: Placement,
    shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
    loss_fn: Callable[[Any, Any], Any],
    inputs: Any,
    targets: Any,
    recording: Recording,
    split: bool = True,
) -> Predicted | None:
    """The stages' lists composed of their layers' (``I`` and ``W``'s with ``split``); None where a layer
    hands the next one of its stage a value made from parameters alone that needs a gradient, where the
    input's path reaches back to those parameters too (see :func:`_origins`)."""
    out: Predicted = {}
    # Shared by the plans of one search (engine/model/reuse.py's sharing_runs): the layouts that
    # rewrite a layer alike, on a like input, run it once.
    memo = layer_reuse.memo_for("tensor_parallel.predict")
    with fake_tensors() as fake, recording() as issued:
        x = optree.tree_map(fake, inputs)
        y_targets = optree.tree_map(fake, targets)
        # What a layer's run depends on besides its function, tensors and input: the predicted axes'
        # sizes (two layouts' memo is one), and for the last layer the loss and its targets.
        sizes = tuple(sorted((in_layer.predicting_sizes() or {}).items()))
        with_the_loss = (sizes, loss_fn, tree_signature(y_targets))
        for s, layers in enumerate(placement.stages):
            # As the executor: a stage's input needs a gradient only when it came from a stage before.
            x = optree.tree_map(functools.partial(_cut, grad=s > 0), x)
            leaves = optree.tree_leaves(x, none_is_leaf=True)
            from_input = tuple(_needs_grad(t) for t in leaves)
            from_param = tuple(False for _ in leaves)
            runs: list[_LayerIssued] = []
            for i, name in enumerate(layers):
                with_loss = s == placement.last and i == len(layers) - 1
                run, x = _layer(chain, name, shapes, x, from_input, from_param, with_loss, loss_fn, y_targets,
                                memo, issued, with_the_loss if with_loss else sizes, split)
                runs.append(run)
                if i < len(layers) - 1 and run.hands_on_a_parameter:
                    return None
                from_input, from_param = run.from_input, run.from_param
                x = optree.tree_map(lambda t: _cut(t, t.requires_grad) if isinstance(t, torch.Tensor) else t, x)
            out[("forward", s)] = [e for r in runs for e in r.forward]
            if s == placement.last and runs[-1].loss is not None:
                out[("loss", s)] = runs[-1].loss
            out[("backward", s)] = [e for r in reversed(runs) for e in r.backward]
            if split:
                out[("backward_input", s)] = [e for r in reversed(runs) for e in r.to_input]
                out[("backward_weight", s)] = [e for r in reversed(runs) for e in r.to_weight]
            x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, x)
    return out


def _needs_grad(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _origins(
    y: Any, x_in: Any, from_input: tuple[bool, ...], from_param: tuple[bool, ...], params: list[torch.Tensor],
) -> tuple[tuple[bool, ...], tuple[bool, ...], bool]:
    """Per leaf of a layer's output ``y``: does it come from the stage's input, from a parameter; and
    whether the layer hands on a value of parameters alone whose parameters the input's path reaches
    back to as well.

    A leaf the layer passes on keeps its marks; a new one is read off its graph: which of the layer's
    leaves (its input's, marked, and its parameters) its gradient reaches.

    The next layer of the stage takes such a value as a weight leaf of its own ``W``, where the stage's
    run reaches it from that layer's nodes: its weight pass goes on back to the parameters, and where
    the input's path leads there too (the parameter, or the value, used on it already), it re-runs the
    nodes of the input's path between (the module docstring of engine/model/split_backward.py). Layer
    by layer that pass is cut at the layer's edge, so such a stage is predicted whole, as it runs."""
    inputs = optree.tree_leaves(x_in, none_is_leaf=True)
    position = {id(t): k for k, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
    param_ids = {id(p) for p in params}
    # What stands for a parameter here: the layer's own, and what an earlier layer made of parameters alone.
    weights = param_ids | {id(t) for t, p, i in zip(inputs, from_param, from_input, strict=True)
                           if p and not i and isinstance(t, torch.Tensor)}
    out_input, out_param, reaches = [], [], []
    for t in optree.tree_leaves(y, none_is_leaf=True):
        if isinstance(t, torch.Tensor) and id(t) in position:
            k = position[id(t)]
            out_input.append(from_input[k])
            out_param.append(from_param[k])
            reaches.append({id(t)} & weights)
            continue
        reached = _leaves_reached(t) if _needs_grad(t) else set()
        hit = [position[r] for r in reached if r in position]
        out_input.append(any(from_input[k] for k in hit))
        out_param.append(bool(reached & param_ids) or any(from_param[k] for k in hit))
        reaches.append(reached & weights)
    on_path: set[int] = set()
    for i, r in zip(out_input, reaches, strict=True):
        if i:
            on_path |= r
    hands_on = any(
        p and not i and _needs_grad(t) and r & on_path
        for t, i, p, r in zip(optree.tree_leaves(y, none_is_leaf=True), out_input, out_param, reaches, strict=True)
    )
    return tuple(out_input), tuple(out_param), hands_on


def _leaves_reached(t: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors ``t``'s gradient reaches (``t`` itself, if it is one)."""
    if t.grad_fn is None:
        return {id(t)}
    reached: set[int] = set()
    stack, seen = [t.grad_fn], {t.grad_fn}
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad: the leaf it writes into
            if isinstance(variable, torch.Tensor):
                reached.add(id(variable))
            else:
                stack.append(node)
    return reached


def _layer(
    chain: Chain, name: str, shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]], x: Any,
    from_input: tuple[bool, ...], from_param: tuple[bool, ...], with_loss: bool,
    loss_fn: Callable[[Any, Any], Any], targets: Any, memo: LayerMemo, issued: list[Issued],
    around: Hashable = None, split: bool = True,
) -> tuple[_LayerIssued, Any]:
    """One layer's collectives on input ``x`` (its leaves' gradients as marked), and its output;
    a run like one before is reused (renamed to this layer). ``around``: what else the run depends on,
    for a memo shared across predictions. Without ``split``, its ``I`` and ``W`` are not run (left empty)."""
    layer = chain[name]

    def fresh_params() -> dict[str, torch.Tensor]:
        return {k: torch.empty(shape, dtype=dtype).requires_grad_(dtype.is_floating_point)
                for k, (shape, dtype) in shapes.get(name, {}).items()}

    base = memo.key(layer.fn, fresh_params(), x, layer=name)
    key = None if base is None else (base, from_input, from_param, with_loss, around, split)
    found = memo.lookup(key, x)
    if found is not None:
        y, (earlier, run) = found
        names = {earlier: name}
        renamed = {f.name: [_renamed(e, names) for e in getattr(run, f.name)]
                   for f in dataclasses.fields(run) if isinstance(getattr(run, f.name), list) and f.name != "loss"}
        loss_issued = None if run.loss is None else [_renamed(e, names) for e in run.loss]
        return dataclasses.replace(run, loss=loss_issued, **renamed), y
    graphs = []
    for _ in range(2 if split else 1):  # one graph for B, one for I then W
        params = fresh_params()
        ps = [p for p in params.values() if p.requires_grad]
        x_in = optree.tree_map(lambda t: _cut(t, t.requires_grad) if isinstance(t, torch.Tensor) else t, x)
        ins = [t for t in optree.tree_leaves(x_in, none_is_leaf=True) if _needs_grad(t)]
        start = len(issued)
        with torch.enable_grad():
            y = run_layer(layer, {local: params[local] for local in layer.param_names}, x_in, issued)
            forward = issued[start:]
            del issued[start:]
            loss_issued = None
            if with_loss:
                loss = loss_fn(y, targets)
                loss = loss_tensor(loss)
                loss_issued = issued[start:]
                del issued[start:]
                outputs = [loss]
            else:
                outputs = _floats(y)
        graphs.append((outputs, x_in, ins, ps, y))
    outputs, x_in, ins, ps, y = graphs[0]
    # Read before the backward below, which frees the graph's buffers.
    out_input, out_param, hands_on = _origins(y, x_in, from_input, from_param, ps)
    used = [o for o in outputs if o.requires_grad]
    start = len(issued)
    if used and (ins or ps):
        torch.autograd.backward(used, [torch.ones_like(o) for o in used], inputs=ins + ps)
    backward = issued[start:]
    del issued[start:]
    to_input: list[Issued] = []
    to_weight: list[Issued] = []
    if split:
        to_input, to_weight = _layer_split_backward(layer.fn, graphs[1], from_input, from_param, issued, start)
    run = _LayerIssued(forward, loss_issued, backward, to_input, to_weight, out_input, out_param, hands_on)
    memo.store(key, x_in, y, (name, run), keep=layer.fn)
    return run, y


def _layer_split_backward(
    fn: Any, graph: tuple[list[torch.Tensor], Any, list[torch.Tensor], list[torch.Tensor], Any],
    from_input: tuple[bool, ...], from_param: tuple[bool, ...], issued: list[Issued], start: int,
) -> tuple[list[Issued], list[Issued]]:
    """What a layer's ``I`` and then its ``W`` issue, on its second graph (the first one's backward freed it)."""
    outputs2, x_in2, _, ps2, _ = graph
    leaves2 = optree.tree_leaves(x_in2, none_is_leaf=True)
    to_input_of = [t for t, f in zip(leaves2, from_input, strict=True) if f and _needs_grad(t)]
    # W's leaves: the parameters, and an input that comes from a parameter alone (one that also comes
    # from the stage's input lies on the input's path: its gradient is I's, the earlier layers' weights
    # take theirs in W from where their branches leave that path).
    to_weight_of = [
        t for t, p, i in zip(leaves2, from_param, from_input, strict=True) if p and not i and _needs_grad(t)
    ] + ps2
    used2 = [o for o in outputs2 if o.requires_grad]
    return _split_backward(used2, to_input_of, to_weight_of, issued, start, recomputes([fn]))


def _split_backward(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], weights: list[torch.Tensor], issued: list[Issued],
    start: int, whole: bool,
) -> tuple[list[Issued], list[Issued]]:
    """What zero-bubble's I and then its W issue, run as the executor runs them
    (engine/model/split_backward.py): I to ``inputs``, W from where the weights' branches leave
    their path; without inputs, W is a backward to ``weights``."""
    seeds = [torch.ones_like(o) for o in outputs]
    part = input_part(outputs, seeds, inputs, weights, whole=whole)[1] if outputs else None
    to_input = issued[start:]
    del issued[start:]
    if part is not None:
        weight_part(part)
    to_weight = issued[start:]
    del issued[start:]
    return to_input, to_weight


def _stage_key(
    chain: Chain, layers: Sequence[str], shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
    x: Any, s: int, last: bool,
) -> Any:
    """What decides a stage's collectives: its layers' functions (engine/model/reuse.py), their
    parameters' shapes, its input, whether it is the first (its input needs no gradient) or the
    last (the loss); None when a layer does not say what it computes, or a stage has ties."""
    fns = [layer_reuse.reuse_key(chain[n].fn) for n in layers]
    if any(k is None for k in fns) or any(chain[n].ties for n in layers):
        return None
    params = tuple(
        tuple((k.removeprefix(n + "."), tuple(shape), dtype) for k, (shape, dtype) in shapes.get(n, {}).items())
        for n in layers
    )
    inputs = tree_signature(x)
    return None if inputs is None else (tuple(fns), params, inputs, s == 0, last)


def _renamed(entry: Issued, names: Mapping[str, str]) -> Issued:
    """A collective an earlier stage's layer issued, labelled as this stage's layer in its place
    (a label starts with the path of the module that issues it)."""
    for old, new in names.items():
        if entry.label == old or entry.label.startswith(old + "."):
            return dataclasses.replace(entry, label=new + entry.label[len(old):])
    return entry
