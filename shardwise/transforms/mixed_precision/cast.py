"""The cast mixed_precision puts around each layer: what runs in the compute dtype and what keeps its own.

Parameters arrive as compute copies (cast once per step by the step). A layer's floating input
runs in the compute dtype. Its buffers keep the dtype they are stored in, as under
torch.autocast and FSDP/FSDP2 (``buffer_dtype=None``): a rotary ``inv_freq`` or a float position
table rounded to bf16 puts positions past 256 on a coarse grid (RoPE's cos at position 1000 was
0.18 off). The exception is a normalisation module's running statistics, which torch's batch
norm kernels need in the dtype of the weight they are used with (FSDP1 keeps such modules whole
for this reason); they follow the compute copies, and so do frozen parameters (``Layer.frozen``:
weights the chain carries with the buffers, which FSDP2's ``param_dtype`` casts too; kept in float32,
a frozen Linear's weight met bf16 activations and refused the step). ``buffers=compute`` in the
policy casts every floating buffer, as mixed_precision did before.

An input that needs no gradient (an additive attention mask, a position table built by an
earlier layer kept in f32) is cast saturating: ``finfo(float32).min`` becomes the compute dtype's
most negative finite value instead of ``-inf``, so a fully masked row stays finite rather than
turning into NaN in the softmax. Activations (which need a gradient) keep the plain cast: a real
overflow shows as ``inf`` and the loss scale sees it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ...engine.model.chain import Layer
from ...engine.model.module_call import module_fn
from ...engine.model.reuse import reuse_key

# What torch says when two operands of one kernel have different dtypes (matmul, addmm, conv,
# layer/batch norm, attention, index_copy, ...): read only to add the likely cause to the error.
_DTYPE_MISMATCH = re.compile(r"dtype|scalar type|\btype\b.*\b(same|does not equal)", re.IGNORECASE)


class Cast:
    """A layer fn whose floating inputs and tensors run in ``compute`` (and output leaves in
    ``output``), except the buffers named in ``kept``, which keep their stored dtype."""

    def __init__(self, fn: Any, compute: torch.dtype, output: torch.dtype | None, *, layer: str = "",
                 kept: frozenset[str] = frozenset()) -> None:
        self.fn, self.compute, self.output, self.layer, self.kept = fn, compute, output, layer, kept

    @property
    def __wrapped__(self) -> Any:
        """The layer function it casts around (remat_of and the accounting look through it)."""
        return self.fn

    def reuse_key(self) -> Any:
        """Equal for casts alike around layer functions that compute alike (engine/model/reuse.py)."""
        inner = reuse_key(self.fn)
        return None if inner is None else (Cast, self.compute, self.output, self.kept, inner)

    def __call__(self, tensors: Mapping[str, torch.Tensor], x: Any) -> Any:
        # Parameters arrive already cast once per step by the step; `.to` is then free.
        tensors = {k: v if k in self.kept else _to(v, self.compute) for k, v in tensors.items()}
        try:
            y = self.fn(tensors, optree.tree_map(lambda t: _to_input(t, self.compute), x))
        except RuntimeError as error:
            kept = sorted(k for k in self.kept if _other_float(tensors.get(k), self.compute))
            # Only torch's plain RuntimeError: its subclasses (out of memory, not implemented) say something else.
            if type(error) is not RuntimeError or not kept or not _DTYPE_MISMATCH.search(str(error)):
                raise
            raise RuntimeError(_kept_buffers_hint(self.layer, kept, tensors, self.compute, error)) from error
        output = self.output
        return y if output is None else optree.tree_map(lambda t: _to(t, output), y)


def _to(t: Any, dtype: torch.dtype) -> Any:
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _to_input(t: Any, dtype: torch.dtype) -> Any:
    """A layer input in ``dtype``: saturating where it needs no gradient (masks)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
        return saturating_cast(t, dtype)
    return _to(t, dtype)


def saturating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, with ``t``'s own dtype's extremes (``finfo(float32).min``, what an additive
    mask is built with) at ``dtype``'s: in bf16 that mask value is bf16's min, not -inf. Any other
    value beyond ``dtype``'s range overflows to ±inf as in a plain cast: a frozen layer's activation
    or a batch feature that overflows float16 must still reach the loss scale as inf.

    >>> t = torch.tensor([torch.finfo(torch.float32).min, -1.0, float("-inf"), 7e4])
    >>> inf = float("inf")
    >>> saturating_cast(t, torch.float16).tolist() == [torch.finfo(torch.float16).min, -1.0, -inf, inf]
    True
    """
    if t.dtype == dtype or not t.is_floating_point() or torch.finfo(dtype).max >= torch.finfo(t.dtype).max:
        return t.to(dtype)
    source, limit = torch.finfo(t.dtype), torch.finfo(dtype)
    return t.to(dtype).masked_fill(t == source.min, limit.min).masked_fill(t == source.max, limit.max)


def _other_float(t: Any, dtype: torch.dtype) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype


def _kept_buffers_hint(layer: str, kept: list[str], tensors: Mapping[str, torch.Tensor], compute: torch.dtype,
                       error: RuntimeError) -> str:
    listed = ", ".join(f"{k} ({tensors[k].dtype})" for k in kept)
    return (
        f"mixed_precision: layer {layer!r} failed with a dtype mismatch while computing in {compute}, and it holds "
        f"floating buffers that keep their own dtype: {listed}. A buffer used in arithmetic with the activations "
        "(x + pe[:T], say) promotes them to its dtype, and a later matmul with a compute-dtype weight then fails. "
        "Cast the buffer in the module's forward (pe.to(x.dtype)), or cast buffers to the compute dtype for this "
        f"layer: mixed_precision(..., overrides={{{layer!r}: 'buffers=compute'}}) (or 'buffers=compute' in the "
        f"policy, for every layer). torch said: {error}"
    )


def kept_buffers(layer: Layer, cast_buffers: bool) -> frozenset[str]:
    """The floating buffers of ``layer`` that keep their stored dtype: all but its frozen parameters
    (weights it does not train, computed as parameters are, as FSDP2's param_dtype casts them) and a
    normalisation module's running statistics (which torch's batch norm needs in its weight's dtype);
    none under ``buffers=compute``."""
    if cast_buffers:
        return frozenset()
    floating = {k for k, t in layer.buffers.items() if t.is_floating_point()}
    return frozenset(floating - layer.frozen - _norm_statistics(layer))


def _norm_statistics(layer: Layer) -> set[str]:
    found = module_fn(layer.fn)
    replicas = getattr(found, "replicas", None)
    module, prefix = getattr(replicas, "module", None), str(getattr(replicas, "prefix", ""))
    if not isinstance(module, nn.Module):
        return set()
    return {
        prefix + (f"{path}." if path else "") + name
        for path, sub in module.named_modules() if isinstance(sub, _NormBase)
        for name in ("running_mean", "running_var")
    }
