"""``checkpoint_name(x, name)``: tag a value inside layer code so a remat policy can save it.

After ``jax.ad_checkpoint.checkpoint_name``. The tag must be visible to the
selective-checkpoint policy, which sees aten-level ops below autograd, so it is
a real operator, ``torch.ops.shardwise.checkpoint_name(x, name)``, registered
with ``torch.library``. Its forward returns a copy of ``x`` (a custom op may
not return an alias of its input; the copy is exact, so results never change)
and its gradient is the identity.

Autograd reaches the operator through a small ``autograd.Function`` with
``setup_context``, ``jvp`` and a generated vmap rule, so ``checkpoint_name``
works under ``loss.backward()`` and under ``torch.func.grad`` / ``vjp`` /
``vmap`` alike (a ``torch.library.register_autograd`` formula is refused by
torch.func in torch 2.13, hence the Function).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...collectives.function import QuickApplyFunction

OP_NAME = "shardwise::checkpoint_name"


@torch.library.custom_op(OP_NAME, mutates_args=())
def _checkpoint_name_op(x: Tensor, name: str) -> Tensor:
    return x.clone()


@_checkpoint_name_op.register_fake
def _(x: Tensor, name: str) -> Tensor:
    return torch.empty_like(x)


@_checkpoint_name_op.register_vmap
def _(info: Any, in_dims: tuple[int | None, ...], x: Tensor, name: str) -> tuple[Tensor, int | None]:
    return _checkpoint_name_op(x, name), in_dims[0]


#: The OpOverload a policy sees for a tagged value; its args are ``(x, name)``.
CHECKPOINT_NAME_OP = torch.ops.shardwise.checkpoint_name.default


class _CheckpointName(QuickApplyFunction):
    """The named copy in forward, the identity in backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, name: str) -> Tensor:
        return _checkpoint_name_op(x, name)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None

    @staticmethod
    def jvp(ctx: Any, x_tangent: Tensor, name_tangent: Any) -> Tensor:
        return x_tangent


def checkpoint_name(x: Tensor, name: str) -> Tensor:
    """Tag ``x`` as ``name``; ``save_only_these_names(name)`` then keeps it for backward.

    Returns a tensor equal to ``x`` (bitwise), to be used in its place.

    >>> import torch
    >>> import shardwise as sw
    >>> h = sw.policies.checkpoint_name(torch.ones(2), "h")
    >>> h
    tensor([1., 1.])
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"checkpoint_name(x, {name!r}): x must be a tensor, got {type(x).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"checkpoint_name(x, name={name!r}): the name must be a non-empty string")
    result: Tensor = _CheckpointName.apply(x, name)
    return result
