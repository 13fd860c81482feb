"""An attention viewing a Colwise output (outside any Region) by sizes of the whole: said, not torch's shape error.

``q.view(b, t, self.n_heads, self.head_dim)`` gives the head count explicitly beside the head width. Outside a
Region nothing divides the count, and on a rank's slice (1/tp of the features) the view fails in torch; the
failure was reported as "no Rowwise() took it ... give that module Rowwise()", though the Rowwise was there. It
is now said as what it is: the view, its sizes, the count the module holds, and the fixes (a Region naming the
count, or the heads inferred), which the last test shows to be exact (float64, tp 2, rtol 1e-9: tensor
parallelism only reorders sums).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

W, HD = 16, 4


class _Attention(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.n_heads, self.head_dim = how, W // HD, HD
        self.q, self.k, self.v, self.o = (nn.Linear(W, W) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads = self.n_heads if self.how == "explicit" else -1
        q, k, v = (p(x).view(b, t, heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        if self.how == "merged by the whole width":  # the view inferred, its merge by the whole width
            return self.o(a.reshape(b, t, self.n_heads * self.head_dim))
        return self.o(a.reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(W), _Attention(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def _problem(how: str) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(4, W), _Block(how), nn.Linear(W, 4)).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    return step, params, [(torch.randn(2, 6, 4, generator=gen, dtype=torch.float64),
                           torch.randn(2, 6, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]


PAIR = {"1.attn.[qkv]": sw.tp.Colwise(), "1.attn.o": sw.tp.Rowwise()}


@pytest.mark.parametrize(("how", "view"), [
    ("explicit", r"view of \[2, 6, 8\] to \[2, 6, 4, 4\]"),
    ("merged by the whole width", r"reshape of \[2, 6, 2, 4\] to \[2, 6, 16\]"),
])
def test_a_view_by_whole_sizes_outside_a_region_says_so(how: str, view: str) -> None:
    step, params, batches = _problem(how)
    with pytest.raises(ValueError, match=(
        r"Colwise\(\) on '1\.attn\.[qkv]', outside any Region, gives each rank 1/2 of its output features \(8 of 16 "
        rf"here\), and the module taking them \('1\.attn'\) reshapes them \({view}\) by sizes of the whole, which "
        r"this rank's slice does not fit \(RuntimeError: shape .* is invalid.*\(1\.attn\.n_heads = 4\), which nothing "
        r"divides outside a Region\. Give '1\.attn' a Region naming its counts, sw\.tp\.Region\(heads=\('n_heads',\)\) "
        r"in the plan.*view\(b, t, -1, head_dim\)"
    )):
        sw.tensor_parallel(step, "tp", PAIR).plan(sw.Mesh(tp=2), params, batches[0])


@pytest.mark.parametrize(("how", "plan"), [
    ("explicit", {"1.attn": sw.tp.Region(heads=("n_heads",)), **PAIR}),
    ("merged by the whole width", {"1.attn": sw.tp.Region(heads=("n_heads",)), **PAIR}),
    ("inferred", PAIR),
], ids=["explicit, region", "merged, region", "inferred, pair"])
def test_the_fixes_it_names_equal_one_device(how: str, plan: dict[str, Any]) -> None:
    step, params, batches = _problem(how)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=1e-9)
