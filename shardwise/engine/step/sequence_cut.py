"""Refuse a step that cuts the batch's rows when they are a sequence-first module's sequence (``batch_first=False``).

A step that cuts the batch (shard_params' shares, accumulation, a pipeline's micro-batches) cuts dim 0 of
every batch tensor. Time-major batches, ``(seq, batch, ...)`` as torch's ``nn.LSTM`` or
``nn.TransformerEncoderLayer`` take them by default, have the sequence there: each part would hold a slice
of every sequence, and the module would attend over (or run along) that slice alone, silently another
model (``engine/model/sequence_first.py`` tells it from the shapes the module gets on one and on two rows).
Checked once per layout and rank, on the rank's first micro-batch, before anything runs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ...collectives.mesh import Mesh
from ..layout.state_layout import StateLayout
from ..model.sequence_first import rows_on_sequence_dim, sequence_first_modules
from ..plan.lower import microbatch_count
from .batch_cut import batch_cuts
from .layouts import output_shapes

if TYPE_CHECKING:
    from .step import Step


def refuse_rows_on_sequence_dim(step: Step, layout: StateLayout, mesh: Mesh | None, inputs: Any) -> None:
    """Refuse, naming the module and the fix, where ``inputs`` (the rank's first micro-batch) brings the
    batch's rows to a sequence-first module's sequence dim and the step cuts the rows."""
    key = ("rows on a sequence dim", layout.index_of(mesh))
    if layout.cache.get(key):
        return
    cuts = [what for _, n, what in batch_cuts(step, mesh) if n > 1]
    k = microbatch_count(step)
    if k > 1:
        cuts.append(f"{k} micro-batches")
    # Under a split the layers run on fake tensors only inside its predicting block: not checked there.
    modules = sequence_first_modules(step.chain) if cuts and not step.split.parts else []
    if modules:
        found = rows_on_sequence_dim(modules, functools.partial(output_shapes, step, layout), inputs)
        if found:
            path, module, shape = found[0]
            raise ValueError(
                f"{path!r} ({type(module).__name__}, batch_first=False) takes its sequence on dim 0, and the batch's "
                f"rows reach it there (its input is {list(shape)} on a micro-batch of two rows: dim 0 follows the "
                f"rows). This step cuts the batch's rows ({' x '.join(cuts)}), so each part would hold a slice of "
                "every sequence and the module would attend over (or run along) that slice alone: another model "
                "than the single-device step's. Give the batch its rows on dim 0 ((batch, seq, ...), not "
                "time-major) and build the module with batch_first=True (or transpose the rows to dim 1 in the "
                "model's forward before calling it); or run without cutting the batch (one device, "
                "tensor_parallel alone, a pipeline with microbatches=1)"
            )
    layout.cache[key] = True
