"""A load holds the rank's own state and one read, never a parameter the rank does not keep whole.

Four rank processes load, at ZeRO-3 over four ranks, an AdamW checkpoint of a model whose
training state does not fit one rank's budget. Peak memory is the kernel's high-water mark
(VmHWM) of each process above its RSS when the load starts, after a warm-up load of a tiny
checkpoint (imports and one-time setup are not the model's). glibc's mmap and trim thresholds
are fixed at 128 KiB in the ranks so that freed tensors go back at once and RSS follows live
memory (the suite's ``live_malloc_gloo4`` ranks, which test_meta_init_memory.py measures on too).
The bound is the rank's state (a quarter of the parameters and of both moments) plus one layer of
the model: what a load needs beyond its result is one read (``READ_BYTES``, 4 MiB,
under a layer's 4 MiB here), so a load that built any whole layer's tensors besides would pass
it only with the rest of the state exactly in place; building whole tensors of every parameter,
as loads did before, is far over it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.checkpoint.record_io import READ_BYTES
from shardwise.testing.memory import PeakRSS

pytestmark = pytest.mark.gloo

WIDTH, LAYERS, WORLD = 1024, 12, 4
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4
MODEL_BYTES = LAYERS * LAYER_BYTES
STATE_BYTES = 3 * MODEL_BYTES  # parameters and AdamW's two moments
RANK_STATE = STATE_BYTES // WORLD
BUDGET = RANK_STATE + LAYER_BYTES


def _step(width: int, meta: bool) -> tuple[sw.Step, dict]:
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])
    chain, params = sw.functionalize(model)
    return sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-3)), "dp", stage=3), params


def _save(path: Path, width: int) -> None:
    step, params = _step(width, meta=False)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(2 * WORLD, width, generator=gen), torch.randn(2 * WORLD, width, generator=gen))
    state, _ = step(step.init(params, sw.Mesh(dp=WORLD)), batch)
    sw.checkpoint.save(path, state, step)


def _load(root: Path) -> tuple[int, int]:
    """(peak bytes above the start of the load, bytes of the loaded state) on this rank."""
    tiny, _ = _step(8, meta=True)
    sw.checkpoint.load(root / "tiny", tiny, sw.Mesh(dp=WORLD))  # warm-up: the same code on a tiny model
    step, _ = _step(WIDTH, meta=True)  # built on meta: the model itself takes no memory
    meter = PeakRSS()
    state = sw.checkpoint.load(root / "big", step, sw.Mesh(dp=WORLD))
    peak = meter.peak()
    held = sum(t.numel() * t.element_size() for t in state.params.values())
    held += sum(t.numel() * t.element_size() for tree in (state.opt_state.exp_avg, state.opt_state.exp_avg_sq)
                for t in tree.values())
    return peak, held


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, live_malloc_gloo4: Any) -> list[tuple[int, int]]:
    root = tmp_path_factory.mktemp("ckpt")
    sw.launch(functools.partial(_save, root / "tiny", 8), WORLD)
    sw.launch(functools.partial(_save, root / "big", WIDTH), WORLD)
    return live_malloc_gloo4.run(functools.partial(_load, root))


def test_a_zero3_load_at_world_4_peaks_at_the_ranks_state_plus_one_layer(measured: list[tuple[int, int]]) -> None:
    assert READ_BYTES <= LAYER_BYTES  # what the bound leaves for the load's one read
    assert STATE_BYTES > BUDGET  # the whole state would not fit a rank
    for peak, held in measured:
        assert held >= RANK_STATE  # a quarter of every unit, padded
        assert peak < BUDGET, f"peak {peak >> 20} MiB, budget {BUDGET >> 20} MiB (state {held >> 20} MiB)"
        assert peak > RANK_STATE // 2  # the measurement sees the state being made
