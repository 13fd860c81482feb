"""A CPU step keeps what it frees for the next step under glibc's default malloc (run/heap.py).

Measured as minor page faults of a subprocess started without any ``MALLOC_*`` setting: without
the executor's request, the 8 x Linear(512) step below faults its 8 MB of gradients in again every
step (about 2,000 faults), because glibc gives them back to the OS when the step frees them.
Thresholds fixed in the environment are measured on the suite's LIVE_MALLOC ranks.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import pytest

from shardwise.collectives.backends.current import current_backend


def _step_faults() -> list[int]:
    """Minor page faults of each of ten steps of an 8 x Linear(512) SGD step, in this process."""
    import resource

    import torch
    from torch import nn

    import shardwise as sw

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.GELU())])
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, lambda out, y: ((out - y) ** 2).mean(), sw.optim.sgd(1e-2, momentum=0.9,
                         inplace=True), clip_norm=1.0)
    state = step.init(params)
    batch = (torch.randn(32, 512), torch.randn(32, 512))
    faults = []
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        state, metrics = step(state, batch)
        metrics["loss"].item()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


# A fresh interpreter: glibc's dynamic thresholds are still its defaults (a process that has run
# other tests may have raised them already, and would keep its gradients without the executor).
CHILD = "import json\n" + inspect.getsource(_step_faults) + "print(json.dumps(_step_faults()))\n"


def _faults_per_step(malloc: dict[str, str]) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | malloc
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    faults: list[int] = json.loads(out.stdout.strip().splitlines()[-1])
    return faults


def _rank0_step_faults() -> list[int] | None:
    return _step_faults() if current_backend().rank == 0 else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, counted by getrusage")
def test_a_cpu_step_does_not_fault_its_gradients_in_again() -> None:
    faults = _faults_per_step({})
    # 8 MB of gradients are 2,048 pages: a step that refaults them pays about that many, every step
    # (the median: a step may fault a few pages in for something else on a busy machine).
    assert statistics.median(faults[3:]) < 200, faults


@pytest.mark.gloo  # rank 0 of the suite's LIVE_MALLOC ranks: fixed thresholds, whatever ran there before
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, counted by getrusage")
def test_thresholds_fixed_in_the_environment_are_kept(live_malloc_gloo4: Any) -> None:
    # The memory tests fix them low so that resident memory follows live tensors: the step must
    # not move them (glibc does not, once they are set), so every step maps its gradients afresh.
    faults = live_malloc_gloo4.run(_rank0_step_faults)[0]
    assert statistics.median(faults[3:]) > 1500, faults
