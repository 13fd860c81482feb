"""Which optimizers a stack may hand pieces of parameters: only those that say they are elementwise.

Under a SHARDING spec (ZeRO, every stage) the optimizer's update gets one flat 1-D shard per layer;
under a SPLIT that cuts parameters (tensor parallel's slices, expert parallel's experts) it gets
slices. An elementwise update (sw.optim's, or a user's that declares ``elementwise = True``) of
such pieces is the pieces of its update on whole parameters. Any other update may read a whole
tensor (a norm per parameter, its shape): on a piece it computes another step than the
single-device one and trains on without an error, so :func:`check_optimizer` refuses it when
the transform is applied (compose.add), and ``Step.init`` again (a step whose optimizer was
replaced since).

A SPLIT spec says what the update gets in its optional ``optimizer_gets`` (words, for the error),
or None where every parameter stays whole (context parallel); a split that does not say is taken
to cut the parameters its ``tensor_splits`` names.
"""

from __future__ import annotations

from typing import Any

from ..optim.optimizers import Optimizer, is_elementwise
from .roles import SHARDING, SPLIT

_UNSAID = object()

# What a ZeRO sharding hands the update: the engine lays the shards out (layout/sharding.py).
FLAT_SHARDS = (
    "one flat 1-D shard per layer (all of the layer's parameters flattened into one vector, and this "
    "rank's contiguous piece of it)"
)


def optimizer_gets(spec: Any) -> str | None:
    """What the optimizer's update gets of the parameters under ``spec``, when not whole ones (None)."""
    if spec.role == SHARDING:
        return FLAT_SHARDS
    if spec.role == SPLIT:
        said = getattr(spec, "optimizer_gets", _UNSAID)
        if said is _UNSAID:
            return f"this rank's slices of the parameters {spec.name} cuts"
        return None if said is None else str(said)
    return None


def check_optimizer(stack: tuple[Any, ...], optimizer: Any) -> None:
    """Refuse an optimizer that does not say it is elementwise under a spec of ``stack`` that hands
    its update pieces of parameters, naming the optimizer, the transform, the pieces and the fix."""
    handing = [(spec, gets) for spec in stack if (gets := optimizer_gets(spec)) is not None]
    if not handing or is_elementwise(optimizer):
        return
    spec, gets = handing[0]
    raise ValueError(
        f"{spec} hands the optimizer's update {gets}, not whole parameters, and the optimizer "
        f"{_described(optimizer)} does not say it is elementwise. An update that reads a whole tensor (a norm "
        "per parameter, as LARS's and LAMB's trust ratios; its shape, as a rule that decays only weights with "
        "p.dim() >= 2; Adafactor's factored moments; Muon's orthogonalisation) would compute that on the pieces "
        "instead: another step than the single-device one, without an error. If its update treats each element "
        "alone (every element of its results from the same element of grads, params and state, and scalars such "
        "as the learning rate and the step count), declare it: elementwise = True on the optimizer (a class "
        "attribute, or sw.optim.Optimizer(init, update, elementwise=True)). Else use sw.optim.sgd or "
        "sw.optim.adamw (with sw.optim.group(where=lambda name, p: p.dim() >= 2, ...) to pick parameters by their "
        "whole shape), or a stack that hands the optimizer whole parameters (one device, a pipeline without "
        "shard_params)"
    )


def _described(optimizer: Any) -> str:
    """The optimizer by its type, or a functional one by its update (no memory address: a repr has one)."""
    update = getattr(optimizer, "update", None)
    update_name = getattr(update, "__qualname__", type(update).__qualname__)
    if isinstance(optimizer, Optimizer):
        return f"sw.optim.Optimizer(update={update_name})"
    return type(optimizer).__qualname__
