"""A forward with a ``None`` default beyond its input (torchtitan's ``forward(tokens, input_batch=None)``), split into
units, pickles and trains on process ranks.

torch.fx checks such an argument with ``torch.fx._symbolic_trace._assert_is_none``, which the segment's code names by
its dotted name; unpickling the segment traces that code again and fails on the name (``KeyError:
'torch.fx._symbolic_trace._assert_is_none'``), leaving an entry behind that breaks every later trace in the
process. So torchtitan's Llama 3 was refused on ``backend="processes"`` ("the arguments for _rank_program cannot
be pickled") while the threads backend trained it. The check is shardwise's own function now (fx_split.py).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.engine.model.fx_split import concrete_none


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h)


def _loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())


def _step() -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(_Blocks().double(), units=["layers.0", "layers.1"])
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(ids, torch.roll(ids, 1, 1)) for ids in (torch.randint(16, (4, 6), generator=gen) for _ in range(2))]
    return step, params, batches


def test_a_none_default_beyond_the_input_round_trips_through_pickle_and_traces_after() -> None:
    step, params, batches = _step()
    again = pickle.loads(pickle.dumps(step))
    _, metrics = step(step.init(params), batches[0])
    _, metrics2 = again(again.init(params), batches[0])
    assert float(metrics["loss"]) == float(metrics2["loss"])
    _step()  # a trace after the round trip (the left-behind entry broke it)
    with pytest.raises(AssertionError, match="specialized"):
        concrete_none(torch.zeros(1), "specialized to have value None")


@pytest.mark.gloo
def test_it_trains_on_process_ranks_as_one_device() -> None:
    step, params, batches = _step()
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params,
                                 backend="processes", timeout=120)
