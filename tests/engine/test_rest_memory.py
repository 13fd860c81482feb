"""What ``init`` leaves a rank holding besides its state: measured as resident memory of a rank process.

``init`` compares every rank's parameters by an exact digest of each (``tensor_digest``). Its keys
were kept, one row per parameter size under 2**20 elements (up to 16 of 4 or 8 MiB), for as long as
the process lived: 7 MiB a rank at rest for a 6 + 6 layer BART beside FSDP2 (memory_encdec.py), and
up to 64-128 MiB for a model of many sizes. Now one row of 2**16 keys per word width serves every
parameter. The suite's ``live_malloc_gloo4`` ranks run with glibc's mmap and trim thresholds at 128
KiB, so that VmRSS follows live memory; rank 0 measures, the others take part in ``init``.
"""

from __future__ import annotations

import gc
from typing import Any

import optree
import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.engine.run import metrics
from shardwise.testing.memory import status_bytes

MiB = 1 << 20
# Twelve layers of twelve weight sizes, each under 2**20 elements (each kept its own key row): 1.0 to
# 3.75 MiB of float32 apiece, 28.5 MiB in all.
WIDTHS = [256 + 64 * i for i in range(12)]


class Block(nn.Module):
    """A Linear of 1024 features to ``width``, its output padded back to 1024 (so that blocks chain)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(1024, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(self.linear(x), (0, 1024 - self.linear.out_features))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _held_at_rest(world: int) -> dict[str, int] | None:
    """Rank 0's VmRSS after ``init`` with the model and its parameters dropped, above what it held
    before the model was built, and the bytes of its state's tensors."""
    rank = current_backend().rank

    def init(widths: list[int]) -> sw.TrainState:
        torch.manual_seed(0)  # every rank builds the same parameters
        model = nn.Sequential(*map(Block, widths))
        chain, params = sw.functionalize(model, units=Block, example_input=torch.randn(2, 1024))
        del model
        step = sw.shard_params(sw.train_step(chain, _loss, sw.optim.sgd(1e-3, inplace=True)), "dp", stage=3)
        return step.init(params, sw.Mesh(dp=world))

    init([8])  # warm-up: the imports and one-time setup are not the model's
    metrics._cached_keys.cache_clear()  # from no kept keys (an earlier test's would be evicted instead)
    gc.collect()
    base = status_bytes("VmRSS")
    state = init(WIDTHS)
    gc.collect()
    held = status_bytes("VmRSS") - base
    state_bytes = sum(t.untyped_storage().nbytes() for t in optree.tree_leaves((state.params, state.opt_state))
                      if isinstance(t, torch.Tensor))
    return {"held": held, "state": state_bytes} if rank == 0 else None


@pytest.mark.gloo  # on the suite's LIVE_MALLOC gloo ranks
def test_init_keeps_no_digest_keys_per_parameter_size(live_malloc_gloo4: Any) -> None:
    got = live_malloc_gloo4.run(_held_at_rest, 4)[0]
    model_bytes = sum(1024 * w * 4 for w in WIDTHS)
    assert got["state"] >= model_bytes // 4  # the measurement counts the shards
    # Measured at world 4: 0.8 MiB above the 7.1 MiB of shards (the one key row of 256 KiB, the layouts,
    # the Plan's records); with a key row per size, 29.0 MiB above them.
    assert got["held"] - got["state"] < 3 * MiB, {k: round(v / MiB, 2) for k, v in got.items()}
