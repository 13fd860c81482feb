"""Padding and packed sequences under context parallel: the TokenMask against transformers' own masks,
ring and Ulysses attention against sdpa with the whole boolean mask, and refusals.

float64 on thread ranks: the ring merges masked blocks by their log-sum-exps (rounding, ~1e-15; the
1e-12 tolerance leaves room for that only); Ulysses runs sdpa with the same mask rows in another order.
The reference mask is transformers' own (``masking_utils.create_causal_mask``), not the package's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.collectives import Mesh, launch
from shardwise.transforms.context_parallel import ring_attention, shard_sequence, ulysses_attention
from shardwise.transforms.context_parallel.masks import TokenMask, token_mask

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

TOL = {"rtol": 1e-12, "atol": 1e-12}
SEQ = 16


def hf_mask(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int) -> torch.Tensor:
    """[batch, 1, seq, seq] bool: what transformers gives Llama's sdpa attention for this batch."""
    from transformers.masking_utils import create_causal_mask

    config = T.LlamaConfig(attn_implementation="sdpa")
    embeds = torch.zeros(batch, SEQ, 4)
    mask = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask, cache=None,
                              position_ids=position_ids, allow_is_causal_skip=False)
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    return mask.expand(batch, 1, SEQ, SEQ)


PADDING = torch.ones(2, SEQ, dtype=torch.long)
LEFT, RIGHT = PADDING.clone(), PADDING.clone()
LEFT[0, :5], LEFT[1, :3] = 0, 0
RIGHT[0, 11:], RIGHT[1, 13:] = 0, 0
PACKED = torch.tensor([
    [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7],
    [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2],
])
CASES = {
    "left": (LEFT, None), "right": (RIGHT, None), "packed": (None, PACKED), "plain": (None, torch.arange(SEQ)[None]),
}


@pytest.mark.parametrize("case", CASES)
def test_token_mask_is_what_transformers_builds(case: str) -> None:
    attention_mask, position_ids = CASES[case]
    whole = torch.arange(SEQ)
    got = token_mask(attention_mask, position_ids).visible(whole, whole, causal=True).expand(2, 1, SEQ, SEQ)
    assert torch.equal(got, hf_mask(attention_mask, position_ids, 2))


def inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, SEQ, 4, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, SEQ, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(2, 4, SEQ, 4, dtype=torch.float64, generator=gen)


def check(attention, n: int, balanced: bool, mask: TokenMask, causal: bool, seed: int = 0) -> None:
    """Each rank's output and q, k, v gradients equal the sharded sdpa with the whole boolean mask."""
    q, k, v, g = inputs(seed)
    whole = torch.arange(SEQ)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask.visible(whole, whole, causal), enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, leaves, g)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, "cp", dim=2, balanced=balanced)

    def main():
        with Mesh(cp=n):
            local = [cut(t).requires_grad_() for t in (q, k, v)]
            out = attention(*local, "cp", balanced=balanced, causal=causal, mask=mask)
            grads = torch.autograd.grad(out, local, cut(g))
            return [cut(ref.detach()), out.detach(), *zip(grads, map(cut, ref_grads), strict=True)]

    for want, got, *grads in launch(main, world=n, timeout=60):
        torch.testing.assert_close(got, want, **TOL)
        for name, (got_grad, want_grad) in zip("qkv", grads, strict=True):
            torch.testing.assert_close(got_grad, want_grad, **TOL, msg=f"grad {name}")


@pytest.mark.parametrize("case", ["left", "right", "packed"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_ring_attention_with_padding_and_packing_equals_sdpa_with_the_mask(case: str, n: int, balanced: bool) -> None:
    check(ring_attention, n, balanced, token_mask(*CASES[case]), causal=True)


@pytest.mark.parametrize("case", ["left", "packed"])
@pytest.mark.parametrize("attention", [ring_attention, ulysses_attention])
def test_non_causal_and_ulysses_with_a_mask_equal_sdpa(case: str, attention) -> None:
    for causal in (True, False):
        check(attention, 2, True, token_mask(*CASES[case]), causal=causal)


@settings(max_examples=8)
@given(
    n=st.sampled_from([2, 4]),
    balanced=st.booleans(),
    starts=st.lists(st.integers(1, SEQ - 1), max_size=4),
    pads=st.tuples(st.integers(0, SEQ - 1), st.booleans()),
    packed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_ring_with_random_documents_or_padding(n, balanced, starts, pads, packed, seed) -> None:
    """Documents cut at drawn positions, or a drawn padding (left or right): a block may be hidden
    wholly, partly, or a query may see nothing at all."""
    if packed:
        positions = torch.zeros(SEQ, dtype=torch.long)
        for i in range(1, SEQ):
            positions[i] = 0 if i in starts else positions[i - 1] + 1
        mask = token_mask(position_ids=positions.expand(2, SEQ))
    else:
        count, left = pads
        attention_mask = torch.ones(2, SEQ, dtype=torch.long)
        attention_mask[1, :count] = 0 if left else 1
        attention_mask[1, SEQ - count :] = 1 if left else 0
        mask = token_mask(attention_mask=attention_mask)
    check(ring_attention, n, balanced, mask, causal=True, seed=seed)


def test_a_mask_of_the_wrong_size_and_a_custom_ulysses_attention_with_a_mask_are_refused() -> None:
    q, k, v, _ = inputs()
    local_only = token_mask(attention_mask=LEFT[:, : SEQ // 2])

    def main():
        with Mesh(cp=2):
            local = [shard_sequence(t, "cp", dim=2) for t in (q, k, v)]
            with pytest.raises(ValueError, match=r"mask.segments has shape \(2, 8\).*the whole sequence's tokens"):
                ring_attention(*local, "cp", mask=local_only)
            with pytest.raises(ValueError, match="pass either attn or causal/scale/mask"):
                ulysses_attention(*local, "cp", attn=lambda *t: t[0], mask=token_mask(attention_mask=LEFT))

    launch(main, world=2, timeout=60)
    with pytest.raises(ValueError, match=r"4-D mask of its own cannot be cut"):
        token_mask(attention_mask=torch.ones(2, 1, SEQ, SEQ))


@pytest.mark.parametrize(("balanced", "count"), [(True, 12), (False, 8)])
def test_ring_on_a_rank_whose_queries_are_all_padding(balanced: bool, count: int) -> None:
    """Short prompts left-padded in a long batch: every query a rank holds is padding, so no key block
    is added on that rank and its output is zeros. Its queries still get their (zero) gradient: without
    it the rank's q projection would issue no gradient collective and the ranks would mismatch."""
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[:, :count] = 0  # balanced, 2 ranks: rank 1 holds positions 4..11; unbalanced: rank 0 0..7
    check(ring_attention, 2, balanced, token_mask(attention_mask=attention_mask), causal=True)
