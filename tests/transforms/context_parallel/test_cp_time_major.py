"""A time-major batch under context_parallel: its cut dim (dim=1) holds the rows, not the sequence.

context_parallel cuts ``dim`` of every batch leaf (1: (batch, seq, ...)). A time-major batch, (seq, batch,
...), has its rows there: each rank got whole sequences of half the rows, the model transposed them to
(batch, seq) for TinyGPT's attention, and ring attention took the other rank's rows for the other half of
each sequence: 1.3e-2 off the single-device step's first loss, without an error. Refused now where the
attention's queries hold the part's positions on another dim than their sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing.models import CausalSelfAttention

SEQ, ROWS, WIDTH = 8, 4, 16


class Model(torch.nn.Module):
    """Linear, TinyGPT's causal attention on (batch, seq, ...), Linear; ``time_major``: x is (seq, batch, 6),
    transposed for the attention and back."""

    def __init__(self, time_major: bool) -> None:
        super().__init__()
        self.time_major = time_major
        self.inp = torch.nn.Linear(6, WIDTH)
        self.attn = CausalSelfAttention(WIDTH, 2, SEQ)
        self.out = torch.nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h.transpose(0, 1) if self.time_major else h
        h = h + self.attn(h)
        h = h.transpose(0, 1) if self.time_major else h
        return self.out(h)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_a_time_major_batch_is_refused_and_a_batch_first_one_equals_one_device(attention: str) -> None:
    for time_major in (True, False):
        gen = torch.Generator().manual_seed(2)
        shape = (SEQ, ROWS) if time_major else (ROWS, SEQ)
        batches = [(torch.randn(*shape, 6, generator=gen, dtype=torch.float64),
                    torch.randn(*shape, 3, generator=gen, dtype=torch.float64)) for _ in range(2)]
        torch.manual_seed(0)
        chain, params = sw.functionalize(Model(time_major).double(), example_input=batches[0][0])
        step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
        cp = sw.context_parallel(step, "cp", attention=attention)
        if time_major:
            with pytest.raises(sw.collectives.RankFailed, match=(
                    r"context_parallel\(axis='cp'\): CausalSelfAttention in layer 'model' attends along dim 2 of its "
                    r"queries \[2, 2, 8, 8\], but the part's positions are on dim 0.*rows on dim 0")):
                sw.testing.assert_equivalent(cp, step, sw.Mesh(cp=2), batches, params)
        else:
            sw.testing.assert_equivalent(cp, step, sw.Mesh(cp=2), batches, params)
