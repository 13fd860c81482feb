"""How many bytes each layer keeps alive for its backward, measured on a probe batch."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ...engine.step import Step, check_params, split_batch
from ._torch_sac import observing, storage_key


def _cut(tree: Any, requires_grad: bool) -> Any:
    """Detach every tensor; floating ones become leaves that require grad (a layer boundary)."""

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        return t.requires_grad_(True) if requires_grad and (t.is_floating_point() or t.is_complex()) else t

    return optree.tree_map(cut, tree)


def saved_bytes(step: Step, params: Any, batch: Any) -> dict[str, int]:
    """Bytes of activation memory each layer of ``step`` keeps for backward, by layer name.

    Measured, not modelled: each layer's forward runs once on this batch, as
    the executor runs it (inputs cut at layer boundaries, gradients enabled),
    under ``torch.autograd.graph.saved_tensors_hooks``; the result counts
    every distinct storage kept for backward once, at its full size (a saved
    view keeps its whole storage alive). That is what autograd saves for an
    un-rematted layer, and for a rematted one what checkpoint keeps (the
    layer's inputs) plus the op outputs its policy caches. Left out is what
    lives on whether or not backward needs it: the layer's own parameters and
    buffers, and its output (the executor holds every layer's output until
    that layer's backward; a layer's input is counted when backward keeps it,
    so summing over layers counts each boundary activation at most once).
    Offloaded bytes (``offload_to_cpu``) are counted too, wherever
    they are kept.

    This is the "prediction" for other batches only in the sense that
    activation bytes scale with the batch: the figures are exact for this
    probe batch and these shapes, and say nothing of the allocator's
    fragmentation or of the transient peak inside a layer's backward.
    Compare ``saved_bytes(remat(step, ...), ...)`` with ``saved_bytes(step, ...)``
    for the saving.
    """
    chain = step.chain
    check_params(chain, params)
    inputs, _ = split_batch(batch)
    result: dict[str, int] = {}
    x = _cut(inputs, requires_grad=False)
    for position, layer in enumerate(chain):
        local = {k: v.detach().requires_grad_(True) for k, v in chain.layer_params(params, layer).items()}
        if position > 0:
            x = _cut(x, requires_grad=True)
        kept: list[torch.Tensor] = []
        with torch.enable_grad(), observing(kept.append):
            y = layer(local, x)
        outputs = [t for t in optree.tree_leaves(y) if isinstance(t, torch.Tensor)]
        resident = {storage_key(t) for t in [*local.values(), *layer.buffers.values(), *outputs]}
        sizes = {storage_key(t): t.untyped_storage().nbytes() for t in kept}
        result[layer.name] = sum(n for key, n in sizes.items() if key not in resident)
        del kept
        x = _cut(y, requires_grad=False)
    return result
