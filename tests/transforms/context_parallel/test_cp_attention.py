"""Ring and Ulysses attention against torch's single-device sdpa on the whole sequence, forward and gradients.

float64 on thread ranks: the distributed attention merges the same scores in another order (the
online softmax adds block sums one at a time), so results agree to rounding, ~1e-15 relative; the
tolerance 1e-12 leaves room for that and nothing else. The reference shards are cut here by the
rule written out in ``expected_chunks``, not with the package's own layout functions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.transforms.context_parallel.online_softmax as softmax_module
from shardwise.collectives import Mesh, axis_index, launch
from shardwise.transforms.context_parallel import ring_attention, shard_sequence, ulysses_attention
from shardwise.transforms.context_parallel.online_softmax import OnlineSoftmax

TOL = {"rtol": 1e-12, "atol": 1e-12}


def expected_chunks(rank: int, n: int, balanced: bool) -> list[int]:
    return [rank, 2 * n - 1 - rank] if balanced else [rank]


def expected_slice(x: torch.Tensor, rank: int, n: int, balanced: bool) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` (sequence on dim 2): chunks ``rank`` and ``2n-1-rank`` of 2n, or chunk ``rank``."""
    count = 2 * n if balanced else n
    pieces = x.chunk(count, dim=2)
    return torch.cat([pieces[c] for c in expected_chunks(rank, n, balanced)], dim=2)


def reference(q, k, v, g, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return out.detach(), torch.autograd.grad((out * g).sum(), (q, k, v))


def distributed(attention: Callable[..., torch.Tensor], n: int, q, k, v, g, balanced: bool, **kw: Any):
    """Each rank's output and the gradients of its q, k, v slices, for the loss sum(out * g)."""

    def main():
        mesh = Mesh(cp=n)
        with mesh:
            local = [shard_sequence(t, "cp", dim=2, balanced=balanced).requires_grad_() for t in (q, k, v)]
            out = attention(*local, "cp", balanced=balanced, **kw)
            grads = torch.autograd.grad((out * shard_sequence(g, "cp", dim=2, balanced=balanced)).sum(), local)
            return out.detach(), grads

    return launch(main, world=n, timeout=60)


def inputs(batch, heads, kv_heads, seq, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64, generator=gen)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.float64, generator=gen)
    v = torch.randn(batch, kv_heads, seq, head_dim, dtype=torch.float64, generator=gen)
    g = torch.randn(batch, heads, seq, head_dim, dtype=torch.float64, generator=gen)
    return q, k, v, g


def assert_matches(results, ref_out, ref_grads, n, balanced):
    for rank, (out, grads) in enumerate(results):
        torch.testing.assert_close(out, expected_slice(ref_out, rank, n, balanced), **TOL)
        for name, got, want in zip("qkv", grads, ref_grads, strict=True):
            torch.testing.assert_close(got, expected_slice(want, rank, n, balanced), **TOL, msg=f"grad {name}")


def ring(*args, causal, **kw):
    return ring_attention(*args, causal=causal, **kw)


def ulysses(*args, causal, **kw):
    return ulysses_attention(*args, causal=causal, **kw)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 4], ids=["mha", "gqa"])
@pytest.mark.parametrize("attention", [ring, ulysses])
def test_equals_single_device_sdpa(attention, n, causal, balanced, kv_heads):
    q, k, v, g = inputs(2, 8, kv_heads, 16, 4)
    ref_out, ref_grads = reference(q, k, v, g, causal)
    results = distributed(attention, n, q, k, v, g, balanced, causal=causal)
    assert_matches(results, ref_out, ref_grads, n, balanced)


