"""The parameters as the optimizer and the layers see them under a step's precision policy.

The optimizer updates master copies (each layer's policy's ``params`` dtype); the layers compute
with compute copies (its ``compute`` dtype); gradients come back in the master dtype, divided by
the loss scale. Without a policy (``precision`` None) every dtype is the parameters' own.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..layout.precision import Precision
from ..layout.state import Params, map_params


def master_params(precision: Precision | None, params: Params) -> Params:
    """Detached copies of the parameters in the stored (master) dtype of each layer's policy."""
    # Always copies: the step owns its state (an in-place optimizer writes into it), so the
    # caller's tensors must never be the state's.
    if precision is None:
        return map_params(lambda t: t.detach().clone(), params)
    refuse_complex(params)
    return {
        layer: {k: t.detach().to(precision.for_layer(layer).params, copy=True) for k, t in tensors.items()}
        for layer, tensors in params.items()
    }


def master_meta(precision: Precision | None, params: Params) -> Params:
    """The master parameters as meta tensors: shapes and stored dtypes, no data."""
    if precision is not None:
        refuse_complex(params)
    return {
        layer: {
            k: torch.empty(t.shape, dtype=t.dtype if precision is None else precision.for_layer(layer).params,
                           device="meta")
            for k, t in tensors.items()
        }
        for layer, tensors in params.items()
    }


def refuse_complex(params: Params) -> None:
    """Refuse a complex parameter under a precision policy: its dtypes are real ones, and casting a
    complex tensor to one drops its imaginary part (torch only warns), so a learnable spectral
    filter would train as a real one, without an error."""
    for layer, tensors in params.items():
        for name, t in tensors.items():
            if t.is_complex():
                raise ValueError(
                    f"mixed_precision: layer {layer!r} has the complex parameter {name!r} ({t.dtype}), and a "
                    "policy's dtypes are real: its master and compute copies would lose the imaginary part. "
                    "Hold it as a real tensor with a last dim of 2 (torch.view_as_real) and make it complex "
                    "in the forward (torch.view_as_complex(w.float())), or train this model without "
                    "mixed_precision"
                )


def compute_params(precision: Precision | None, params: Params) -> Params:
    """The compute copies the layers receive (``params`` itself without a policy)."""
    return params if precision is None else precision.compute_params(params)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that clips a gradient of global ``norm`` to ``max_norm`` (torch's clip_grad_norm_)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def unscale_like(grads: Any, like: Any, scale: float) -> Any:
    """Gradients in the dtype of ``like`` (the master parameters), divided by the loss scale."""
    if scale == 1.0:
        if _same_dtypes(grads, like):  # the usual step: nothing to cast (``to`` would return each as is)
            return grads
        return optree.tree_map(lambda g, p: g.to(p.dtype), grads, like)
    return optree.tree_map(lambda g, p: g.to(p.dtype) / scale, grads, like)


def _same_dtypes(grads: Any, like: Any) -> bool:
    """Whether ``grads`` and ``like`` are dicts of dicts of tensors with the same keys and dtypes
    (False for any other tree: then the caller maps it, checking its structure)."""
    if type(grads) is not dict or type(like) is not dict or grads.keys() != like.keys():
        return False
    for layer, tensors in grads.items():
        params = like[layer]
        if type(tensors) is not dict or type(params) is not dict or tensors.keys() != params.keys():
            return False
        for name, g in tensors.items():
            p = params[name]
            if not isinstance(g, torch.Tensor) or not isinstance(p, torch.Tensor) or g.dtype != p.dtype:
                return False
    return True
