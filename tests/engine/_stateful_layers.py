"""Layers keeping state across calls, shared by the tests of the state watches (loaded by path: no package here):
engine/run/first_call_state.py, forward_state.py and transforms/remat/recompute_state.py."""

from __future__ import annotations

import torch
from torch import nn


class ShapeCache(nn.Module):
    """A lazily built cache of the input's width (a table of positions), set once from the shape alone."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]
        return self.lin(x + self.table)


class HiddenTuple(nn.Module):
    """Truncated BPTT's pattern: the recurrence's (h, c) kept, detached, as a tuple for the next call."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.rnn = nn.LSTM(d, d, batch_first=True)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.rnn(x.unsqueeze(1), self.hidden)
        self.hidden = (h.detach(), c.detach())
        return out.squeeze(1)
