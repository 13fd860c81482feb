"""A scalar loss the model computes in its own forward, probed where the step cuts the batch.

``loss_rows.py`` probes ``loss_fn`` on halves of the model's output; a loss the model returned as a scalar (a
forward ending in ``return F.mse_loss(recon, x, reduction="sum")``, nanoGPT's ``(logits, loss)``) has no rows to
cut there, so it was not probed: a sum over the rows (a VAE's), an in-batch contrastive loss or a mean over a
float mask computed in the forward trained the mean of the parts' losses (half the sum at dp 2), without an error.

On the step's first call where the batch is cut and the loss is a mean (``train_step(tokens=None)``), the last
layer, whose whole output is the scalar, is called again under ``no_grad`` on the two halves of its input's rows
(the tensors whose dim 0 has the micro-batch's rows; the others whole), on a copy of its module (nothing the step
holds sees the calls), and the mean of the halves' values is compared with the whole's, at loss_rows' tolerances
(by the dtype the loss was computed in): another value is refused, naming what was measured. Not probed: a scalar
beside other outputs (nanoGPT's ``(logits, loss)``, a router's aux term, a logged accuracy: which one loss_fn reads
cannot be told), a layer that draws random numbers (torch's generators, Python's or numpy's: what it drew is set
back), raises on fewer rows, or whose module a split rewrote (tensor, context, expert parallel); an odd
micro-batch, or one of one row. Cost: two calls of the last layer on half the rows, once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from ..model import host_random
from ..model.chain import Layer
from ..model.module_call import module_fn
from ..torch_api import computed_dtype
from .first_call_state import generators_kept, module_copy, no_collectives
from .loss_rows import RTOL, RTOL_FLOAT32, RTOL_FLOAT64, exact_float32_matmuls
from .rng import default_generators


def own_scalar(output: Any) -> torch.Tensor | None:
    """The scalar loss the model returned: its whole output, a 0-dim floating tensor that requires grad; None
    otherwise. A scalar beside other outputs (nanoGPT's ``(logits, loss)``, a router's aux term, a logged accuracy,
    a logit scale) is not judged: which of them loss_fn reads cannot be told (the review: the first scalar of a
    dict was an accuracy, or a logit scale beside the loss)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point() and output.requires_grad:
        return output
    return None


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
    devices = {t.device for t in optree.tree_leaves(given) if isinstance(t, torch.Tensor)}
    generators = {id(g): g for d in devices | {whole.device} for g in default_generators(d)}.values()
    try:
        for start in (0, half):
            states, host = [g.get_state() for g in generators], host_random.capture()
            with torch.no_grad(), fn.replicas.probing(twin), generators_kept(given), no_collectives(sizes):
                got = own_scalar_value(call(part(start)))
                # (a dropout's draws on any generator, or Python's or numpy's: a LayerDrop drawing with random)
                drew = host_random.moved(host) or any(
                    not torch.equal(g.get_state(), was) for g, was in zip(generators, states, strict=True))
            host_random.restore(host)
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
        RTOL_FLOAT32 if dtype == torch.float32 and exact_float32_matmuls(floats) else RTOL
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
    """The value of the scalar loss ``output`` is (computed under no_grad: a 0-dim floating tensor), or None."""
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return float(output.double())
    return None
