"""The one private torch API shardwise relies on, checked so a torch change fails loudly here."""

from __future__ import annotations

import torch

from shardwise.engine._storage import free_storage, owns_storage, refill_storage


def test_free_and_refill_is_invisible_to_autograd_and_gives_the_same_gradients() -> None:
    buffer = torch.randn(6, dtype=torch.float64)
    values = buffer.clone()
    weight = buffer[:6].view(2, 3).detach().requires_grad_(True)  # as the executor makes parameter leaves
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tanh(x @ weight.t())  # saves weight for backward
    expected = torch.autograd.grad(y.sum(), weight, retain_graph=True)[0]

    free_storage(buffer)
    assert buffer.untyped_storage().nbytes() == 0 and weight.untyped_storage().nbytes() == 0
    refill_storage(buffer, values)
    assert buffer.untyped_storage().nbytes() == 48
    got = torch.autograd.grad(y.sum(), weight)[0]  # would raise if the version counter had moved
    assert torch.equal(got, expected)


def test_owns_storage() -> None:
    t = torch.zeros(10)
    assert owns_storage(t) and not owns_storage(t[2:]) and not owns_storage(t[:5])
