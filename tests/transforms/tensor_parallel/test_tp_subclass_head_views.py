"""A Colwise Linear subclass whose forward views its output per head: the one device's step, or refused.

Its forward runs on the rank's slice of the output features, the rank's whole heads. A view that splits those
features into (heads, head_dim) by a head width it fixes (``view(*x.shape[:-1], -1, head_dim)``, ``unflatten(-1,
(-1, head_dim))``, explicit sizes given without reading the rank's width) makes the rank's heads, as the head-view
machinery follows them for a plain Linear viewed by its parent (head_views.py); it was refused as "something else
than the product". A view whose head width is left to -1 by a whole head count (the rank's 1/tp of the width, as
many heads) or given beside a head width computed from the rank's width (``y.shape[-1] // self.n_heads``), or one
that mixes the features with another dim, is another attention: refused, naming the view. (Explicit heads beside
a width read, ``y.shape[-1] // head_dim``, read the same and are refused too: -1 says it.)

Compared at rtol 1e-9 (float64, tp 2, 2 steps of SGD with momentum), as test_tp_weight_reads.py: tensor
parallelism only reorders sums.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

RTOL = 1e-9
HEAD_DIM = 4


class _HeadProjection(nn.Linear):
    """A projection that returns its output viewed per head, as ``how`` says."""

    def __init__(self, width: int, how: str) -> None:
        super().__init__(width, width)
        self.n_heads, self.how = width // HEAD_DIM, how
        if how == "unnamed count":  # a count no name says is one of heads: only the width read tells
            self.n = self.n_heads
            del self.n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.how == "view":
            return y.view(*x.shape[:-1], -1, HEAD_DIM)
        if self.how == "unflatten":
            return y.unflatten(-1, (-1, HEAD_DIM))
        if self.how == "counted":  # both sizes given: its heads count, whole unless a Region divides it
            return y.view(*x.shape[:-1], self.n_heads, HEAD_DIM)
        if self.how == "from the width":  # the heads from the rank's width: right, but read as the next one is
            return y.view(x.shape[0], x.shape[1], y.shape[-1] // HEAD_DIM, HEAD_DIM)
        if self.how == "flattened back":
            return y.view(*x.shape[:-1], -1, HEAD_DIM).flatten(-2)
        if self.how == "whole count":  # the head width left to -1: the rank's 1/tp of it
            return y.view(*x.shape[:-1], self.n_heads, -1)
        if self.how == "whole count, head width from the width":  # 1/tp of the head width
            return y.view(*x.shape[:-1], self.n_heads, y.shape[-1] // self.n_heads)
        if self.how == "unnamed count":  # the same, silently another attention before
            return y.view(*x.shape[:-1], self.n, y.shape[-1] // self.n)
        assert self.how == "mixed"  # the positions and the features in one dim
        return y.reshape(x.shape[0], -1, HEAD_DIM)


class _Attention(nn.Module):
    def __init__(self, how: str, width: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = (_HeadProjection(width, how) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.flat = how in ("flattened back", "mixed")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x) for p in (self.q, self.k, self.v))
        if self.flat:
            q, k, v = (z.reshape(b, t, -1, HEAD_DIM) for z in (q, k, v))
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(16), _Attention(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def _problem(how: str) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(4, 16), _Block(how), nn.Linear(16, 4)).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    return step, params, [(torch.randn(2, 6, 4, generator=gen, dtype=torch.float64),
                           torch.randn(2, 6, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]


PAIR = {"1.attn.[qkv]": sw.tp.Colwise(), "1.attn.o": sw.tp.Rowwise()}
REGION = {"1.attn": sw.tp.Region(), **PAIR}
# Its own counts divided by the Region around it: a view by them makes the rank's heads.
COUNTED = {"1.attn": sw.tp.Region(heads=("q.n_heads", "k.n_heads", "v.n_heads")), **PAIR}


@pytest.mark.parametrize("how", ["view", "unflatten", "flattened back"])
@pytest.mark.parametrize(("plan", "sequence_parallel"), [(PAIR, None), (REGION, None), (REGION, "1")],
                         ids=["pair", "region", "region, sequence parallel"])
def test_a_colwise_subclass_viewing_its_heads_equals_one_device(how: str, plan: dict[str, Any],
                                                                sequence_parallel: str | None) -> None:
    step, params, batches = _problem(how)
    split = sw.tensor_parallel(step, "tp", plan, sequence_parallel=sequence_parallel)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=RTOL)


@pytest.mark.parametrize("sequence_parallel", [None, "1"])
def test_a_view_by_its_own_count_a_region_divides_equals_one_device(sequence_parallel: str | None) -> None:
    step, params, batches = _problem("counted")
    split = sw.tensor_parallel(step, "tp", COUNTED, sequence_parallel=sequence_parallel)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=RTOL)


def test_a_viewed_output_gathered_equals_one_device() -> None:
    """Colwise(output='replicated'): the per-head view is gathered along its heads, not its head width."""
    step, params, batches = _problem("view")
    plan = {"1.attn.[qkv]": sw.tp.Colwise(output="replicated")}
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), batches, params,
                                 rtol=RTOL)


@pytest.mark.parametrize(("how", "plan", "refused"), [
    ("whole count", REGION, r"Colwise\(\) on '1\.attn\.q', a _HeadProjection whose forward overrides nn\.Linear's: "
                            r".*it reshapes its output \(view of its \[2, 6, 8\] to \[2, 6, 4, 2\], the head width "
                            r"left to -1.*View them by the head width, the heads inferred"),
    ("mixed", PAIR, r"Colwise\(\) on '1\.attn\.q', a _HeadProjection .*it reshapes its output \(reshape of its "
                    r"\[2, 6, 8\] to \[2, 12, 4\], its features mixed with other dims\)"),
    ("whole count, head width from the width", PAIR,
     r"Colwise\(\) on '1\.attn\.q', a _HeadProjection .*it reshapes its output \(view of its \[2, 6, 8\] to "
     r"\[2, 6, 4, 2\], its heads given with the rank's width read off the output"),
    ("unnamed count", PAIR, r"Colwise\(\) on '1\.attn\.q', a _HeadProjection .*\(view of its \[2, 6, 8\] to "
                            r"\[2, 6, 4, 2\], its heads given with the rank's width read off the output"),
    # Right here (2 heads of 4), but its sizes read as the one above's: both given, one from the rank's width.
    ("from the width", REGION, r"Colwise\(\) on '1\.attn\.q', a _HeadProjection .*\(view of its \[2, 6, 8\] to "
                               r"\[2, 6, 2, 4\], its heads given with the rank's width read off the output"),
])
def test_a_view_that_makes_other_heads_is_refused(how: str, plan: dict[str, Any], refused: str) -> None:
    step, params, batches = _problem(how)
    with pytest.raises(ValueError, match=refused):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_view_merged_back_by_the_slices_length_is_refused() -> None:
    """Under sequence parallel with no Region, each Colwise gathers the sequence itself while the attention holds
    the slice: its merge of the heads by the slice's length was refused as a Rowwise of the wrong width."""
    step, params, batches = _problem("view")
    with pytest.raises(ValueError, match=r"Colwise\(\) on '1\.attn\.[qkv]' sits outside any Region inside the "
                                         r"sequence-parallel block '1'.*reshapes its output \(2, 6, 2, 4\) to "
                                         r"\(2, 3, 16\)"):
        sw.tensor_parallel(step, "tp", PAIR, sequence_parallel="1").plan(sw.Mesh(tp=2), params, batches[0])


@pytest.mark.parametrize(("plan", "sequence_parallel"), [
    (PAIR, None), (REGION, "1"), ({"1.attn.[qkv]": sw.tp.Colwise(output="replicated")}, None),
], ids=["pair", "region, sequence parallel", "gathered"])
def test_a_viewed_output_runs_its_plan(plan: dict[str, Any], sequence_parallel: str | None) -> None:
    step, params, batches = _problem("view")
    sw.testing.assert_plan_is_run(sw.tensor_parallel(step, "tp", plan, sequence_parallel=sequence_parallel),
                                  sw.Mesh(tp=2), params, batches[0])
