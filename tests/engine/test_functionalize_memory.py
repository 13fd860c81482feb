"""functionalize owns no second copy of the model: measured as resident memory of a subprocess.

glibc's mmap and trim thresholds are fixed at 128 KiB in the child, so that freed tensors go
back to the system at once and VmRSS follows live memory (with its defaults glibc may keep
freed memory, and the test would measure the allocator instead of shardwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from shardwise.testing.memory import LIVE_MALLOC

CHILD = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from torch import nn
    import shardwise as sw
    from shardwise.testing.memory import status_bytes

    def rss():
        return status_bytes("VmRSS")

    units = None if sys.argv[1] == "sequential" else nn.Linear
    torch.manual_seed(0)
    # The first call imports what its split needs (torch.fx alone is tens of MB): not the model's.
    sw.functionalize(nn.Sequential(nn.Linear(2, 2)), units=units, example_input=torch.randn(1, 2))
    gc.collect()
    base = rss()
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])
    built = rss()
    chain, params = sw.functionalize(model, units=units, example_input=torch.randn(2, 1024))
    functionalized = rss()
    del model, params
    gc.collect()
    deleted = rss()
    print(json.dumps({"base": base, "built": built, "functionalized": functionalized,
                      "deleted": deleted, "layers": len(chain)}))
    """
)

MODEL_BYTES = 12 * (1024 * 1024 + 1024) * 4


@pytest.mark.parametrize("split", ["sequential", "fx"])
def test_deleting_the_model_after_functionalize_frees_its_memory(split: str) -> None:
    env = {**os.environ, **LIVE_MALLOC}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, split], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    assert rss["layers"] == 12
    assert rss["built"] - rss["base"] > 0.9 * MODEL_BYTES  # the measurement sees the model
    # functionalize copies no parameter (before, it copied every one: +100% of the model)
    assert rss["functionalized"] - rss["built"] < 0.1 * MODEL_BYTES
    # and the chain keeps none alive: deleting the model and its params gives the memory back
    assert rss["functionalized"] - rss["deleted"] > 0.9 * MODEL_BYTES
