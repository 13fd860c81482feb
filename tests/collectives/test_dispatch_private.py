"""The private torch API of collectives/backends/_dispatch.py, checked so a torch that changes it fails here."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.collectives.backends._dispatch import outside_dispatch_modes


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_outside_dispatch_modes_hides_ops_from_the_thread_s_modes_and_restores_them() -> None:
    x = torch.ones(3)
    with _Seen() as seen:
        _ = x + 1
        with outside_dispatch_modes():
            _ = x * 2
        _ = x - 1
    assert any("add" in op for op in seen.ops) and any("sub" in op for op in seen.ops)
    assert not any("mul" in op for op in seen.ops)


def test_a_rank_s_dispatch_mode_sees_none_of_another_rank_s_collective_arithmetic() -> None:
    # Whichever rank arrives last computes the sum; its mode must not see that arithmetic.
    def main() -> list[str]:
        mesh = sw.Mesh(dp=2)
        with _Seen() as seen:
            sw.collectives.psum(torch.ones(2) * (mesh.rank + 1), "dp", mesh=mesh)
        return seen.ops

    for ops in sw.launch(main, 2, timeout=60):
        assert not any("add_" in op or "stack" in op for op in ops), ops


def test_the_mode_stacks_lengths_read_what_is_active() -> None:
    """outside_dispatch_modes sets nothing aside when both stacks are empty: their lengths must
    read a mode as it is entered (else the fast path would let a mode see a collective's ops)."""
    from shardwise.collectives.backends import _dispatch

    assert _dispatch._len_torch_dispatch_stack() == 0
    assert _dispatch._len_torch_dispatch_stack_pre_dispatch() == 0
    with _Seen():
        assert _dispatch._len_torch_dispatch_stack() == 1
        with outside_dispatch_modes():
            assert _dispatch._len_torch_dispatch_stack() == 0
        assert _dispatch._len_torch_dispatch_stack() == 1
    assert _dispatch._len_torch_dispatch_stack() == 0


def test_a_pre_dispatch_mode_is_counted_too() -> None:
    """Under make_fx(pre_dispatch=True) the mode sits on the pre-dispatch stack only: the fast path
    must see it there (and set it aside)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardwise.collectives.backends import _dispatch

    seen: list[tuple[int, int]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append((_dispatch._len_torch_dispatch_stack(), _dispatch._len_torch_dispatch_stack_pre_dispatch()))
        with outside_dispatch_modes():
            seen.append((_dispatch._len_torch_dispatch_stack(), _dispatch._len_torch_dispatch_stack_pre_dispatch()))
        return x + 1

    make_fx(f, pre_dispatch=True)(torch.ones(2))
    assert seen[0][1] >= 1, seen  # the mode is on the pre-dispatch stack
    assert seen[1] == (0, 0), seen  # and set aside inside
