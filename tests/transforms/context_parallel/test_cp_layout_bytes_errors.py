"""The sequence layout, the byte formulas held to the ledger, and the errors of bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.collectives import Mesh, RankFailed, comm_ledger, launch
from shardwise.transforms.context_parallel import (
    ring_attention,
    ring_attention_bytes,
    shard_order,
    shard_sequence,
    ulysses_attention,
    ulysses_attention_bytes,
    unshard_sequence,
)


def on_ranks(n, body):
    def main():
        with Mesh(cp=n):
            return body()

    return launch(main, world=n, timeout=60)


# -- layout -----------------------------------------------------------------------------------------
@settings(max_examples=8)
@given(n=st.integers(1, 4), chunk=st.integers(1, 3), balanced=st.booleans(), dim=st.sampled_from([0, 1, -1]))
def test_shard_then_unshard_is_the_identity_and_gradients_come_back(n, chunk, balanced, dim):
    seq = chunk * (2 * n if balanced else n)
    shape = [2, 3, 2]
    shape[dim] = seq
    x = torch.randn(shape, dtype=torch.float64)

    def body():
        local = shard_sequence(x, "cp", dim=dim, balanced=balanced).requires_grad_()
        whole = unshard_sequence(local, "cp", dim=dim, balanced=balanced)
        (grad,) = torch.autograd.grad((whole * x).sum(), local)
        return local.detach(), whole.detach(), grad

    results = on_ranks(n, body)
    for local, whole, grad in results:
        torch.testing.assert_close(whole, x, rtol=0, atol=0)
        # Every rank's sum(whole * x) counts, so each slice's gradient is n times its own x.
        torch.testing.assert_close(grad, n * local, rtol=0, atol=0)
    # The slices, in rank order, are the shard order of the whole sequence and cover it once.
    joined = torch.cat([local for local, _, _ in results], dim=dim)
    torch.testing.assert_close(joined, x.index_select(dim, shard_order(seq, n, balanced)), rtol=0, atol=0)


def test_balanced_layout_pairs_early_and_late_chunks():
    assert shard_order(12, 3, balanced=True).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert shard_order(6, 3, balanced=False).tolist() == [0, 1, 2, 3, 4, 5]
    positions = on_ranks(2, lambda: shard_sequence(torch.arange(8), "cp", dim=0).tolist())
    assert positions == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_a_sequence_that_does_not_cut_into_equal_chunks_is_refused():
    with pytest.raises(RankFailed, match=r"length 6 does not cut into 2 x 2 chunks .*pad it to a multiple of 4"):
        on_ranks(2, lambda: shard_sequence(torch.zeros(1, 6), "cp"))
    with pytest.raises(RankFailed, match=r"length 5 does not cut into 2 chunks .*multiple of 2"):
        on_ranks(2, lambda: shard_sequence(torch.zeros(1, 5), "cp", balanced=False))
    with pytest.raises(RankFailed, match=r"dim=2 is out of range"):
        on_ranks(2, lambda: shard_sequence(torch.zeros(1, 4), "cp", dim=2))


# -- bytes against the ledger -----------------------------------------------------------------------
def run_with_grad(attention, n, batch, heads, kv_heads, seq_local, head_dim, dtype):
    q = torch.randn(batch, heads, seq_local * n, head_dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq_local * n, head_dim, dtype=dtype)

    def body():
        local = [shard_sequence(t, "cp", dim=2).requires_grad_() for t in (q, k, k.clone())]
        attention(*local, "cp").sum().backward()

    with comm_ledger() as ledger:
        on_ranks(n, body)
    return ledger


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ring_sends_its_key_value_slice_n_minus_1_times_each_way(n, dtype):
    ledger = run_with_grad(ring_attention, n, 2, 4, 2, 6, 4, dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    expected = ring_attention_bytes(batch=2, kv_heads=2, seq_local=6, head_dim=4, itemsize=itemsize, size=n)
    assert expected == (n - 1) * 2 * (2 * 2 * 6 * 4 * itemsize)
    for phase in ("forward", "backward"):
        records = [r for r in ledger.records if r.phase == phase]
        assert {r.op for r in records} == {"ppermute"}
        for rank in range(n):
            mine = [r for r in records if r.rank == rank]
            assert len(mine) == n - 1, (phase, rank, mine)
            assert sum(r.sent_bytes for r in mine) == expected, (phase, rank)


@pytest.mark.parametrize(("n", "kv_heads", "sent_kv"), [(2, 4, 4), (4, 4, 4), (8, 4, 8), (4, 2, 4)])
def test_ulysses_sends_the_all_to_all_volumes_each_way(n, kv_heads, sent_kv):
    """``sent_kv``: the key/value heads the all-to-alls carry, repeated up to a count the axis divides."""
    ledger = run_with_grad(ulysses_attention, n, 2, 8, kv_heads, 4, 4, torch.float64)
    expected = ulysses_attention_bytes(batch=2, heads=8, kv_heads=kv_heads, seq_local=4, head_dim=4, itemsize=8,
                                       size=n)
    assert expected == (8 + sent_kv + sent_kv + 8) * (2 * 4 * 4 * 8) * (n - 1) // n
    for phase in ("forward", "backward"):
        records = [r for r in ledger.records if r.phase == phase]
        assert {r.op for r in records} == {"all_to_all"}
        for rank in range(n):
            mine = [r for r in records if r.rank == rank]
            assert len(mine) == 4, (phase, rank, mine)
            assert sum(r.sent_bytes for r in mine) == expected, (phase, rank)


# -- errors ---------------------------------------------------------------------------------------
def attention_error(attention, q, k, v, n=2, **kw):
    with pytest.raises(RankFailed) as info:
        on_ranks(n, lambda: attention(q, k, v, "cp", **kw))
    return str(info.value)


@pytest.mark.parametrize("attention", [ring_attention, ulysses_attention])
def test_bad_shapes_are_refused_naming_the_argument(attention):
    good = torch.zeros(1, 4, 4, 2)
    assert "q has shape (4, 4, 2); it must be [batch, heads, seq_local, head_dim]" in attention_error(
        attention, torch.zeros(4, 4, 2), good, good
    )
    assert "k has shape (1, 4, 4, 2) but v has (1, 4, 4, 3)" in attention_error(
        attention, good, good, torch.zeros(1, 4, 4, 3)
    )
    assert "q has 4 heads, which k's 3 key/value heads do not divide" in attention_error(
        attention, good, torch.zeros(1, 3, 4, 2), torch.zeros(1, 3, 4, 2)
    )
    assert "batch, seq_local and head_dim must agree" in attention_error(
        attention, good, torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2)
    )
    assert "cast them to one" in attention_error(attention, good, good.double(), good.double())


def test_ring_refuses_an_odd_local_sequence_when_balanced():
    x = torch.zeros(1, 2, 3, 2)
    assert "does not cut into 2 x 2 chunks" in attention_error(ring_attention, x, x, x)
    on_ranks(2, lambda: ring_attention(x, x, x, "cp", balanced=False))  # unbalanced: one chunk, fine


def test_ulysses_refuses_heads_the_axis_does_not_divide():
    q, one = torch.zeros(1, 6, 4, 2), torch.zeros(1, 1, 4, 2)
    assert "q has 6 heads, which the size 4 of axis 'cp' does not divide" in attention_error(
        ulysses_attention, q, q, q, n=4
    )
    assert "q has 1 head, which the size 2 of axis 'cp' does not divide" in attention_error(
        ulysses_attention, one, one, one
    )


def test_ulysses_refuses_attn_together_with_causal_or_scale():
    x = torch.zeros(1, 2, 4, 2)
    message = attention_error(ulysses_attention, x, x, x, attn=lambda q, k, v: q, causal=False)
    assert "pass either attn or causal/scale" in message
