"""Grouped-query Falcon (``new_decoder_architecture=True``: Falcon-40B's and 180B's layout) under tensor parallel.

Its fused ``query_key_value`` is laid out per key/value group, ``[num_kv_heads, queries per group + 2, head_dim]``:
a plain Colwise gives each rank whole groups, and the attention's ``view(..., num_kv_heads, -1, head_dim)`` of
them carries the split on its groups dim (head_factors.py), so cutting each group's queries off
(``grouped[..., :-2, :]``) is a cut within each group, the same on a rank as on one device. Unmodified
transformers models from tiny configs, random init, float64, dropout 0: the tp step's loss and updated
parameters equal the single-device step's (``assert_equivalent`` at rtol 1e-9, as test_alibi_heads.py: the
split only reorders float64 sums). A cut across the groups after such a view is still refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw
from shardwise.transforms.tensor_parallel import region_probe

from .test_alibi_heads import LAYERS, VOCAB, WIDTH, BlockStack, batches, steps

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

HEADS = 8


def grouped_falcon(kv_heads: int, alibi: bool, layernorms: int = 2) -> nn.Module:
    """``layernorms``: ``num_ln_in_parallel_attn`` (2: ln_attn and ln_mlp; 1: one input_layernorm for both)."""
    config = T.FalconConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_kv_heads=kv_heads, alibi=alibi, new_decoder_architecture=True,
                            num_ln_in_parallel_attn=layernorms, hidden_dropout=0.0, attention_dropout=0.0,
                            attn_implementation="eager")
    return T.FalconForCausalLM(config)



def _layer() -> type:
    return T.models.falcon.modeling_falcon.FalconDecoderLayer


@pytest.mark.parametrize(
    ("kv_heads", "alibi", "sequence_parallel", "layernorms"),
    [(2, False, False, 2), (2, True, False, 2), (2, False, True, 2), (2, True, True, 2), (4, False, False, 2),
     (4, True, True, 1)],
    ids=["kv2-rotary", "kv2-alibi", "kv2-rotary-sp", "kv2-alibi-sp", "kv4-rotary", "kv4-alibi-sp-one-norm"],
)
def test_grouped_falcon_equals_one_device(kv_heads: int, alibi: bool, sequence_parallel: bool, layernorms: int) -> None:
    """sw.tp.falcon_plan() at tp2: 8 query heads in ``kv_heads`` groups (one group a rank at 2: the view's groups
    dim of size 1 on a rank), rotary or ALiBi (its bias cut to the rank's heads), with and without sequence
    parallel over the blocks; the layer's norms (ln_attn and ln_mlp, or one) stay whole."""
    torch.manual_seed(0)
    model = grouped_falcon(kv_heads, alibi, layernorms)
    layer = model.transformer.h[0]
    assert hasattr(layer, "ln_mlp") == (layernorms == 2)  # the layout asked for is the one built
    data = batches()
    step, params = steps(model, _layer(), data)
    blocks = sw.tp.FALCON_BLOCKS if sequence_parallel else None
    tp = sw.tensor_parallel(step, "tp", sw.tp.falcon_plan(), sequence_parallel=blocks)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), data, params, rtol=1e-9)


