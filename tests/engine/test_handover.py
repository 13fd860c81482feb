"""A layer's output that the next layer keeps nothing of is freed once the next layer ran, as in a plain torch loop.

The executor held every layer's output until that layer's backward: on one device and under ZeRO-1/2
in a dict of outputs, under ZeRO-3 (a unit per stage, each backward on its own) as its backward's
root. Where the next layer saves nothing of it (a Linear's output before a ReLU, which saves its own
output), a plain torch loop frees it after the ReLU: held, it cost one activation per such layer
(Linear(2048) + ReLU, 2048 rows, one device: 192 MiB above the state at rest, 112 now; ZeRO-3 at
world 4: 104 MiB peak a rank, 88 now). The memory must stay wherever anything may still read it:
a saved input or view, an output its own op saved, a Python reference (a checkpointed layer's
arguments, a custom autograd Function's ``ctx`` attribute). ``Probe`` looks, two layers later,
whether the watched output's memory is gone; every run is compared with the one-device step.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.engine.run import handover
from shardwise.engine.torch_api import is_fake

_watched = threading.local()  # each rank thread's last watched output and its memory (weak references)
_seen: list[bool] = []  # what each Probe saw: True where the watched output's memory was gone


class Watched(nn.Module):
    """A Linear whose output ``Probe`` looks at later; ``then`` applied inside the layer (its own op)."""

    def __init__(self, n: int, then: Any = None) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.then is not None:
            y = self.then(y)
        _watched.ref = weakref.ref(y), StorageWeakRef(y.untyped_storage())
        return y


class Probe(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Gone: every holder of the memory dropped it, or it was freed under the tensor (resized to 0 bytes).
        ref, storage = _watched.ref
        y = ref()
        _seen.append(storage.expired() or (y is not None and y.untyped_storage().nbytes() == 0))
        return x


class CheckpointedRelu(nn.Module):
    """HF's gradient checkpointing inside a layer: torch's checkpoint holds the arguments to run again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(torch.relu, x, use_reentrant=False)


class _KeepsInputOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.x = x  # a Python reference, not save_for_backward
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (w,) = ctx.saved_tensors
        return grad * w, (grad * ctx.x).sum(0)


class _KeepsOutputOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        ctx.out = out  # the layer's own output, kept by its own backward as a Python reference
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2 + 0 * ctx.out


_stash: list[torch.Tensor] = []  # what a forward hook logging activations keeps


def _stashed(y: torch.Tensor) -> torch.Tensor:
    _stash.append(y)
    return y


def _hooked(y: torch.Tensor) -> torch.Tensor:
    y.register_hook(lambda g: g + 0 * y)  # the closure reads the output in the backward
    return y


class TakesFromDict(nn.Module):
    """Takes its input out of the dict it is given and keeps it on a custom Function's ctx: the
    dict's reference goes, ctx's comes (Python's count of the input is unchanged)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return _KeepsInputOnCtx.apply(d.pop("h"), self.w)


class AsDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": x}


class KeepsInputOnCtx(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _KeepsInputOnCtx.apply(x, self.w)


class SavesASlice(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n // 2, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, : x.shape[1] // 2])  # the Linear saves a view of its input


N = 16
FREED = {"relu": nn.ReLU, "gelu tanh after": lambda: nn.Sequential(nn.Tanh(), nn.GELU())}
KEPT = {
    "linear": lambda: nn.Linear(N, N),
    "checkpointed": CheckpointedRelu,
    "ctx attribute": lambda: KeepsInputOnCtx(N),
    "a saved slice": lambda: SavesASlice(N),
}


def _model(after: nn.Module, then: Any = None) -> nn.Module:
    return nn.Sequential(nn.Linear(8, N), Watched(N, then), after, Probe(), nn.Linear(N, 4)).double()


def _check(model: nn.Module, stage: int | None) -> list[bool]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(model)
    reference = sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-2))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]
    _seen.clear()
    if stage is None:
        state = reference.init(params)
        for batch in batches:
            state, _ = reference(state, batch)
    else:
        step = sw.shard_params(reference, "dp", stage=stage, bucket_mb=1e-6 if stage < 3 else None)
        sw.testing.assert_equivalent(step, reference, sw.Mesh(dp=2), batches, params)
    assert _seen
    return list(_seen)


@pytest.mark.parametrize("stage", [None, 2, 3])
@pytest.mark.parametrize("after", sorted(FREED))
def test_an_output_the_next_layer_keeps_nothing_of_is_freed_after_it(after: str, stage: int | None) -> None:
    assert all(_check(_model(FREED[after]()), stage))


@pytest.mark.parametrize("stage", [None, 3])
@pytest.mark.parametrize("after", sorted(KEPT))
def test_an_output_anything_may_still_read_is_kept(after: str, stage: int | None) -> None:
    assert not any(_check(_model(KEPT[after]()), stage))


@pytest.mark.parametrize("stage", [None, 3])
@pytest.mark.parametrize("then", ["sigmoid", "ctx attribute", "hook", "stash"])
def test_an_output_its_own_layer_keeps_is_kept(then: str, stage: int | None) -> None:
    """sigmoid saves its result; a custom Function keeps its output on ctx, a hook's closure reads it:
    the layer's own backward reads it; a stash of activations is read after the step (freed, each
    crashed: a segfault)."""
    own = {"sigmoid": torch.sigmoid, "ctx attribute": _KeepsOutputOnCtx.apply, "hook": _hooked,
           "stash": _stashed}[then]
    _stash.clear()
    assert not any(_check(_model(nn.ReLU(), then=own), stage))
    real = [t for t in _stash if not is_fake(t) and t.device.type != "meta"]  # (not the Plan's fake runs)
    assert all(torch.isfinite(t.norm()) for t in real) and (then != "stash" or real)


def test_an_input_taken_out_of_its_dict_and_kept_is_kept() -> None:
    model = nn.Sequential(nn.Linear(8, N), Watched(N), AsDict(), TakesFromDict(N), Probe(), nn.Linear(N, 4))
    assert not any(_check(model.double(), 3))


@pytest.mark.parametrize("keeps", [False, True])
def test_a_zero_bubble_pipeline_hands_over_on_one_rank_as_zero_3_does(
    keeps: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zb_v puts stages 1 and 2 on one rank, their backwards apart: the handover ZeRO-3 makes. A layer
    keeping its output on ctx ran there too (freed, it segfaulted). (The next stage runs the ReLU after
    the watched output: what it frees is counted where it is freed.)"""
    torch.manual_seed(0)
    then = _KeepsOutputOnCtx.apply if keeps else None
    model = nn.Sequential(nn.Linear(8, N), nn.ReLU(), nn.Linear(N, N), Watched(N, then), nn.ReLU(),
                          nn.Linear(N, N), nn.Linear(N, N), nn.Linear(N, 4)).double()
    chain, params = sw.functionalize(model)
    reference = sw.train_step(chain, F.mse_loss, sw.optim.adamw(1e-2))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]
    freed: list[tuple[int, ...]] = []
    free = handover.free_storage

    def recorded(t: torch.Tensor) -> None:
        freed.append(tuple(t.shape))
        free(t)

    monkeypatch.setattr(handover, "free_storage", recorded)
    piped = sw.pipeline(reference, "pp", "zb_v", microbatches=4, partition=[2, 2, 2, 2])
    sw.testing.assert_equivalent(piped, reference, sw.Mesh(pp=2), batches, params)
    assert freed == ([] if keeps else [(2, N)] * 8)  # stage 1's output, 2 rows a micro-batch, 4 of them, 2 steps
