"""Sequence parallel's follower on glue between the vocabulary-split embedding and the first block.

The embedding's lookups travel there as partial sums (each rank: its vocabulary half's rows, zeros
elsewhere), followed op by op (``tensor_parallel/partial.py``). An op that is not linear in them must
take their sum. These ops were taken as linear, each rank applying them to its partial sum, so the sum
over ranks counted them once per rank: another model without an error.

* a plain number added (``torch.add(x, other=0.5)``, ``x + np.float32(0.5)``, ``x + True``): only a
  positional Python ``int``/``float`` was seen as a number, so the number was added tp times;
* a replicated integer or bool tensor added (``x + ids % 3``): only floating addends were counted on
  one rank;
* a cast to integers (``y.to(torch.long)``) of a partial sum that holds a replicated addend: truncation
  is not linear (a lone lookup's partial sums are exact under any op with f(0) = 0, so the cast is wrong
  only once a replicated value is mixed in).

Each glue ends by a product with a fixed per-feature vector: a shift the same on every feature would
vanish in the blocks' LayerNorms and hide the error. float64, 1e-12 against one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT

F64_RTOL = 1e-12
Glue = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (lookups, ids, scale) -> x


class _GluedGPT(TinyGPT):
    scale: torch.Tensor

    def __init__(self, glue: Glue, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.glue = glue
        self.register_buffer("scale", torch.randn(self.pos_emb.shape[-1], dtype=torch.float64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.glue(self.tok_emb(idx), idx, self.scale) * self.scale
        x = x + self.pos_emb[:, : x.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _truncated(y: torch.Tensor) -> torch.Tensor:
    return (y * 100).to(torch.long).to(y.dtype) / 100 + y


_NP_HALF: Any = np.float32(0.5)  # a number that is not a Python float
GLUES: dict[str, Glue] = {
    "add other= 0.5": lambda x, ids, s: torch.add(x, other=0.5),
    "sub other= 0.25": lambda x, ids, s: torch.sub(x, other=0.25),
    "x + np.float32(0.5)": lambda x, ids, s: x + _NP_HALF,
    "x + True": lambda x, ids, s: x + True,
    "x + ids % 3": lambda x, ids, s: x + (ids % 3).unsqueeze(-1),
    "x + (ids == 3)": lambda x, ids, s: x + (ids == 3).unsqueeze(-1),
    "(x + table).to(long)": lambda x, ids, s: _truncated(x + 0.013 * s),
    "(x + table).type_as(ids)": lambda x, ids, s: (lambda y: (y * 100).type_as(ids) / 100 + y)(x + 0.013 * s),
    # linear: right before too, but the cat's dim was taken for an addend and the lookups summed first
    "x * sqrt(d), x + 0-d tensor, cat(ids)": lambda x, ids, s: torch.cat(
        [x[:, :1] * 32**0.5, x[:, 1:] + torch.tensor(0.5, dtype=x.dtype)], 1),
}


@pytest.mark.parametrize("glue", list(GLUES))
def test_glue_before_the_first_block_equals_one_device(glue: str, build: dict[str, Callable]) -> None:
    problem = build["tiny_gpt"]()
    torch.manual_seed(0)
    model = _GluedGPT(GLUES[glue], vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=Block, example_input=problem.batches[0][0])
    reference = sw.train_step(chain, problem.step.loss_fn, sw.optim.sgd(0.1, momentum=0.9))
    step = sw.tensor_parallel(reference, "tp", problem.plan, sequence_parallel=problem.blocks)
    sw.testing.assert_equivalent(step, reference, sw.Mesh(tp=2), problem.batches, params, rtol=F64_RTOL)
    if glue.startswith("x * sqrt(d)"):  # the partial sums still travel to the first block unsummed
        inside = [str(a) for a in step.plan(sw.Mesh(tp=2), params, problem.batches[0]).for_rank(0)
                  if a.kind == "inside"]
        assert inside[0] == "psum_scatter(blocks.0, axis=tp)", inside
