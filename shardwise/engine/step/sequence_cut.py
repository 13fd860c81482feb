"""Refuse a step that cuts the batch's rows when they are a sequence-first module's sequence (``batch_first=False``).

A step that cuts the batch (shard_params' shares, accumulation, a pipeline's micro-batches, expert
parallel's shares) cuts dim 0 of every batch tensor. Time-major batches, ``(seq, batch, ...)`` as torch's
``nn.LSTM`` or ``nn.TransformerEncoderLayer`` take them by default, have the sequence there: each part would
hold a slice of every sequence, and the module would attend over (or run along) that slice alone, silently
another model (``engine/model/sequence_first.py`` tells it from the shapes the module gets on micro-batches of
one and of two more rows than the rank's). The same holds for a torch functional that is time-major by
contract (``F.multi_head_attention_forward`` called by a model's own code, ``F.ctc_loss``): its call is heard
on that run. Checked once per layout and rank, on the rank's first micro-batch, before anything runs, only where
the model holds such a module or its code names such a functional (engine/model/time_major_code.py).

Under a split (tensor, expert, context parallel) the step's chain runs inside the split's predicting block,
as the Plan predicts it: its collectives move nothing. Its layers watch their first call there (context
parallel per input shape): the rows added make shapes the run never has, so the run's own first call is
still watched as before.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ...collectives.mesh import Mesh
from ..layout.state_layout import StateLayout
from ..model.sequence_first import describe, rows_on_sequence_dim, sequence_first_modules
from ..model.time_major_code import may_call_time_major
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
    modules = sequence_first_modules(step.chain) if cuts else []
    if modules or (cuts and may_call_time_major(step.chain)):
        unheard: list[tuple[str, Any]] = []
        with step.predicting(mesh):
            found = rows_on_sequence_dim(modules, functools.partial(output_shapes, step, layout), inputs, unheard)
        # (not a recurrent layer: one fed a packed batch is heard at the packing, whose lengths a fake run cannot
        # read, so its run stops there whichever way the rows go)
        unheard = [(path, module) for path, module in unheard if not isinstance(module, torch.nn.RNNBase)]
        if unheard and not found:
            path, module = unheard[0]
            what, how = describe(path, module)
            warnings.warn(
                f"{what} takes its sequence on dim 0, and whether the batch's rows reach it there could not be "
                "told: the look runs the model on fake tensors, and that run stopped before the module, at code "
                "that reads the batch's values (an `if mask.any():`). This step cuts the batch's rows "
                f"({' x '.join(cuts)}): if the batch is time-major ((seq, batch, ...)), each part holds a slice of "
                "every sequence and the step trains another model than the single-device step's. Give the batch "
                f"its rows on dim 0 and {how}, or check the step with sw.testing.assert_equivalent",
                stacklevel=2,
            )
        if found:
            path, module, shape = found[0]
            what, how = describe(path, module)
            raise ValueError(
                f"{what} takes its sequence on dim 0, and the batch's "
                f"rows reach it there (its input is {list(shape)} on the rank's micro-batch with two rows added: "
                f"dim 0 follows the rows). This step cuts the batch's rows ({' x '.join(cuts)}), so each part would "
                "hold a slice of every sequence and the module would attend over (or run along) that slice alone: "
                "another model than the single-device step's. Give the batch its rows on dim 0 ((batch, seq, ...), not "
                f"time-major) and {how}; or run without cutting the batch (one device, tensor_parallel alone, a "
                "pipeline with microbatches=1)"
            )
    layout.cache[key] = True
