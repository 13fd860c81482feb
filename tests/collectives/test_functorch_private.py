"""The torch.func internals the collectives rely on (collectives/_functorch.py) still behave."""

from __future__ import annotations

import pytest
import torch

from shardwise.collectives._functorch import unwrap


def test_unwrap_gives_the_plain_tensor_under_torch_func_grad() -> None:
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        plain = unwrap(x)
        seen.append((type(plain) is torch.Tensor, plain.requires_grad))
        return (x * x).sum()

    x = torch.randn(3)
    assert torch.equal(torch.func.grad(f)(x), 2 * x)
    assert seen == [(True, False)]
    assert unwrap(x) is x


def test_unwrap_refuses_vmap() -> None:
    with pytest.raises(NotImplementedError, match=r"do not support torch\.func\.vmap"):
        torch.func.vmap(lambda x: unwrap(x))(torch.randn(2, 3))