@pytest.mark.parametrize("alibi", [False, True], ids=["rotary", "alibi"])
def test_the_region_probe_judges_the_grouped_attention_and_finds_it_exact(
    alibi: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe runs the split attention and the whole one on its heads tiled back (each run computes, nothing
    skipped by an exception) and finds nothing to refuse."""
    judged: list[tuple[str, Any]] = []
    compare = region_probe._compare

    def recording(module: nn.Module, *args: Any) -> Any:
        found = compare(module, *args)  # an exception here fails the test: every run must compute
        judged.append((type(module).__name__, found))
        return found

    monkeypatch.setattr(region_probe, "_compare", recording)
    torch.manual_seed(0)
    data = batches(n=1)
    step, params = steps(grouped_falcon(2, alibi), _layer(), data)
    tp = sw.tensor_parallel(step, "tp", sw.tp.falcon_plan())
    sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), data[0]), 2)
    attention = [found for name, found in judged if name.endswith("Attention")]
    assert len(attention) == 2 * LAYERS, judged  # each layer's attention, on each rank, once
    assert all(found is None for found in attention), attention


def test_key_value_heads_the_axis_does_not_divide_are_refused_naming_the_config_field() -> None:
    """One key/value group at tp2: no rank can hold whole groups."""
    torch.manual_seed(0)
    data = batches(n=1)
    step, params = steps(grouped_falcon(1, alibi=False), _layer(), data)
    tp = sw.tensor_parallel(step, "tp", sw.tp.falcon_plan())
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), data[0]), 2)
    assert ("tensor_parallel: transformer.h.0.self_attention.num_kv_heads is 1 (the model's config.num_kv_heads), "
            "which the 2 ranks of axis 'tp' do not divide (each rank computes whole heads)") in str(caught.value)

    assert "use a tensor-parallel size that divides 1" in str(caught.value)  # a config field a size can change


def multi_query_falcon(multi_query: bool = True) -> nn.Module:
    """Falcon's first layout (``new_decoder_architecture=False``, Falcon-7B's): with ``multi_query`` one key/value
    head for all HEADS query heads, whatever ``config.num_kv_heads`` says."""
    config = T.FalconConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            new_decoder_architecture=False, multi_query=multi_query, hidden_dropout=0.0,
                            attention_dropout=0.0, attn_implementation="eager")
    return T.FalconForCausalLM(config)


def test_multi_query_falcon_is_refused_naming_the_config_field_and_the_ways_out() -> None:
    """The attention's num_kv_heads is 1 while config.num_kv_heads is HEADS: the refusal named no config field and
    advised a tp size that divides 1. It names config.multi_query and the ways out (tested below)."""
    torch.manual_seed(0)
    data = batches(n=1)
    model = multi_query_falcon()
    assert model.transformer.h[0].self_attention.num_kv_heads == 1 and model.config.num_kv_heads == HEADS
    step, params = steps(model, _layer(), data)
    tp = sw.tensor_parallel(step, "tp", sw.tp.falcon_plan())
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), data[0]), 2)
    text = str(caught.value)
    assert ("tensor_parallel: transformer.h.0.self_attention.num_kv_heads is 1 (the model's config.multi_query=True "
            "with config.new_decoder_architecture=False), which the 2 ranks of axis 'tp' do not divide") in text, text
    assert "Leave the attention out of the plan (plan['transformer.h.*.self_attention'] and its projections'" in text
    assert "config.multi_query=False" in text, text
    assert "config.new_decoder_architecture=True and config.num_kv_heads divisible by 2" in text, text
    assert "use a tensor-parallel size that divides 1" not in text, text


@pytest.mark.parametrize("fix", ["attention-left-out", "multi_query=False"])
def test_the_ways_out_for_multi_query_falcon_equal_one_device(fix: str) -> None:
    """The unchanged multi-query model with its attention left out of falcon_plan (replicated; the MLP, embedding
    and head split), or the model built with multi_query=False under the whole plan. (The grouped layout with
    num_kv_heads divisible by tp: test_grouped_falcon_equals_one_device.)"""
    torch.manual_seed(0)
    data = batches()
    step, params = steps(multi_query_falcon(multi_query=fix != "multi_query=False"), _layer(), data)
    plan = sw.tp.falcon_plan()
    if fix == "attention-left-out":
        plan = {pattern: style for pattern, style in plan.items() if ".self_attention" not in pattern}
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), data, params, rtol=1e-9)


def test_multi_query_falcon_with_its_attention_left_out_under_sp_is_told_a_region_cannot_split_it() -> None:
    """Its attention left out of the plan but in a sequence-parallel block: the refusal advised a Region, which
    the multi-query count refuses in turn. It names the count and the ways out that work (tested below)."""
    torch.manual_seed(0)
    data = batches(n=1)
    step, params = steps(multi_query_falcon(), _layer(), data)
    plan = {pattern: style for pattern, style in sw.tp.falcon_plan().items() if ".self_attention" not in pattern}
    tp = sw.tensor_parallel(step, "tp", plan, sequence_parallel=sw.tp.FALCON_BLOCKS)
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), data[0]), 2)
    text = str(caught.value)
    assert ("'transformer.h.0.self_attention' (FalconAttention) runs on this rank's 1/2 of the sequence" in text
            and "a Region cannot give it the whole sequence here: its num_kv_heads is 1 (the model's "
            "config.multi_query=True with config.new_decoder_architecture=False)" in text), text
    assert "Leave 'transformer.h.*' out of sequence_parallel" in text and "config.multi_query=False" in text, text
    assert "give it a Region" not in text, text


def test_multi_query_false_falcon_under_sequence_parallel_equals_one_device() -> None:
    """The other way out named above: the model built with multi_query=False, the whole plan, sequence parallel.
    (Leaving the blocks out of sequence_parallel: test_the_ways_out_for_multi_query_falcon_equal_one_device.)"""
    torch.manual_seed(0)
    data = batches()
    step, params = steps(multi_query_falcon(multi_query=False), _layer(), data)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", sw.tp.falcon_plan(),
                                                    sequence_parallel=sw.tp.FALCON_BLOCKS),
                                 step, sw.Mesh(tp=2), data, params, rtol=1e-9)


# -- a cut across the split after the grouped view is still refused -------------------------------------------


class GroupedAttention(nn.Module):
    """Falcon's grouped view of one fused projection, ``[kv_heads, queries per group + 2, head_dim]``, with
    ``view``: "groups" (Falcon's, by the divided count), "fixed" (by a fixed 2 outermost: the split falls
    inside the second dim); ``first_group``: the first group alone taken (a cut across the groups)."""

    def __init__(self, width: int, heads: int, kv_heads: int, view: str, first_group: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.view, self.first_group = view, first_group
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim)
        self.o = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        fused = self.qkv(x).view(b, t, -1, self.head_dim)
        if self.view == "fixed":  # head h times head h + 8 of 16 (queries, keys and values)
            halves = fused.view(b, t, 2, -1, self.head_dim)
            return self.o((halves[:, :, 0] * halves[:, :, 1]).reshape(b, t, -1))
        grouped = fused.view(b, t, self.num_kv_heads, -1, self.head_dim)
        if self.first_group:
            grouped = torch.cat([grouped[..., :1, :, :]] * grouped.shape[2], dim=2)
        q, k, v = grouped[..., :-2, :], grouped[..., -2:-1, :], grouped[..., -1:, :]
        return self.o((q * k + v).reshape(b, t, -1))  # (a stand-in for attention: each group on its own)


class Block(nn.Module):
    def __init__(self, view: str, first_group: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = GroupedAttention(WIDTH, HEADS, 4, view, first_group)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.norm(x))


class Grouped(BlockStack):
    def __init__(self, view: str = "groups", first_group: bool = False) -> None:
        super().__init__(lambda: Block(view, first_group))


GROUPED_PLAN = {"blocks.*.attn": sw.tp.Region(heads=("num_heads", "num_kv_heads")),
                "blocks.*.attn.qkv": sw.tp.Colwise(), "blocks.*.attn.o": sw.tp.Rowwise()}


def test_the_grouped_view_of_whole_groups_equals_one_device() -> None:
    """The stand-in as Falcon views it: the rank's 2 of 4 groups, each group's queries, key and value whole."""
    torch.manual_seed(0)
    data = batches()
    step, params = steps(Grouped(), Block, data)
    tp = sw.tensor_parallel(step, "tp", GROUPED_PLAN)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), data, params, rtol=1e-9)


@pytest.mark.parametrize(
    ("view", "first_group", "message"),
    [("groups", True, "picks heads by their number: it took heads one at a time, first [slice(None, 1, None)] at "
                      "test_falcon_grouped.py:"),
     ("fixed", False, "cuts its per-head view across the heads: a view of its 8 heads (dim 2) into [2, 4], where one "
                      "device views all 16 of them into [2, 8]: this rank's contiguous 1/2 of the heads is not whole "
                      "rows of dim 2 there")],
    ids=["first-group", "fixed-outer-factor"],
)
def test_a_cut_across_the_groups_after_the_view_is_refused(view: str, first_group: bool, message: str) -> None:
    """``grouped[..., :1, :, :]`` takes the rank's first group alone, another group on each rank than on one device
    (refused as a head picked by its number: the groups dim holds the heads); a view by a fixed 2 outermost pairs
    head h with head h + 8 on one device, other heads on a rank."""
    torch.manual_seed(0)
    data = batches(n=1)
    step, params = steps(Grouped(view, first_group), Block, data)
    tp = sw.tensor_parallel(step, "tp", GROUPED_PLAN)
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), data[0]), 2)
    assert "tensor_parallel: Colwise() on 'blocks.0.attn.qkv' gives each rank " in str(caught.value)
    assert message in str(caught.value), str(caught.value)
