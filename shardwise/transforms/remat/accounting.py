"""How many bytes each layer keeps alive for its backward, measured on a probe batch."""

from __future__ import annotations

from typing import Any

from ...engine.layout.state import check_params
from ...engine.model.pytrees import plain_batch
from ...engine.plan.accounting import kept_for_backward
from ...engine.plan.batches import split_batch
from ...engine.step.step import Step


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

    The figures are exact for this batch's shapes and say nothing of the
    allocator's fragmentation or of the transient peak inside a layer's
    backward. ``step.plan(mesh, params, batch=...)`` predicts the same figures
    on meta tensors, per rank, without computing anything.
    Compare ``saved_bytes(remat(step, ...), ...)`` with ``saved_bytes(step, ...)``
    for the saving.
    """
    check_params(step.chain, params)
    inputs, _ = split_batch(plain_batch(batch))  # a tokenizer's BatchEncoding: the dict the step sees
    return kept_for_backward(step.chain, step.compute_view(params), inputs)
