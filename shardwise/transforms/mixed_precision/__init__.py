"""mixed_precision: compute in bf16/fp16 with fp32 master weights and loss scaling."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any, ClassVar

from ...engine.layout.precision import (
    DynamicLossScale,
    NoLossScale,
    Policy,
    Precision,
    StaticLossScale,
    as_loss_scale,
)
from ...engine.model.chain import Chain
from ...engine.stack.compose import REWRITE, add
from ...engine.step.step import Step
from .cast import Cast, kept_buffers

__all__ = [
    "DynamicLossScale", "NoLossScale", "Policy", "Precision", "PrecisionSpec", "StaticLossScale", "mixed_precision",
]


@dataclasses.dataclass(frozen=True)
class PrecisionSpec:
    """mixed_precision in a step's stack: the casts live in the rewritten layers, the dtypes in
    ``step.precision`` (ZeRO gathers in the compute dtype and reduces in the reduce dtype)."""

    precision: Precision

    name: ClassVar[str] = "mixed_precision"
    role: ClassVar[str] = REWRITE

    def rewrite(self, chain: Chain) -> Chain:
        return cast_chain(chain, self.precision)

    def __str__(self) -> str:
        overrides = "".join(f", {pattern}: {policy}" for pattern, policy in self.precision.overrides)
        return f"mixed_precision({str(self.precision.policy)!r}{overrides}, loss_scale={self.precision.loss_scale!r})"

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        """What the Plan says of each layer: the policy it runs under."""
        return {layer: str(self.precision.for_layer(layer)) for layer in chain.names}


def cast_chain(chain: Chain, precision: Precision) -> Chain:
    """Every layer computes in its policy's compute dtype, its floating buffers in their own unless the
    policy says ``buffers=compute``; the chain's output is in the output dtype."""
    last = len(chain) - 1
    layers = []
    for i, layer in enumerate(chain.layers):
        policy = precision.for_layer(layer.name)
        fn = Cast(layer.fn, policy.compute, policy.output if i == last else None, layer=layer.name,
                  kept=kept_buffers(layer, policy.buffers == "compute"))
        layers.append(dataclasses.replace(layer, fn=fn))
    return Chain(layers)


def _as_policy(spec: str | Policy, where: str) -> Policy:
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, str):
        return Policy.parse(spec)
    raise TypeError(f"{where}: a policy is a string such as 'params=f32,compute=bf16' or a Policy, got {spec!r}")


def mixed_precision(
    step: Step,
    policy: str | Policy = "params=f32,compute=bf16,output=f32",
    *,
    overrides: Mapping[str, str | Policy] | None = None,
    loss_scale: Any = None,
) -> Step:
    """Run ``step``'s layers in a lower precision with master weights and optional loss scaling.

    ``policy`` names the stored parameter dtype (the master weights and the
    optimizer state), the compute dtype, the model output dtype and the dtype
    gradients are reduced in across ranks; ``overrides`` maps layer-name
    patterns (fnmatch) to policies, e.g. ``{"head": "compute=f32"}`` (keys
    not given keep the default policy's). Keys not given in ``policy`` follow
    jmp: compute follows params, output follows compute, reduce follows params.
    The loss is computed on the output, in its dtype: with fp16 outputs a loss
    scale above fp16's largest value (65504) overflows at once, so fp16 compute
    with loss scaling wants ``output=f32``. Compute copies are cast once per
    step; with shard_params they are gathered in the compute dtype. Floating
    buffers keep their own dtype, as under torch.autocast (``buffers=compute``
    in a policy casts them too); inputs that need no gradient (masks) are cast
    saturating, so ``finfo(float32).min`` stays finite in bf16 (docs/guide.md, "Mixed precision").
    ``loss_scale``: None, "dynamic" (2^16, x2 every 2000 finite steps, x0.5 on
    overflow, like torch.amp.GradScaler, down to a floor of 2^-14 where a step
    still not finite raises instead of skipping for ever), a finite positive
    number (static) or a LossScale value. Under a policy, a step with a
    non-finite gradient on any rank is skipped on every rank: parameters and
    optimizer state stay as they were.

    >>> import torch, shardwise as sw
    >>> chain, params = sw.functionalize(
    ...     torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ... )
    >>> step = sw.mixed_precision(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)),
    ...                           "params=f32,compute=bf16,output=f32", loss_scale="dynamic")
    >>> state = step.init(params)
    >>> state, metrics = step(state, (torch.randn(8, 4), torch.randn(8, 1)))
    >>> state.params["0"]["weight"].dtype, float(metrics["loss_scale"]), bool(metrics["skipped"])
    (torch.float32, 65536.0, False)
    """
    if not isinstance(step, Step):
        raise TypeError(f"mixed_precision(step=...) needs a shardwise Step, got {type(step).__name__}")
    base = _as_policy(policy, "mixed_precision(policy=...)")
    extra = tuple(
        (pattern, Policy.parse(p, base) if isinstance(p, str) else _as_policy(p, f"overrides[{pattern!r}]"))
        for pattern, p in (overrides or {}).items()
    )
    for pattern, _ in extra:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in step.chain.names):
            raise ValueError(
                f"mixed_precision(overrides={{{pattern!r}: ...}}) matches no layer; layers are {list(step.chain.names)}"
            )
    precision = Precision(base, extra, as_loss_scale(loss_scale))
    return add(step, PrecisionSpec(precision), precision=precision)

