"""functionalize owns no second copy of the model: measured as resident memory of a rank process.

The suite's ``live_malloc_gloo4`` ranks run with glibc's mmap and trim thresholds fixed at 128 KiB,
so that freed tensors go back to the system at once and VmRSS follows live memory (with its defaults
glibc may keep freed memory, and the test would measure the allocator instead of shardwise). Rank 0
measures; the others wait.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.testing.memory import status_bytes

MODEL_BYTES = 12 * (1024 * 1024 + 1024) * 4


def _measure(split: str) -> dict[str, int] | None:
    """VmRSS before and after building the model, functionalizing it and deleting it (rank 0)."""
    if current_backend().rank != 0:
        return None

    units = None if split == "sequential" else nn.Linear
    torch.manual_seed(0)
    # The first call imports what its split needs (torch.fx alone is tens of MB): not the model's.
    sw.functionalize(nn.Sequential(nn.Linear(2, 2)), units=units, example_input=torch.randn(1, 2))
    gc.collect()
    base = status_bytes("VmRSS")
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])
    built = status_bytes("VmRSS")
    chain, params = sw.functionalize(model, units=units, example_input=torch.randn(2, 1024))
    functionalized = status_bytes("VmRSS")
    del model, params
    gc.collect()
    deleted = status_bytes("VmRSS")
    return {"base": base, "built": built, "functionalized": functionalized, "deleted": deleted,
            "layers": len(chain)}


@pytest.mark.gloo  # on the suite's LIVE_MALLOC gloo ranks
@pytest.mark.parametrize("split", ["sequential", "fx"])
def test_deleting_the_model_after_functionalize_frees_its_memory(split: str, live_malloc_gloo4: Any) -> None:
    rss = live_malloc_gloo4.run(_measure, split)[0]
    assert rss["layers"] == 12
    assert rss["built"] - rss["base"] > 0.9 * MODEL_BYTES  # the measurement sees the model
    # functionalize copies no parameter (before, it copied every one: +100% of the model)
    assert rss["functionalized"] - rss["built"] < 0.1 * MODEL_BYTES
    # and the chain keeps none alive: deleting the model and its params gives the memory back
    assert rss["functionalized"] - rss["deleted"] > 0.9 * MODEL_BYTES
