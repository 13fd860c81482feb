"""Remat policies: predicates that say which op outputs are saved for backward.

After ``jax.checkpoint`` policies (``jax/_src/ad_checkpoint.py``). A policy is
called as ``policy(op, *args, **kwargs) -> bool`` for every aten op the
layer's forward dispatches (``op`` is a ``torch._ops.OpOverload``, ``args``
its inputs): ``True`` saves the op's output, ``False`` lets backward recompute
it. Any callable of that shape is a policy; the ones here are small frozen
dataclasses, so they compare, hash and print as values. This module knows
nothing of torch's checkpoint machinery: ``_torch_sac`` adapts predicates to it.

On CPU, ``nn.Linear`` dispatches ``aten.addmm`` (``aten.mm`` without bias;
``matmul`` and ``linear`` are decomposed before a policy sees them) and
``F.scaled_dot_product_attention`` dispatches
``aten._scaled_dot_product_flash_attention_for_cpu`` in float32 and float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .names import CHECKPOINT_NAME_OP

__all__ = [
    "DOT_OPS",
    "DotsSaveable",
    "EverythingSaveable",
    "NothingSaveable",
    "OffloadToCpu",
    "SaveOnlyTheseNames",
    "dots_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload_to_cpu",
    "save_only_these_names",
]

_aten = torch.ops.aten


def _packets(*names: str) -> frozenset[Any]:
    # Kernels missing from a build (say a CUDA-only attention) are skipped, not an error.
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


#: Op packets whose outputs ``dots_saveable`` keeps: matrix multiplies and fused attention.
DOT_OPS: frozenset[Any] = _packets(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",  # CompositeImplicit: decomposed to mm/bmm before a policy sees it; listed for clarity
    "linear",  # likewise, to addmm/mm
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


@dataclass(frozen=True)
class NothingSaveable:
    """Save nothing but the layer's inputs; backward recomputes the whole layer (plain remat)."""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return "nothing_saveable"


@dataclass(frozen=True)
class EverythingSaveable:
    """Save everything autograd saves: the layer runs exactly as without remat."""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return True

    def __repr__(self) -> str:
        return "everything_saveable"


@dataclass(frozen=True)
class DotsSaveable:
    """Save the outputs of matrix multiplies and attention kernels (:data:`DOT_OPS`); recompute the rest."""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return getattr(op, "overloadpacket", None) in DOT_OPS

    def __repr__(self) -> str:
        return "dots_saveable"


@dataclass(frozen=True)
class SaveOnlyTheseNames:
    """Save only values tagged with :func:`checkpoint_name` under one of ``names``."""

    names: frozenset[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(self.names))
        bad = sorted(repr(n) for n in self.names if not isinstance(n, str) or not n)
        if bad:
            raise TypeError(f"save_only_these_names: names are non-empty strings, got {', '.join(bad)}")

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return op == CHECKPOINT_NAME_OP and len(args) > 1 and args[1] in self.names

    def __repr__(self) -> str:
        return f"save_only_these_names({', '.join(repr(n) for n in sorted(self.names))})"


@dataclass(frozen=True)
class OffloadToCpu:
    """Keep what ``policy`` saves in host memory: moved to CPU in forward, back in backward.

    The move is done by saved-tensor hooks on everything autograd saves for
    the layer (the layer's own parameters and buffers excepted: they stay where
    they are anyway) and on the inputs a checkpoint keeps. Tensors already on
    the CPU are kept as they are, so on a CPU-only machine this is a no-op.
    Outputs that a selective ``policy`` (e.g. ``dots_saveable``) caches stay
    on their device: torch's selective checkpoint keeps its cache outside
    autograd's saved tensors, and honours its own CPU-offload decision only
    under ``torch.compile``.
    """

    policy: Any = EverythingSaveable()
    pin_memory: bool = True

    def __post_init__(self) -> None:
        refuse_class(self.policy, "offload_to_cpu(policy=...)")
        if not callable(self.policy):
            raise TypeError(f"offload_to_cpu(policy={self.policy!r}): the policy must be a predicate")
        if isinstance(self.policy, OffloadToCpu):
            raise ValueError("offload_to_cpu(offload_to_cpu(...)): offload once")

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return bool(self.policy(op, *args, **kwargs))

    def __repr__(self) -> str:
        return f"offload_to_cpu({self.policy!r})"


def refuse_class(policy: Any, where: str) -> None:
    """Refuse a policy's class where a policy is wanted: a class is callable, so it would pass
    for a predicate and fail at the first step (``NothingSaveable(op, *args)``)."""
    if not isinstance(policy, type):
        return
    instances = {NothingSaveable: "nothing_saveable", EverythingSaveable: "everything_saveable",
                 DotsSaveable: "dots_saveable"}
    builders = {SaveOnlyTheseNames: "save_only_these_names('name', ...)", OffloadToCpu: "offload_to_cpu(...)"}
    name = policy.__name__
    if policy in instances:
        fix = f"pass an instance: {name}() (or sw.policies.{instances[policy]}, or the name {instances[policy]!r})"
    elif policy in builders:
        fix = f"build one: {builders[policy]}"
    else:
        fix = f"pass an instance, {name}(...), whose __call__(op, *args, **kwargs) answers True (save) or False"
    raise TypeError(f"{where.replace('...', name)}: this is a policy class, not a policy; {fix}")


nothing_saveable = NothingSaveable()
everything_saveable = EverythingSaveable()
dots_saveable = DotsSaveable()


def save_only_these_names(*names: str) -> SaveOnlyTheseNames:
    """Save only the values tagged ``checkpoint_name(x, name)`` with a name in ``names``."""
    return SaveOnlyTheseNames(frozenset(names))


def offload_to_cpu(policy: Any = everything_saveable, *, pin_memory: bool = True) -> OffloadToCpu:
    """Save what ``policy`` saves (default: everything), but in host memory (see :class:`OffloadToCpu`)."""
    return OffloadToCpu(policy, pin_memory)