@settings(max_examples=6)
@given(
    n=st.sampled_from([1, 2, 3, 4]),
    chunk=st.integers(1, 3),
    group=st.sampled_from([1, 2]),
    kv_per_rank=st.integers(1, 2),
    causal=st.booleans(),
    balanced=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_both_attentions_equal_sdpa(n, chunk, group, kv_per_rank, causal, balanced, seed):
    """Sequence lengths, heads, grouped-query groups and axis sizes drawn; Ulysses needs heads divisible by n."""
    kv_heads = kv_per_rank * n
    seq = chunk * (2 * n if balanced else n)
    q, k, v, g = inputs(1, group * kv_heads, kv_heads, seq, 4, seed)
    ref_out, ref_grads = reference(q, k, v, g, causal)
    for attention in (ring, ulysses):
        assert_matches(distributed(attention, n, q, k, v, g, balanced, causal=causal), ref_out, ref_grads, n, balanced)


@pytest.mark.parametrize(("n", "heads", "kv_heads"), [(4, 4, 2), (2, 4, 1), (4, 8, 2)])
def test_ulysses_repeats_key_value_heads_the_axis_does_not_divide(n, heads, kv_heads):
    """Grouped-query attention whose key/value heads the axis does not divide, where it divides the query
    heads (Llama's 4 and 2 at cp=4): each key/value head goes as copies within its group, as
    DeepSpeed-Ulysses sends them; refused before. Outputs and the k and v gradients (summed over the
    copies) are sdpa's."""
    q, k, v, g = inputs(2, heads, kv_heads, 16, 4)
    ref_out, ref_grads = reference(q, k, v, g, True)
    assert_matches(distributed(ulysses, n, q, k, v, g, True, causal=True), ref_out, ref_grads, n, True)


def test_scale_is_used():
    q, k, v, g = inputs(1, 2, 2, 8, 4)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    for attention in (ring_attention, ulysses_attention):
        results = distributed(attention, 2, q, k, v, g, True, scale=0.3)
        for rank, (out, _) in enumerate(results):
            torch.testing.assert_close(out, expected_slice(ref, rank, 2, True), **TOL)


def test_ulysses_takes_a_custom_attention_on_the_whole_sequence_in_global_order():
    q, k, v, g = inputs(1, 2, 2, 8, 4)
    bias = torch.randn(8, 8, dtype=torch.float64)  # position-dependent: wrong order would show

    def biased(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    ref = biased(q, k, v)
    for rank, (out, _) in enumerate(distributed(ulysses_attention, 2, q, k, v, g, True, attn=biased)):
        torch.testing.assert_close(out, expected_slice(ref, rank, 2, True), **TOL)


def test_float32_and_bfloat16_run_in_their_dtype():
    q, k, v, g = inputs(1, 2, 2, 8, 4)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        cast = [t.to(dtype) for t in (q, k, v, g)]
        for rank, (out, _) in enumerate(distributed(ring_attention, 2, *cast, True)):
            assert out.dtype == dtype
            torch.testing.assert_close(out.double(), expected_slice(ref, rank, 2, True), rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [2, 4])
def test_float32_ring_is_as_close_to_float64_as_torchs_own_float32_sdpa(n):
    """The flash block kernel in float32, forward and gradients, against the float64 reference.

    Tolerance: torch's single-device float32 sdpa (the same tiled kernel over the whole sequence)
    misses the float64 result by e (1.7e-6 here, gradients up to 4.9); ring attention adds one
    rounding per merged block (a multiply-add by exp(lse_b - lse)), so it must stay within 2 e. A
    block kernel that lost precision (the log-sum-exp in a half type, a merge in the wrong order of
    magnitude) misses by far more."""
    q, k, v, g = inputs(2, 8, 4, 256, 16)
    ref_out, ref_grads = reference(q, k, v, g, True)
    single = [t.float() for t in (q, k, v, g)]
    out32, grads32 = reference(*single, True)
    e = max(float((a.double() - b).abs().max()) for a, b in zip((out32, *grads32), (ref_out, *ref_grads), strict=True))
    for rank, (out, grads) in enumerate(distributed(ring_attention, n, *single, True)):
        assert out.dtype == torch.float32
        for got, want in zip((out, *grads), (ref_out, *ref_grads), strict=True):
            err = float((got.double() - expected_slice(want, rank, n, True)).abs().max())
            assert err <= 2 * e, f"rank {rank}: {err:.2e} against torch's own float32 sdpa's {e:.2e}"


def test_balanced_causal_ring_gives_every_rank_the_same_work(monkeypatch):
    """Work = query rows x key columns attended; balanced it is equal on every rank, unbalanced it is not."""
    n, seq = 4, 16
    q, k, v, _ = inputs(1, 2, 2, seq, 4)
    original = softmax_module.attend_block
    work: dict[int, int] = {}
    lock = threading.Lock()

    def counting(q, k, v, *rest):
        with lock:
            rank = axis_index("cp")
            work[rank] = work.get(rank, 0) + q.shape[2] * k.shape[2]
        return original(q, k, v, *rest)

    monkeypatch.setattr(softmax_module, "attend_block", counting)
    for balanced in (True, False):
        work.clear()

        def main(balanced=balanced):
            with Mesh(cp=n):
                local = [shard_sequence(t, "cp", dim=2, balanced=balanced) for t in (q, k, v)]
                ring_attention(*local, "cp", balanced=balanced)

        launch(main, world=n, timeout=60)
        per_rank = [work[r] for r in range(n)]
        # Whole blocks are attended (the diagonal ones masked inside): in all, the causal half plus the diagonal.
        chunk = seq // (2 * n if balanced else n)
        assert sum(per_rank) == (seq * seq + seq * chunk) // 2
        if balanced:
            assert len(set(per_rank)) == 1, per_rank
        else:
            assert per_rank == sorted(per_rank) and per_rank[0] < per_rank[-1], per_rank


def test_ring_under_no_grad_and_without_grad_inputs():
    q, k, v, _ = inputs(1, 2, 2, 8, 4)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def main():
        with Mesh(cp=2), torch.no_grad():
            local = [shard_sequence(t, "cp", dim=2, balanced=False) for t in (q, k, v)]
            return ring_attention(*local, "cp", balanced=False)

    for rank, out in enumerate(launch(main, world=2, timeout=60)):
        torch.testing.assert_close(out, expected_slice(ref, rank, 2, False), **TOL)


@pytest.mark.parametrize("math", [False, True], ids=["flash", "math"])
@pytest.mark.parametrize("diagonal", [None, 0, 3])
def test_merged_blocks_pass_gradcheck(diagonal, math, monkeypatch):
    """Blocks merged by their log-sum-exps (the weights constant, each block's backward given the merged
    output) against finite differences: a visible block, then a causal square one where ``diagonal``
    says (the ring's shapes); grouped-query heads; the CPU flash kernel and the math kernel."""
    if math:
        monkeypatch.setattr(softmax_module, "has_flash_attention_cpu", lambda *t: False)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    width = 6 if diagonal is None else diagonal + 3
    k, v = (torch.randn(1, 2, width, 4, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))

    def attention(q, k, v):
        softmax = OnlineSoftmax(q, 0.7)
        if diagonal is None:
            softmax.add(k[..., :2, :], v[..., :2, :], causal=False)
            softmax.add(k[..., 2:, :], v[..., 2:, :], causal=False)
        else:
            if diagonal:
                softmax.add(k[..., :diagonal, :], v[..., :diagonal, :], causal=False)
            softmax.add(k[..., diagonal:, :], v[..., diagonal:, :], causal=True)
        return softmax.result()

    assert torch.autograd.gradcheck(attention, (q, k, v))
    mask = None if diagonal is None else torch.ones(3, width, dtype=torch.bool).tril(diagonal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.7, enable_gqa=True)
    torch.testing.assert_close(attention(q, k, v), want, **TOL)


@pytest.mark.parametrize("attention", [ring_attention, ulysses_attention])
def test_torch_func_grad_equals_autograd(attention):
    q, k, v, _ = inputs(1, 2, 2, 8, 4)

    def main():
        with Mesh(cp=2):
            local = [shard_sequence(t, "cp", dim=2) for t in (q, k, v)]
            functional = torch.func.grad(lambda *t: attention(*t, "cp").pow(2).sum(), argnums=(0, 1, 2))(*local)
            leaves = [t.clone().requires_grad_() for t in local]
            return functional, torch.autograd.grad(attention(*leaves, "cp").pow(2).sum(), leaves)

    for functional, autograd in launch(main, world=2, timeout=60):
        for a, b in zip(functional, autograd, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
