"""The collectives a split transform's layers issue inside each compute, predicted on fake tensors.

Every stage (without a pipeline: every layer) runs forward, the loss on the last, and backward (with
``split_backward``, which the Plan asks for where its schedule has zero-bubble's ``W``, also the split
backward: input pass then weight pass), on fake tensors inside ``recording`` (the step's
``in_layer.predicting`` block, with every split's axes), which yields the list the layers append what
they would issue to (``stack/in_layer.py``), in the order the run issues it; this module runs the
computes and cuts the list per compute. It is the
engine's prediction for every split; a split may bring its own (``roles.OwnPrediction``: tensor
parallel's goes layer by layer, each distinct layer once, and knows zero-bubble's split backward).
A layer that reads data to decide a shape runs on real stand-ins instead (engine/torch_api.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from ..layout.state_layout import Placement
from ..model.chain import Chain, Layer
from ..model.split_backward import input_part, recomputes, weight_part
from ..stack.batch_term import loss_tensor
from ..stack.in_layer import Issued
from ..torch_api import fake_run_errors, fake_tensors, run_on_stand_ins

# (compute kind, stage) -> what that compute issues inside its layers, in order
Predicted = dict[tuple[str, int], list[Issued]]
# The block the layers run in: the step's in_layer.predicting, yielding the list they record into
Recording = Callable[[], contextlib.AbstractContextManager[list[Issued]]]


def _cut(t: Any, grad: bool) -> Any:
    return t.detach().requires_grad_(grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _floats(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def predict_inside(
    chain: Chain,
    placement: Placement,
    shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
    loss_fn: Callable[[Any, Any], Any],
    inputs: Any,
    targets: Any,
    recording: Recording,
    *,
    split_backward: bool | None = None,
) -> Predicted:
    """For every stage: the entries ``recording``'s list got during its forward, the loss (last stage)
    and its backward (and with ``split_backward``, its backward_input and backward_weight; None: under a
    pipeline, ``placement.axis``)."""
    split = placement.axis is not None if split_backward is None else split_backward
    out: Predicted = {}
    with fake_tensors() as fake, recording() as issued:
        x = optree.tree_map(fake, inputs)
        y_targets = optree.tree_map(fake, targets)
        for s, layers in enumerate(placement.stages):
            params = {
                (layer, k): torch.empty(shape, dtype=dtype).requires_grad_(dtype.is_floating_point)
                for layer in {*layers, *(o for n in layers for o, _ in chain[n].ties.values())}
                for k, (shape, dtype) in shapes.get(layer, {}).items()
            }
            # As the executor: a stage's input needs a gradient only when it came from a stage before.
            x_in = optree.tree_map(functools.partial(_cut, grad=s > 0), x)
            with torch.enable_grad():
                y = x_in
                for name in layers:
                    layer = chain[name]
                    tensors = {local: params[layer.ties.get(local, (name, local))] for local in layer.param_names}
                    y = run_layer(layer, tensors, y, issued)
                out[("forward", s)] = list(issued)
                issued.clear()
                if s == placement.last:
                    loss = loss_fn(y, y_targets)
                    outputs = [loss_tensor(loss)]
                    out[("loss", s)] = list(issued)
                    issued.clear()
                else:
                    outputs = _floats(y)
            used = [o for o in outputs if o.requires_grad]
            seeds = [torch.ones_like(o) for o in used]
            inputs_in = _floats(x_in) if s > 0 else []
            weights = [p for p in params.values() if p.requires_grad]
            if used and (inputs_in or weights):
                torch.autograd.backward(used, seeds, inputs=inputs_in + weights, retain_graph=split)
            out[("backward", s)] = list(issued)
            issued.clear()
            if split:
                # Zero-bubble's split backward, as the executor runs it (model/split_backward.py): I to the
                # stage's inputs, recording where the weights' branches leave their path, W from there to
                # the weights; a stage without such inputs takes W as a backward to the weights.
                whole = recomputes(chain[n].fn for n in layers)
                part = input_part(used, seeds, inputs_in, weights, whole=whole)[1] if used else None
                out[("backward_input", s)] = list(issued)
                issued.clear()
                if part is not None:
                    weight_part(part)
                out[("backward_weight", s)] = list(issued)
                issued.clear()
            x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    return out


def run_layer(layer: Layer, tensors: dict[str, torch.Tensor], x: Any, issued: list[Issued]) -> Any:
    """``layer`` on fake tensors; one that reads data to decide a shape (a plain mixture-of-experts
    loop's ``torch.where``), or one with an op whose fake kernel refuses it (``fake_run_errors``), runs
    again on real stand-ins, forward and backward (``run_on_stand_ins``), what it recorded before it
    failed dropped; a genuine error of the layer is raised there again."""
    mark = len(issued)
    try:
        return layer(tensors, x)
    except fake_run_errors():
        del issued[mark:]
        return run_on_stand_ins(lambda buffers, t, x: dataclasses.replace(layer, buffers=buffers)(t, x),
                                dict(layer.buffers), tensors, x)
