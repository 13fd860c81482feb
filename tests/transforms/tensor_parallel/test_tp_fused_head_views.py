"""A Colwise Linear subclass computing q, k and v in one product and viewing it per head in its own forward.

Two layouts are exact on a rank, and were refused as "no per-head view tensor parallel can follow" or "something
else than the product":

* q, k and v side by side (weight rows ``[q; k; v]``), viewed with the blocks outermost, ``view(b, t, 3, -1,
  head_dim)`` (or ``unflatten``, its dims then permuted as timm's attention does): ``Colwise(fused=3)`` gives rank
  r ``[q_r; k_r; v_r]``, so the view makes its heads of q, of k and of v, the same heads;
* q, k and v of each head side by side (rows ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``), viewed ``view(b, t, -1, 3,
  head_dim)`` then transposed: ``Colwise()`` gives rank r whole heads, each with its q, k and v.

Each is compared with one device, pair plan and Region, under sequence parallel, dp2 x tp2 ZeRO-3 and pp2 x tp2.
The near misses make other heads on a rank without any shape failing (the blocks split as one: all of q and part of
k; a head-major layout split as blocks; a head width left to -1 beside a whole count; the heads not following the
blocks), and are refused naming the module, the view and the fix.

Compared at rtol 1e-9 (float64, 2 steps of SGD with momentum): tensor parallelism only reorders sums (their
rounding, 1e-16 relative); every wrong split found here differs by the order of an update (1e-3 and more).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

RTOL = 1e-9
HD, W = 4, 16  # 4 heads of 4


class _FusedQKV(nn.Linear):
    """q, k and v in one Linear, its output viewed per head by its own forward as ``how`` says: (b, t, 3, heads,
    head_dim) for every ``how`` but "timm" ((3, b, heads, t, head_dim)), on one device (4 heads) and on a rank."""

    def __init__(self, how: str) -> None:
        super().__init__(W, 3 * W)
        self.how, self.n_heads = how, W // HD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        b, t, _ = x.shape
        if self.how == "qkv-major":  # rows [q | k | v]
            return y.view(b, t, 3, -1, HD)
        if self.how == "qkv-major, unflatten":
            return y.unflatten(-1, (3, -1, HD))
        if self.how == "timm":  # timm's attention: (3, b, heads, t, head_dim), unbound along dim 0
            return y.reshape(b, t, 3, -1, HD).permute(2, 0, 3, 1, 4)
        if self.how == "head-major":  # rows [head 0: q k v | head 1: q k v | ...]
            return y.view(b, t, -1, 3, HD).transpose(2, 3)
        if self.how == "head-major, permute":
            return y.view(b, t, -1, 3, HD).permute(0, 1, 3, 2, 4)
        if self.how in ("chunked, stacked", "chunked, apart", "chunked, stacked out of order"):
            q, k, v = (z.view(b, t, -1, HD) for z in y.chunk(3, -1))  # each block viewed per head
            if self.how == "chunked, apart":  # (a tuple: q, k, v each (b, t, heads, head_dim))
                return q, k, v  # type: ignore[return-value]
            return torch.stack((k, q, v) if self.how.endswith("out of order") else (q, k, v), 2)
        if self.how == "qkv-major, whole heads, width -1":  # its whole count, the head width left to the rank's
            return y.view(b, t, 3, self.n_heads, -1)
        if self.how == "qkv-major, no blocks":  # 12 heads: q's, then k's, then v's
            return y.view(b, t, -1, HD)
        if self.how == "qkv-major, blocks inferred":
            return y.view(b, t, -1, self.n_heads, HD)
        raise AssertionError(self.how)


class _Attention(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.qkv, self.o = _FusedQKV(how), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.qkv(x)
        if self.how == "timm":
            q, k, v = y.unbind(0)
        elif self.how == "chunked, apart":
            q, k, v = (z.transpose(1, 2) for z in y)
        elif self.how == "qkv-major, no blocks":
            q, k, v = (z.transpose(1, 2) for z in y.chunk(3, 2))
        else:
            q, k, v = (z.transpose(1, 2) for z in y.unbind(2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(W), _Attention(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def _problem(how: str, blocks: int = 1) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, W), *(_Block(how) for _ in range(blocks)), nn.Linear(W, 4)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    return step, params, [(torch.randn(4, 6, 4, generator=gen, dtype=torch.float64),
                           torch.randn(4, 6, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]


def _plan(fused: int, region: bool, blocks: str = "1") -> dict[str, Any]:
    pair = {f"{blocks}.attn.qkv": sw.tp.Colwise(fused=fused), f"{blocks}.attn.o": sw.tp.Rowwise()}
    return {f"{blocks}.attn": sw.tp.Region(), **pair} if region else pair


EXACT = [("qkv-major", 3), ("qkv-major, unflatten", 3), ("timm", 3), ("chunked, stacked", 3), ("chunked, apart", 3),
         ("chunked, stacked out of order", 3), ("head-major", 1), ("head-major, permute", 1)]


@pytest.mark.parametrize(("how", "fused"), EXACT, ids=[how for how, _ in EXACT])
@pytest.mark.parametrize(("region", "sequence_parallel"), [(False, None), (True, None), (True, "1")],
                         ids=["pair", "region", "region, sequence parallel"])
def test_a_fused_qkv_subclass_viewing_its_heads_equals_one_device(how: str, fused: int, region: bool,
                                                                  sequence_parallel: str | None) -> None:
    step, params, batches = _problem(how)
    split = sw.tensor_parallel(step, "tp", _plan(fused, region), sequence_parallel=sequence_parallel)
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), batches, params, rtol=RTOL)


@pytest.mark.parametrize(("how", "fused"), [("qkv-major", 3), ("chunked, apart", 3), ("head-major", 1)],
                         ids=["qkv-major", "chunked, apart", "head-major"])
@pytest.mark.parametrize("mesh_shape", [{"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}], ids=["dp2xtp2 zero3", "pp2xtp2"])
def test_a_fused_qkv_subclass_composes(how: str, fused: int, mesh_shape: dict[str, int]) -> None:
    """Two blocks (a pipeline stage each under pp), sequence parallel over both."""
    step, params, batches = _problem(how, blocks=2)
    plan = {**_plan(fused, True, "1"), **_plan(fused, True, "2")}
    split = sw.tensor_parallel(step, "tp", plan, sequence_parallel="[12]")
    split = sw.shard_params(split, "dp", 3) if "dp" in mesh_shape else sw.pipeline(split, "pp", "1f1b", 2)
    sw.testing.assert_equivalent(split, step, sw.Mesh(**mesh_shape), batches, params, rtol=RTOL)


def test_a_fused_qkv_subclass_runs_its_plan() -> None:
    step, params, batches = _problem("qkv-major")
    split = sw.tensor_parallel(step, "tp", _plan(3, True), sequence_parallel="1")
    sw.testing.assert_plan_is_run(split, sw.Mesh(tp=2), params, batches[0])


_NAMED = r"Colwise(\(\)|\(fused=3\)) on '1\.attn\.qkv', a _FusedQKV whose forward overrides nn\.Linear's: .*"
NEAR_MISSES = [
    # q, k, v side by side split as one slice: rank 0 holds q and half of k, and its "k" is q's other heads.
    ("qkv-major", 1, _NAMED + r"view of its \[4, 6, 24\] to \[4, 6, 3, 2, 4\], its first 3 given as a number and the "
                              r"heads inferred after it: 3 fused blocks outermost .*give it Colwise\(fused=3\)"),
    ("timm", 1, _NAMED + r"reshape of its \[4, 6, 24\] to \[4, 6, 3, 2, 4\], its first 3 .*Colwise\(fused=3\)"),
    # The blocks cut apart in the forward under a plain Colwise: a rank's "q" is q's first heads, its "k" q's last.
    ("chunked, apart", 1, _NAMED + r"cuts its output \(chunk of its \[4, 6, 24\] into \[8, 8, 8\] along its "
                                   r"features: blocks side by side .*give it Colwise\(fused=3\)"),
    ("chunked, stacked", 1, _NAMED + r"cuts its output \(chunk of its \[4, 6, 24\] into \[8, 8, 8\] "
                                     r".*Colwise\(fused=3\)"),
    # Per-head q, k, v split as three blocks: rank 0's first "head" is head 0's q, k, v and head 1's q.
    ("head-major", 3, _NAMED + r"view of its \[4, 6, 24\] to \[4, 6, 2, 3, 4\], not its 3 fused blocks outermost, "
                               r"given as 3, then its heads.*takes a plain Colwise\(\) instead"),
    # The whole count beside a head width left to -1: 4 heads of 2 on a rank.
    ("qkv-major, whole heads, width -1", 3, _NAMED + r"view of its \[4, 6, 24\] to \[4, 6, 3, 4, 2\], the head "
                                                     r"width left to -1.*view\(\*x\.shape\[:-1\], 3, -1, head_dim\)"),
    # Heads without the blocks: the rank's are q's, k's and v's in another order than the whole's.
    ("qkv-major, no blocks", 3, _NAMED + r"view of its \[4, 6, 24\] to \[4, 6, 6, 4\], not its 3 fused blocks "
                                         r"outermost"),
]


def test_a_subclass_view_failing_on_a_whole_count_says_so() -> None:
    """Its blocks inferred beside its whole head count: 24 features of a rank are no (-1, 4, 4), and torch's
    shape error reached the user raw; it is said as a view by a whole count, naming the count and the fixes."""
    step, params, batches = _problem("qkv-major, blocks inferred")
    with pytest.raises(ValueError, match=r"Colwise\(\) on '1\.attn\.qkv', a _FusedQKV whose forward overrides "
                                         r"nn\.Linear's, failed in torch \(RuntimeError: shape '\[4, 6, -1, 4, 4\]' "
                                         r"is invalid.*\(24 of 48\).*self\.n_heads = 4.*view\(\*x\.shape\[:-1\], 3, "
                                         r"-1, head_dim\).*heads=\(\.\.\.\) of a Region"):
        sw.tensor_parallel(step, "tp", _plan(3, False)).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_whole_count_a_region_divides_then_blocks_inferred_is_refused() -> None:
    """The same view with the count divided by a Region runs, and makes (3, 2, 4): its blocks inferred (-1),
    not given as 3, read as a per-head view of another layout: refused as not its blocks outermost."""
    step, params, batches = _problem("qkv-major, blocks inferred")
    plan = {"1.attn": sw.tp.Region(heads=("qkv.n_heads",)), **_plan(3, False)}
    with pytest.raises(ValueError, match=_NAMED + r"view of its \[4, 6, 24\] to \[4, 6, 3, 2, 4\], not its 3 fused "
                                              r"blocks outermost, given as 3"):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])


@pytest.mark.parametrize(("how", "fused", "refused"), NEAR_MISSES, ids=[f"{h}, fused={f}" for h, f, _ in NEAR_MISSES])
@pytest.mark.parametrize("region", [False, True], ids=["pair", "region"])
def test_a_view_that_makes_other_heads_on_a_rank_is_refused(how: str, fused: int, refused: str, region: bool) -> None:
    step, params, batches = _problem(how)
    with pytest.raises(ValueError, match=refused):
        sw.tensor_parallel(step, "tp", _plan(fused, region)).plan(sw.Mesh(tp=2), params, batches[0])


def test_a_gathered_view_whose_heads_moved_is_refused() -> None:
    """Colwise(output='replicated') gathers a subclass's view along the dim after the input's leading ones, on
    every call (the watch that knows where its heads went runs on the first only): a view that moved them is
    refused, not gathered along its q, k, v dim."""
    step, params, batches = _problem("head-major")
    plan = {"1.attn.qkv": sw.tp.Colwise(output="replicated")}
    with pytest.raises(ValueError, match=r"Colwise\(output='replicated'\) on '1\.attn\.qkv', a _FusedQKV whose "
                                         r"forward views its output per head and moves its heads to dim 3 of 5"):
        sw.tensor_parallel(step, "tp", plan).plan(sw.Mesh(tp=2), params, batches[0])
