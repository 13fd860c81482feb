"""The one-device step's Python (issue 27: "fewer Python actions and calls per step"), counted.

The executor's per-call path is shared by every step, and what a stage costs is paid per layer and
micro-batch: an ``nn.Sequential`` of 8 Linear and 8 GELU is 16 stages. So these tests count
shardwise's own Python calls in one step (``sys.setprofile``: calls of functions in shardwise's files,
generator resumptions included), after the first steps, whose first-call watches and bindings run
once. A budget exceeded is not a wrong result but a slower step: read the counts the failure prints,
and make the new work once per step or once per layout where it can be. The results themselves are
compared with torch's loop bit for bit elsewhere (tests/test_benchmark_one_device.py,
tests/engine/test_step_bindings.py, tests/transforms/_torch_loop.py's users).
"""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.plan import actions
from shardwise.engine.run import executor, forward_state

_ROOT = str(Path(sw.__file__).resolve().parent)

# shardwise's calls in one step of the MLP below: about 4 a stage (its forward, the hook check, the
# quiet run and the layer's one call) and 286 for the rest of the step (prepare, loss, the joined
# backward, the clip, SGD, the metrics), Python 3.11. Before issue 27's cuts of 2026-12-06: 16 a stage
# and 325 (each step's table of bound handlers, generators in the hook check and the optimizer's and
# donation's tree walks, ...).
_PER_STAGE = 4
_FIXED = 300


def _mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(y, t)


def _stepper(model: nn.Module) -> Any:
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, _mse, sw.optim.sgd(1e-2, momentum=0.9, inplace=True), clip_norm=1.0)
    box = [step.init(params)]
    x, t = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 8)

    def one() -> None:
        box[0], metrics = step(box[0], (x, t))
        metrics["loss"].item()

    for _ in range(3):  # the first-call watches, the bindings and the caches: once
        one()
    return one


def _counted(one: Any) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(_ROOT):
            counts[f"{code.co_filename[len(_ROOT):]}:{code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        one()
    finally:
        sys.setprofile(None)
    return counts


def _mlp(pairs: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(pairs) for m in (nn.Linear(8, 8), nn.GELU())])


def test_a_quiet_stage_and_the_step_around_it_keep_to_their_budget_of_python_calls() -> None:
    small, large = _counted(_stepper(_mlp(2))), _counted(_stepper(_mlp(4)))
    n_small, n_large = sum(small.values()), sum(large.values())
    per_stage = (n_large - n_small) / 4  # two more (Linear, GELU) pairs: four more stages
    fixed = n_small - 4 * per_stage
    grew = {k: large[k] - small.get(k, 0) for k in large if large[k] != small.get(k, 0)}
    assert per_stage <= _PER_STAGE, f"{per_stage} calls a stage (budget {_PER_STAGE}); per 4 stages: {grew}"
    assert fixed <= _FIXED, f"{fixed} calls a step besides the stages (budget {_FIXED}): {small.most_common(25)}"


class _Block(nn.Module):
    """A layer the step calls through its module (not one of module_call.DIRECT's), watched on its first
    call (forward_state) and asked on every later one whether that was it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


class _CountingLock:
    """forward_state's lock, counting its acquisitions."""

    def __init__(self) -> None:
        self.lock, self.taken = threading.Lock(), 0

    def __enter__(self) -> None:
        self.taken += 1
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_the_first_call_watch_takes_no_lock_after_a_layers_first_step(monkeypatch: Any) -> None:
    """forward_state's question "is this the layer's first call on this thread?" is asked of every layer
    on every step; after the first step it is answered without the module's lock (and its weak
    dictionary's setdefault), which cost ~3 us a layer a step."""
    lock = _CountingLock()
    monkeypatch.setattr(forward_state, "_LOCK", lock)
    one = _stepper(nn.Sequential(_Block(), _Block(), _Block()))
    assert lock.taken >= 3  # each layer's first step: watched, under the lock
    before = lock.taken
    counts = _counted(one)
    assert counts["/engine/run/forward_state.py:first_call"] == 3  # still asked of every layer
    assert lock.taken == before, f"{lock.taken - before} acquisitions in a later step"


def test_every_action_kind_names_a_method_of_the_executor() -> None:
    """The executor's table of handlers is names (bound per action that runs): each must name a method,
    and every kind of action but a split's in-layer collective (which its compute issues) has one."""
    kinds = {v for k, v in vars(actions).items() if k.isupper() and isinstance(v, str)} - {actions.INSIDE}
    handlers = executor._HANDLERS
    assert kinds == set(handlers), kinds ^ set(handlers)
    for kind, name in handlers.items():
        assert callable(getattr(executor.Executor, name, None)), (kind, name)
