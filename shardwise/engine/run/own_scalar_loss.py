"""A scalar loss the model computes in its own forward, probed where the step cuts the batch.

``loss_rows.py`` probes ``loss_fn`` on halves of the model's output; a loss the model returned as a scalar (a
forward ending in ``return F.mse_loss(recon, x, reduction="sum")``, nanoGPT's ``(logits, loss)``) has no rows to
cut there, so it was not probed: a sum over the rows (a VAE's), an in-batch contrastive loss or a mean over a
float mask computed in the forward trained the mean of the parts' losses (half the sum at dp 2), without an error.

On the step's first call where the batch is cut and the loss is a mean (``train_step(tokens=None)``), the last
layer, whose output holds the scalar, is called again under ``no_grad`` on its first micro-batch's input and on the
two halves of that input's rows (the tensors whose dim 0 has the micro-batch's rows; the others whole), on a copy of
its module (nothing the step holds sees the calls), and the mean of the halves' values is compared with the
whole's, at loss_rows' tolerances: another value is refused, naming what was measured. Not probed: a layer that
draws random numbers (a dropout: what it drew is set back), raises on fewer rows, or whose module a split rewrote
(tensor, context, expert parallel); a Hugging Face output (its own losses are judged by class in batch_cut.py);
an odd micro-batch, or one of one row. Cost: two calls of the last layer on half the rows, once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from ..model.chain import Layer
from ..model.module_call import module_fn
from ..torch_api import computed_dtype
from .first_call_state import _generators_kept, _no_collectives, module_copy
from .loss_rows import RTOL, RTOL_FLOAT32, RTOL_FLOAT64, _exact_float32_matmuls


def own_scalar(output: Any) -> torch.Tensor | None:
    """The scalar loss the model's output holds: the output itself, or the first 0-dim floating tensor that requires
    grad in a tuple, list or dict of one's own (not a transformers output); None where there is none."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 and output.is_floating_point() and output.requires_grad else None
    if type(output).__module__.startswith("transformers.") or not isinstance(output, (tuple, list, Mapping)):
        return None
    leaves: list[Any] = optree.tree_leaves(output)  # type: ignore[arg-type]
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() == 0
                 and t.is_floating_point() and t.requires_grad), None)


def probe_own_scalar_loss(layer: Layer, call: Callable[[Any], Any], given: Any, output: Any, rows: int, cut: str,
                          sizes: Mapping[str, int]) -> None:
    """Refuse where ``layer``'s call (``call`` on ``given``, the micro-batch of ``rows`` rows) returned a scalar loss
    that is not the mean of the halves' (module docstring)."""
    whole = own_scalar(output)
    if whole is None or rows < 2 or rows % 2:
        return
    fn = module_fn(layer.fn)
    twin = None if fn is None else module_copy(layer.fn)
    if fn is None or twin is None:
        return
    half = rows // 2

    def part(start: int) -> Any:
        return optree.tree_map(
            lambda t: t[start:start + half] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows
            else t, given, none_is_leaf=True)

    values: list[float] = []
    try:
        for start in (0, half):
            cpu = torch.get_rng_state()
            with torch.no_grad(), fn.replicas.probing(twin), _generators_kept(given), _no_collectives(sizes):
                got = own_scalar_value(call(part(start)))
                drew = not torch.equal(cpu, torch.get_rng_state())
            if got is None or drew:
                return  # (no scalar on half the rows, or a draw: the halves' values would differ by it)
            values.append(got)
    except Exception:  # a layer that cannot run on fewer rows: not probed
        return
    measured = float(whole.detach().double())
    mean = (values[0] + values[1]) / 2
    floats = [t for t in optree.tree_leaves(given) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    dtype = computed_dtype(whole)  # (a float16 loss the policy's output cast to float32 is judged as float16)
    rtol = RTOL_FLOAT64 if dtype == torch.float64 else \
        RTOL_FLOAT32 if dtype == torch.float32 and _exact_float32_matmuls(floats) else RTOL
    if abs(measured - mean) <= rtol * max(abs(measured), abs(values[0]), abs(values[1])):
        return
    summed = abs(measured - (values[0] + values[1])) <= rtol * abs(measured)
    raise ValueError(
        f"the model's own loss (the scalar layer {layer.name!r} returns) is not a mean over the batch's rows, which a "
        f"step that cuts the batch ({cut}) needs: the step takes the mean of the losses of the parts it computes. On "
        f"the {rows} rows of this rank's first micro-batch it gave {measured:.6g}, and {values[0]:.6g} and "
        f"{values[1]:.6g} on their two halves, whose mean is {mean:.6g}"
        + (" (their sum: a loss summed over the rows, reduction='sum'?)" if summed else "")
        + ": this step would train another model than the single-device step. Return the mean over the rows from "
        "the forward, or return the per-row outputs and compute the loss in loss_fn (where its form is probed, and "
        "train_step(tokens=...) takes a mean over counted tokens); a loss over the whole batch (in-batch negatives) "
        "cannot be computed on a part of it: do not cut the batch, or pass tokens='per_shard_mean' to train on the "
        "mean of the parts' losses knowingly"
    )


def own_scalar_value(output: Any) -> float | None:
    """The value of the scalar loss ``output`` holds (computed under no_grad: any 0-dim floating tensor), or None."""
    if isinstance(output, torch.Tensor):
        return float(output.double()) if output.dim() == 0 and output.is_floating_point() else None
    if type(output).__module__.startswith("transformers.") or not isinstance(output, (tuple, list, Mapping)):
        return None
    leaves: list[Any] = optree.tree_leaves(output)  # type: ignore[arg-type]
    found = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()), None)
    return None if found is None else float(found.double())
