"""meta_like: a user's optimizer's ``*_like`` calls on meta tensors without torch's Python references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardwise.engine.optim.meta_like import meta_like

META = torch.empty(3, 4, device="meta")
CALLS = [
    ("zeros_like", lambda t: torch.zeros_like(t)),
    ("zeros_like preserve_format", lambda t: torch.zeros_like(t, memory_format=torch.preserve_format)),
    ("empty_like float64", lambda t: torch.empty_like(t, dtype=torch.float64)),
    ("ones_like requires_grad", lambda t: torch.ones_like(t, requires_grad=True)),
    ("full_like", lambda t: torch.full_like(t, 2.0)),
    ("randn_like device meta", lambda t: torch.randn_like(t, device="meta")),
    ("rand_like contiguous_format", lambda t: torch.rand_like(t, memory_format=torch.contiguous_format)),
    # run as torch runs them:
    ("zeros_like of a transpose", lambda t: torch.zeros_like(t.t())),
    ("zeros_like channels_last", lambda t: torch.zeros_like(t.view(1, 3, 2, 2), memory_format=torch.channels_last)),
    ("zeros_like on the cpu", lambda t: torch.zeros_like(t, device="cpu")),
    ("zeros_like of a cpu tensor", lambda t: torch.zeros_like(torch.ones(2, 3))),
]


def _described(t: torch.Tensor) -> tuple[Any, ...]:
    return t.shape, t.dtype, t.device, t.stride(), t.requires_grad


@pytest.mark.parametrize("call", [c for _, c in CALLS], ids=[name for name, _ in CALLS])
def test_each_call_gives_what_torchs_own_gives(call: Any) -> None:
    with meta_like():
        ours = call(META)
    assert _described(ours) == _described(call(META))


USER_OPTIMIZER = r"""
import sys
import optree
import torch
import shardwise as sw

class Momentum:
    # a user's optimizer over any pytree of parameters (under ZeRO: each unit's flat shard), its state
    # and temporaries made with the *_like factories, as one writes them
    elementwise = True  # its update treats each element alone, so ZeRO may hand it flat shards

    def init(self, params):
        return {"step": torch.zeros((), dtype=torch.int64), "buf": optree.tree_map(torch.zeros_like, params)}

    def update(self, grads, state, params):
        bufs = optree.tree_map(lambda b, g: torch.empty_like(b).copy_(b).mul_(0.9).add_(g), state["buf"], grads)
        new_params = optree.tree_map(lambda p, b: p - 0.1 * b, params, bufs)
        return new_params, {"step": state["step"] + 1, "buf": bufs}

def first_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    chain, params = sw.functionalize(model)
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, Momentum()), "dp", 3)
    state = step.init(params, sw.Mesh(dp=2))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        state, metrics = step(state, (torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)))
    return float(metrics["loss"])

if __name__ == "__main__":
    with torch.random.fork_rng():
        losses = sw.launch(first_steps, 2)
    assert losses[0] == losses[1] and losses[0] > 0, losses
    print(repr(sorted(m for m in sys.modules if m.split(".")[0] == "sympy")))
"""


def test_a_user_optimizer_under_zero3_imports_no_sympy(fresh_interpreter: Callable[..., str]) -> None:
    """The Plan and the state's layout run a user's optimizer on meta tensors at init, on every rank:
    its torch.zeros_like there imported sympy (0.36 s of CPU, 36 MiB)."""
    assert eval(fresh_interpreter(USER_OPTIMIZER).strip().splitlines()[-1]) == []
