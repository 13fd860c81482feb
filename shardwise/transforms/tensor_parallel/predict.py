"""Which collectives each compute of a tensor-parallel step issues, predicted on fake tensors.

The layers are run forward and backward (as one ``B``, and as ``I`` then ``W``
for zero-bubble schedules), stage by stage, on fake tensors (no data, no
arithmetic) inside ``comm.predicting``: every tensor-parallel operation records
the collective it would issue. Remat and the precision casts are part of the
rewritten layers, so a recomputed forward's collectives show in the backward, as
they run. The lowering lists these after each compute, and the contract test
holds the ledger to them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

from ...engine.layout.state_layout import Placement
from ...engine.model import reuse as layer_reuse  # the module: a test switches its keys off
from ...engine.model.chain import Chain
from ...engine.model.reuse import LayerMemo, tree_signature
from ...engine.torch_api import fake_tensors
from .comm import Issued, predicting

Predicted = dict[tuple[str, int], list[Issued]]  # (compute kind, stage) -> what it issues


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
    size: int,
) -> Predicted:
    """For every stage: the collectives of its forward, of the loss (last stage), and of its
    backward as ``B``, ``I`` and ``W``."""
    out: Predicted = {}
    stages = LayerMemo()  # a stage like one predicted before (the middle of a stack of blocks) issues alike
    with fake_tensors() as fake, predicting(size) as issued:
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
            for _ in range(2):  # one graph for B, one for I then W
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
                        y = layer(tensors, y)
                    forward = issued[start:]
                    del issued[start:]
                    if s == placement.last:
                        loss = loss_fn(y, y_targets)
                        loss = loss[0] if isinstance(loss, (tuple, list)) else loss
                        out[("loss", s)] = issued[start:]
                        del issued[start:]
                        outputs = [loss]
                    else:
                        outputs = _floats(y)
                out[("forward", s)] = forward
                runs.append((outputs, _floats(x_in) if s > 0 else [], [p for p in params.values() if p.requires_grad], y))
            (outputs, ins, ps, y), (outputs2, ins2, ps2, _) = runs
            seeds = [torch.ones_like(o) for o in outputs]
            used = [o for o in outputs if o.requires_grad]
            start = len(issued)
            if used and (ins or ps):
                torch.autograd.backward(used, [torch.ones_like(o) for o in used], inputs=ins + ps)
            out[("backward", s)] = issued[start:]
            del issued[start:]
            used2 = [o for o in outputs2 if o.requires_grad]
            if used2 and ins2:
                torch.autograd.grad(used2, ins2, [torch.ones_like(o) for o in used2], retain_graph=True, allow_unused=True)
            out[("backward_input", s)] = issued[start:]
            del issued[start:]
            if used2 and ps2:
                torch.autograd.grad(used2, ps2, [torch.ones_like(o) for o in used2], allow_unused=True)
            out[("backward_weight", s)] = issued[start:]
            del issued[start:]
            del seeds
            kinds = ("forward", "loss", "backward", "backward_input", "backward_weight")
            stages.store(key, x, y, (tuple(layers), {k: out[(k, s)] for k in kinds if (k, s) in out}))
            x = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)
    return out


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
