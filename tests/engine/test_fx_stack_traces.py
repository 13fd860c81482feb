"""The stack traces functionalize's tracer records (engine/model/fx_stack_traces.py): torch.fx's
frames, node for node, without importing torch's compiler stack."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch.fx as fx
from torch import nn

from shardwise.engine.model.fx_split import _UnitTracer
from shardwise.testing.models import TinyGPT

FRAME = re.compile(r'File "(.*?)", line (\d+), in (\S+)\n +(.*)')


class _TorchsOwn(_UnitTracer):
    """The same tracer with torch.fx's own stack traces (``record_stack_traces``)."""

    def __init__(self, units: list[str]) -> None:
        super().__init__(units)
        self.record_stack_traces = True

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        return fx.Tracer.create_node(self, *args, **kwargs)


def _frames(trace: str | None) -> list[tuple[str, str, str, str]]:
    """(file, line, function, code) of each frame; torch's ends with fx's proxy.py frames and
    _TorchsOwn.create_node: the capture itself, left out of ours."""
    return [f for f in FRAME.findall(trace or "") if not f[0].endswith(os.path.join("fx", "proxy.py"))
            and not (f[0] == __file__ and f[2] == "create_node")]


class _Nested(nn.Module):
    """A root whose forward calls a submodule traced through (not a unit), with a forward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: Any) -> Any:
        y = self.inner(x) * 2
        return self.head(y + x)


@pytest.mark.parametrize(("model", "units"), [
    (TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16), ["tok_emb", "blocks.0", "blocks.1", "head"]),
    (TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16), ["tok_emb", "head"]),  # blocks traced through
    (_Nested(), ["head"]),
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), ["0", "2"]),  # forward in torch's container.py
], ids=["gpt-units", "gpt-blocks-traced", "nested", "sequential"])
def test_each_nodes_frames_are_the_ones_torch_fx_records(model: nn.Module, units: list[str]) -> None:
    ours = _UnitTracer(units).trace(model)
    torchs = _TorchsOwn(units).trace(model)
    ours_frames = [(n.name, _frames(n.stack_trace)) for n in ours.nodes]
    # (torch's keeps the frame of the tracer's call_module, which stands where fx's own stood: fx's is dropped)
    own = os.path.join("model", "fx_split.py")
    assert ours_frames == [(n.name, [f for f in _frames(n.stack_trace) if own not in f[0]]) for n in torchs.nodes]
    assert any(frames for _, frames in ours_frames)  # a check that compares nothing would pass too
    capture = (os.path.join("model", "fx_stack_traces.py"), os.path.join("model", "fx_split.py"), "proxy.py")
    for node in ours.nodes:  # and nothing of the capture itself
        assert not [name for name in capture if name in (node.stack_trace or "")], node.stack_trace


FIRST_STEP = r"""
import sys
import torch
import shardwise as sw
from shardwise.testing.models import TinyGPT

def first_step():
    torch.manual_seed(0)
    chain, params = sw.functionalize(TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16),
                                     units=["tok_emb", "blocks", "head"])
    loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    step = sw.shard_params(sw.train_step(chain, loss_fn, sw.optim.adamw(1e-3)), "dp", 3)
    mesh = sw.Mesh(dp=2)
    state = step.init(params, mesh)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    state, metrics = step(state, (x, x))
    return float(metrics["loss"])

if __name__ == "__main__":
    with torch.random.fork_rng():
        losses = sw.launch(first_step, 2)
    print(repr(sorted(m for m in sys.modules if m.split(".")[0] in ("networkx", "sympy") or
                      m.startswith(("torch._dynamo", "torch._inductor", "torch._functorch.aot_autograd")))))
"""


def test_a_first_zero3_step_imports_no_compiler(fresh_interpreter: Callable[..., str]) -> None:
    """torch.fx's own stack traces import torch._dynamo, inductor, AOTAutograd and networkx (with
    torch.export and sympy: 1,200 modules, about 1.2 s of CPU in every process that traces, each rank
    of a launch), and AdamW's state sized on meta tensors by torch.zeros_like imported sympy (0.35 s):
    a traced model's first ZeRO-3 step with AdamW, planned and run, imports none of them."""
    assert eval(fresh_interpreter(FIRST_STEP).strip().splitlines()[-1]) == []
