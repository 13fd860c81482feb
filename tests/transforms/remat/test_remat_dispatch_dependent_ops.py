"""An op whose kernel torch picks by whether a dispatch mode is on, under plain checkpoint.

remat watches a layer's first forward for draws from a generator of its own with a dispatch mode
(own_generators.py); its recomputation ran without one. ``F.ctc_loss`` saves 2 tensors more under a dispatch
mode, so the recomputation saved otherwise than its forward and torch's checkpoint raised its own
``CheckpointError`` at the first step (Wav2Vec2ForCTC's head, any layer computing a CTC loss). A forward's
recomputations now run under the mode it ran under.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw


class _CtcHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        logp = self.proj(x["features"]).log_softmax(-1).transpose(0, 1)  # (time, batch, classes)
        frames = torch.full((x["features"].shape[0],), x["features"].shape[1], dtype=torch.long)
        return F.ctc_loss(logp, x["labels"], frames, x["lengths"], blank=0, reduction="mean", zero_infinity=True)


def test_remat_of_a_layer_computing_a_ctc_loss_equals_no_remat() -> None:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_CtcHead()).double())
    step = sw.train_step(chain, lambda out, _: out, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [({"features": torch.randn(4, 12, 8, generator=gen, dtype=torch.float64),
                 "labels": torch.randint(1, 6, (4, 3), generator=gen), "lengths": torch.tensor([3, 2, 3, 1])}, None)
               for _ in range(2)]
    remat = sw.remat(step, policy=sw.policies.nothing_saveable)
    sw.testing.assert_equivalent(remat, step, sw.Mesh(dp=1), batches, params)
