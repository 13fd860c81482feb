"""ALiBi models under tensor parallel: a Region's argument of one slice per head (``HeadsAlong``) cut to the
rank's heads at each call (head_arguments.py).

Bloom, MPT and Falcon(alibi=True) build one ALiBi bias of all H heads in the model around the layers and pass
it to every attention (Bloom's ``alibi`` (b * H, 1, t), batch-major; MPT's ``position_bias`` (H, 1, t);
Falcon's folded into the ``attention_mask`` (b, H, q, k)). Unmodified transformers models from tiny configs,
random init, float64, dropout 0: the tp step's loss and updated parameters equal the single-device step's
(``assert_equivalent`` at rtol 1e-9: the split only reorders float64 sums, so the errors are rounding, ~1e-16).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw
from shardwise.transforms.tensor_parallel import region_probe

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 64, 32, 2, 4, 8, 2
Build = Callable[[], tuple[nn.Module, type, dict[str, Any], str]]


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out if isinstance(out, Tensor) else out.logits, targets)


def bloom(heads: int = HEADS) -> tuple[nn.Module, type, dict[str, Any], str]:
    config = T.BloomConfig(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=LAYERS, n_head=heads, hidden_dropout=0.0,
                           attention_dropout=0.0, attn_implementation="eager")
    return T.BloomForCausalLM(config), T.models.bloom.modeling_bloom.BloomBlock, sw.tp.bloom_plan(), sw.tp.BLOOM_BLOCKS


def mpt() -> tuple[nn.Module, type, dict[str, Any], str]:
    config = T.MptConfig(vocab_size=VOCAB, d_model=WIDTH, n_layers=LAYERS, n_heads=HEADS, max_seq_len=SEQ,
                         attn_config={"attn_pdrop": 0}, resid_pdrop=0.0, emb_pdrop=0.0)
    return T.MptForCausalLM(config), T.models.mpt.modeling_mpt.MptBlock, sw.tp.mpt_plan(), sw.tp.MPT_BLOCKS


def falcon() -> tuple[nn.Module, type, dict[str, Any], str]:
    """Falcon with ALiBi, one key/value head per query head (its fused projection laid out per head)."""
    config = T.FalconConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            alibi=True, new_decoder_architecture=False, multi_query=False, hidden_dropout=0.0,
                            attention_dropout=0.0, attn_implementation="eager")
    model = T.FalconForCausalLM(config)
    return model, T.models.falcon.modeling_falcon.FalconDecoderLayer, sw.tp.falcon_plan(), sw.tp.FALCON_BLOCKS


BUILDS: dict[str, Build] = {"bloom": bloom, "mpt": mpt, "falcon": falcon}


class WithMask(nn.Module):
    """A causal LM on ids and a padding mask stacked into one (b, 2, t) input (the chain's one input)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids_and_mask: Tensor) -> Tensor:
        return self.m(input_ids=ids_and_mask[:, 0], attention_mask=ids_and_mask[:, 1], use_cache=False).logits


def batches(n: int = 2, padded: bool = False, batch: int = BATCH) -> list[tuple[Tensor, Tensor]]:
    """``n`` batches of ids (with a left-padding mask stacked on, where ``padded``: sample i pads its first
    i + 1 positions) and targets."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(2, VOCAB, (batch, SEQ), generator=gen)
        targets = torch.randint(VOCAB, (batch, SEQ), generator=gen)
        if padded:
            mask = torch.ones(batch, SEQ, dtype=torch.long)
            for i in range(batch):
                mask[i, : i + 1] = 0
            ids = torch.stack([ids, mask], 1)
        out.append((ids, targets))
    return out


def steps(model: nn.Module, unit: type, data: list[Any], dtype: torch.dtype = torch.float64) -> tuple[sw.Step, Any]:
    chain, params = sw.functionalize(model.to(dtype), units=unit, example_input=data[0][0])
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("family", list(BUILDS))
def test_the_ready_plans_equal_one_device(family: str, sequence_parallel: bool) -> None:
    """sw.tp.bloom_plan / mpt_plan / falcon_plan: attention (its ALiBi argument cut to the rank's heads), MLP,
    the tied embedding and head split on the vocabulary; with sequence parallel over the blocks too (the bias
    spans the whole sequence, as the Region's gathered input does)."""
    torch.manual_seed(0)
    model, unit, plan, blocks = BUILDS[family]()
    data = batches()
    step, params = steps(model, unit, data)
    tp = sw.tensor_parallel(step, "tp", plan, sequence_parallel=blocks if sequence_parallel else None)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), data, params, rtol=1e-9)


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_a_padded_batch_equals_one_device(family: str) -> None:
    """Left padding: Bloom's ALiBi counts positions by the mask's cumsum, so each sample's rows of the (b * H,
    1, t) bias differ; a rank must take its heads of each sample (batch-major). Falcon's mask folds the padding
    and the bias together per sample and head. In float32: in float64 a padded query, whose every key is masked
    with float64's min, overflows to -inf with the bias added and its softmax is NaN on one device as on the
    ranks (a NaN the check matched with a NaN until it refused a NaN reference); float32's min does not."""
    torch.manual_seed(0)
    inner, unit, plan, _ = BUILDS[family]()
    data = batches(padded=True, batch=3)
    step, params = steps(WithMask(inner), unit, data, torch.float32)
    plan = {f"m.{k}": v for k, v in plan.items()}
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), data, params)


def test_bloom_at_tp4_equals_one_device() -> None:
    """8 heads over 4 ranks (2 each), batch 2: each rank takes rows {2r, 2r+1} and {8+2r, 8+2r+1} of the folded
    bias."""
    torch.manual_seed(0)
    model, unit, plan, _ = bloom(heads=8)
    data = batches(n=1)
    step, params = steps(model, unit, data)
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=4), data, params, rtol=1e-9)


# -- a bias that requires grad: its gradient summed over the ranks, each head's once ---------------------------


class BiasAttention(nn.Module):
    """Causal attention adding ``bias`` (H, t, t), one slice per head, to its scores."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """A block with learned ALiBi slopes: it builds the bias (H, t, t) from its parameter, outside the attention
    (the Region), and passes it in."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.slopes = nn.Parameter(torch.linspace(-1.0, -0.1, heads))
        self.attn = BiasAttention(width, heads)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        distance = (torch.arange(t, device=x.device)[None, :] - torch.arange(t, device=x.device)[:, None])
        bias = self.slopes[:, None, None] * distance.to(x.dtype)
        return x + self.attn(self.norm(x), bias)


class WholeSequenceBlock(Block):
    """Block, its bias built for the whole sequence (SEQ) whatever slice of it ``x`` holds: under sequence
    parallel the block's input is the rank's slice, the attention's (the Region's) the whole sequence."""

    def forward(self, x: Tensor) -> Tensor:
        distance = torch.arange(SEQ)[None, :] - torch.arange(SEQ)[:, None]
        return x + self.attn(self.norm(x), self.slopes[:, None, None] * distance.to(x.dtype))


class BroadcastBlock(Block):
    """A learned bias of one slice for all heads, (1, t, t): broadcast over the heads, handed on whole."""

    def forward(self, x: Tensor) -> Tensor:
        distance = torch.arange(SEQ)[None, :] - torch.arange(SEQ)[:, None]
        return x + self.attn(self.norm(x), self.slopes[:1, None, None] * distance.to(x.dtype))


class SlicedSlopesBlock(WholeSequenceBlock):
    """WholeSequenceBlock whose slopes also scale the block's input: under sequence parallel the rank's slice."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x * (1 + 0.1 * self.slopes.mean()))


class OwnScaleBlock(WholeSequenceBlock):
    """SlicedSlopesBlock with a parameter of its own for the scale: the slopes only build the bias."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__(width, heads)
        self.scale = nn.Parameter(torch.linspace(-1.0, -0.1, heads))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x * (1 + 0.1 * self.scale.mean()))


class BlockStack(nn.Module):
    """An embedding, LAYERS blocks each ``make_block()``, a head (test_falcon_grouped.py's model too)."""

    def __init__(self, make_block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(make_block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class LearnedBias(BlockStack):
    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__(lambda: block(WIDTH, HEADS))


def learned_bias_plan() -> dict[str, Any]:
    return {"blocks.*.attn": sw.tp.Region(heads=("n_heads",), arguments={"bias": sw.tp.HeadsAlong(dim=0)}),
            "blocks.*.attn.[qkv]": sw.tp.Colwise(), "blocks.*.attn.o": sw.tp.Rowwise()}


def test_a_bias_that_requires_grad_gets_every_heads_gradient_once() -> None:
    """The slopes' gradient reaches them through each rank's slice of the bias (its heads' part only): summed
    over the ranks as the argument enters the Region, every rank updates them as one device does (the replica
    check refuses ranks whose replicated gradients differ; a sum of the whole gradient would count it tp times);
    and the ledger is the Plan (that sum included)."""
    torch.manual_seed(0)
    model = LearnedBias()
    data = [(ids, targets) for ids, targets in batches()]
    step, params = steps(model, Block, data)
    tp = sw.tensor_parallel(step, "tp", learned_bias_plan())
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), data, params, rtol=1e-9)
    mesh = sw.Mesh(tp=2)
    plan = tp.plan(mesh, params, data[0])

    def run() -> list[Any]:
        state = tp.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            tp(state, data[0])
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    bias_bytes = HEADS * SEQ * SEQ * 8
    for rank, got in enumerate(sw.launch(run, 2)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]
        assert ("psum", "tp", "float64", bias_bytes) in got  # the bias's gradient, once per block


@pytest.mark.parametrize("mesh_shape", [{"tp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}],
                         ids=["tp2-sp", "dp2xtp2-sp", "pp2xtp2-sp"])
def test_a_bias_that_requires_grad_in_a_sequence_parallel_block_is_summed_once(mesh_shape: dict[str, int]) -> None:
    """Under sequence parallel every replicated parameter of the block has its gradient summed over the axis (it
    acts on the rank's slice of the sequence); the slopes reach the attention only through the bias, which
    entered with its gradient summed already: summed again they trained on twice their gradient (grad_norm off
    by 3.6e-4 relative at step 1, no error). Under ZeRO-3 and across pipeline stages too."""
    torch.manual_seed(0)
    data = batches(batch=4)
    step, params = steps(LearnedBias(WholeSequenceBlock), WholeSequenceBlock, data)
    tp = sw.tensor_parallel(step, "tp", learned_bias_plan(), sequence_parallel="blocks.*")
    if "dp" in mesh_shape:
        tp = sw.shard_params(tp, "dp", 3)
    if "pp" in mesh_shape:
        tp = sw.pipeline(tp, "pp", "1f1b", 2)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(**mesh_shape), data, params, rtol=1e-9)


def _composed(tp: sw.Step, mesh_shape: dict[str, int]) -> sw.Step:
    if "dp" in mesh_shape:
        tp = sw.shard_params(tp, "dp", 3)
    return sw.pipeline(tp, "pp", "1f1b", 2) if "pp" in mesh_shape else tp


@pytest.mark.parametrize("mesh_shape", [{"tp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}],
                         ids=["tp2-sp", "dp2xtp2-sp", "pp2xtp2-sp"])
def test_slopes_that_build_the_bias_and_scale_the_slice_are_refused_by_name(mesh_shape: dict[str, int]) -> None:
    """Through the bias the slopes' gradient is whole on every rank (summed as it entered), through the slice it
    is each rank's part: no sum makes both right. The refusal was the replica check's, advising a Region and
    sequence_parallel=, which the plan had already; it names the parameter, the argument and the ways out."""
    torch.manual_seed(0)
    data = batches(batch=4)
    step, params = steps(LearnedBias(SlicedSlopesBlock), SlicedSlopesBlock, data)
    tp = _composed(sw.tensor_parallel(step, "tp", learned_bias_plan(), sequence_parallel="blocks.*"), mesh_shape)
    with pytest.raises(sw.collectives.RankFailed) as failed:
        sw.testing.assert_equivalent(tp, step, sw.Mesh(**mesh_shape), data, params, rtol=1e-9)
    text = str(failed.value)
    assert "the replicated parameter 'blocks.0.slopes' builds 'bias', the per-head argument (HeadsAlong) of " \
        "Region 'blocks.0.attn', and also acts on this rank's slice of the sequence" in text, text
    assert "Give the two uses parameters of their own" in text, text
    assert "or leave 'blocks.0' out of sequence_parallel=, and each layer built alike ('blocks.*')" in text, text
    assert "as a Region()" not in text, text  # the replica check's advice, which the plan follows already


@pytest.mark.parametrize("mesh_shape", [{"tp": 2}, {"pp": 2, "tp": 2}], ids=["tp2", "pp2xtp2"])
@pytest.mark.parametrize("fix", ["own-parameters", "no-sequence-parallel"])
def test_the_ways_out_of_that_refusal_equal_one_device(fix: str, mesh_shape: dict[str, int]) -> None:
    """What the refusal advises works: a parameter of its own for the scale (sequence parallel kept), or the
    slopes in both uses without sequence parallel (the slice then is the whole sequence on every rank)."""
    torch.manual_seed(0)
    data = batches(batch=4)
    block = OwnScaleBlock if fix == "own-parameters" else SlicedSlopesBlock
    step, params = steps(LearnedBias(block), block, data)
    sequence_parallel = "blocks.*" if fix == "own-parameters" else None
    tp = _composed(sw.tensor_parallel(step, "tp", learned_bias_plan(), sequence_parallel=sequence_parallel), mesh_shape)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(**mesh_shape), data, params, rtol=1e-9)


@pytest.mark.parametrize("mesh_shape", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_a_bias_broadcast_over_the_heads_that_requires_grad_is_summed(mesh_shape: dict[str, int]) -> None:
    """A size of 1 along the heads' dim is handed on whole, but each rank's gradient of it is the sum over its own
    heads only: it enters too (unsummed, the ranks' gradients of the slopes differed and the step was refused)."""
    torch.manual_seed(0)
    data = batches(batch=4)
    step, params = steps(LearnedBias(BroadcastBlock), BroadcastBlock, data)
    tp = sw.tensor_parallel(step, "tp", learned_bias_plan())
    if "dp" in mesh_shape:
        tp = sw.shard_params(tp, "dp", 3)
    sw.testing.assert_equivalent(tp, step, sw.Mesh(**mesh_shape), data, params, rtol=1e-9)


# -- the probe judges these Regions (no false refusal); without the entry the step is refused by cause ------------


@pytest.mark.parametrize("family", list(BUILDS))
def test_the_region_probe_judges_the_attention_and_finds_it_exact(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe runs the split attention on its cut arguments and the whole one on them tiled back (the rank's
    heads at every place, as its weights), on the batch's first sample (a folded bias cut to that sample's rows):
    it compares, and finds nothing (no run skipped by an exception, nothing refused)."""
    judged: list[tuple[str, bool, Any]] = []
    compare = region_probe._compare

    def recording(module: nn.Module, *args: Any) -> Any:
        found = compare(module, *args)  # an exception here fails the test: every run must compute
        judged.append((type(module).__name__, args[7], found))
        return found

    monkeypatch.setattr(region_probe, "_compare", recording)
    torch.manual_seed(0)
    model, unit, plan, _ = BUILDS[family]()
    data = batches(n=1)
    step, params = steps(model, unit, data)
    tp = sw.tensor_parallel(step, "tp", plan)
    sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), data[0]), 2)
    attention = [(one_sample, found) for name, one_sample, found in judged if name.endswith("Attention")]
    assert len(attention) == 2 * LAYERS, judged  # each layer's attention, on each rank, once
    assert all(one_sample and found is None for one_sample, found in attention), attention


@pytest.mark.parametrize(
    ("family", "entry"),
    [("bloom", "arguments={'alibi': sw.tp.HeadsAlong(dim=0, folded_batch=True)}"),
     ("mpt", "arguments={'position_bias': sw.tp.HeadsAlong(dim=0)}"),
     ("falcon", "arguments={'attention_mask': sw.tp.HeadsAlong(dim=1)}")],
)
def test_without_the_entry_the_refusal_names_it_first(family: str, entry: str) -> None:
    """Today's refusal (whole_head_bias.py) stays for a plan whose Region does not cut the argument, and its
    fix names the entry that would, for this argument, before the other ways out."""
    torch.manual_seed(0)
    model, unit, plan, _ = BUILDS[family]()
    for pattern, style in plan.items():
        if isinstance(style, sw.tp.Region) and style.arguments:
            plan[pattern] = sw.tp.Region(heads=style.heads, local=style.local)
    text = _refusal(model, unit, plan)
    assert "a per-head bias built outside the Region" in text, text
    fix = text.index(f"Give the Region an entry for it, sw.tp.Region(..., {entry})")
    assert fix < text.index("sw.tp.PerHead()") < text.index("leave this attention replicated"), text


# -- bad input ------------------------------------------------------------------------------------------


def test_bad_styles_are_refused_where_they_are_made() -> None:
    with pytest.raises(TypeError, match=r"HeadsAlong\(dim='0'\)"):
        sw.tp.HeadsAlong(dim="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"HeadsAlong\(folded_batch=1\)"):
        sw.tp.HeadsAlong(dim=0, folded_batch=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a dict of the forward's argument names to sw\.tp\.HeadsAlong"):
        sw.tp.Region(heads=("n",), arguments={"alibi": 0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="without heads=: an argument's heads are cut as the Region's heads are"):
        sw.tp.Region(arguments={"alibi": sw.tp.HeadsAlong(dim=0)})
    chain, _ = sw.functionalize(LearnedBias().double(), units=Block, example_input=batches(n=1)[0][0])
    with pytest.raises(TypeError, match=r"HeadsAlong\(\) describes an argument of a Region's module"):
        sw.tensor_parallel(sw.train_step(chain, lm_loss, sw.optim.sgd(0.1)), "tp",
                           {"blocks.*.attn": sw.tp.HeadsAlong(dim=0)})  # type: ignore[dict-item]
    region = sw.tp.Region(heads=("n",), arguments={"b": sw.tp.HeadsAlong(0), "a": sw.tp.HeadsAlong(1)})
    assert region == sw.tp.Region(heads=("n",), arguments=(("a", sw.tp.HeadsAlong(1)), ("b", sw.tp.HeadsAlong(0))))
    assert hash(region) == hash(sw.tp.Region(heads=("n",), arguments={"a": sw.tp.HeadsAlong(1),
                                                                      "b": sw.tp.HeadsAlong(0)}))


def _bloom_with(along: dict[str, sw.tp.HeadsAlong]) -> tuple[nn.Module, type, dict[str, Any]]:
    torch.manual_seed(0)
    model, unit, plan, _ = bloom()
    plan["transformer.h.*.self_attention"] = sw.tp.Region(heads=("num_heads",), local=("split_size",), arguments=along)
    return model, unit, plan


@pytest.mark.parametrize(
    ("along", "message"),
    [({"biases": sw.tp.HeadsAlong(dim=0)},
      "names the argument 'biases', which BiasAttention.forward ('blocks.0.attn') does not take; its arguments are "
      "['x', 'bias']"),
     ({"x": sw.tp.HeadsAlong(dim=0)}, "names 'x', the hidden states of 'blocks.0.attn', which enter the Region whole"),
     ({"bias": sw.tp.HeadsAlong(dim=0, heads="n_kv")},
      "HeadsAlong(heads='n_kv') for 'bias', but the Region names the heads ('n_heads',)")],
    ids=["unknown-argument", "hidden-states", "unknown-count"],
)
def test_a_plan_naming_what_the_module_does_not_have_is_refused_when_applied(
    along: dict[str, sw.tp.HeadsAlong], message: str
) -> None:
    torch.manual_seed(0)
    plan = {**learned_bias_plan(), "blocks.*.attn": sw.tp.Region(heads=("n_heads",), arguments=along)}
    chain, _ = sw.functionalize(LearnedBias().double(), units=Block, example_input=batches(n=1)[0][0])
    with pytest.raises(ValueError) as caught:
        sw.tensor_parallel(sw.train_step(chain, lm_loss, sw.optim.sgd(0.1)), "tp", plan)
    assert message in str(caught.value), str(caught.value)


def test_a_name_the_forward_takes_only_through_kwargs_is_refused_when_not_passed() -> None:
    """BloomAttention.forward takes **kwargs, so a misspelt name passes the plan's check: its first call, which
    does not pass it, is refused."""
    model, unit, plan = _bloom_with({"alibis": sw.tp.HeadsAlong(dim=0, folded_batch=True)})
    text = _refusal(model, unit, plan)
    assert ("Region 'transformer.h.0.self_attention' was called without 'alibis', which its plan marks "
            "HeadsAlong(dim=0) and its forward takes only through **kwargs; the call passed ['hidden_states', "
            "'residual', ") in text, text


@pytest.mark.parametrize(
    ("along", "message"),
    [({"alibi": sw.tp.HeadsAlong(dim=3, folded_batch=True)},
      f"HeadsAlong(dim=3) for its argument 'alibi', which has shape ({BATCH * HEADS}, 1, {SEQ}): dim 3 is out of "
      "range for its 3 dims"),
     ({"alibi": sw.tp.HeadsAlong(dim=0)},
      f"its argument 'alibi' of shape ({BATCH * HEADS}, 1, {SEQ}) is marked HeadsAlong(dim=0), so its dim 0 "
      f"({BATCH * HEADS}) should hold one slice per head, {HEADS} (or 1, broadcast over the heads); it is {BATCH} "
      "times the heads: if it holds the batch and the heads flattened (b * H rows, Bloom's alibi), say "
      "folded_batch=True"),
     ({"alibi": sw.tp.HeadsAlong(dim=-2, folded_batch=True)},
      f"its argument 'alibi' of shape ({BATCH * HEADS}, 1, {SEQ}) is marked HeadsAlong(dim=-2, folded_batch=True), "
      f"so its dim 1 (1) should be the batch ({BATCH}) times the {HEADS} heads"),
     ({"alibi": sw.tp.HeadsAlong(dim=2)},
      f"so its dim 2 ({SEQ}) should hold one slice per head, {HEADS} (or 1, broadcast over the heads); it is 2 "
      "times the heads")],
    ids=["dim-out-of-range", "folded-not-said", "not-batch-times-heads", "not-the-heads"],
)
def test_an_argument_not_laid_out_as_said_is_refused_at_its_call(
    along: dict[str, sw.tp.HeadsAlong], message: str
) -> None:
    model, unit, plan = _bloom_with(along)
    text = _refusal(model, unit, plan)
    assert "tensor_parallel: Region 'transformer.h.0.self_attention': " in text
    assert message in text, text


def test_a_size_the_heads_do_not_divide_is_refused() -> None:
    """MPT's position_bias marked along its key dim (t = 6, 4 heads): neither the heads nor a multiple."""
    torch.manual_seed(0)
    config = T.MptConfig(vocab_size=VOCAB, d_model=WIDTH, n_layers=LAYERS, n_heads=HEADS, max_seq_len=6,
                         attn_config={"attn_pdrop": 0}, resid_pdrop=0.0, emb_pdrop=0.0)
    plan = sw.tp.mpt_plan()
    plan["transformer.blocks.*.attn"] = sw.tp.Region(heads=("n_heads",),
                                                     arguments={"position_bias": sw.tp.HeadsAlong(dim=2)})
    text = _refusal(T.MptForCausalLM(config), T.models.mpt.modeling_mpt.MptBlock, plan, seq=6)
    assert (f"its argument 'position_bias' of shape ({HEADS}, 1, 6) is marked HeadsAlong(dim=2), so its dim 2 (6) "
            f"should hold one slice per head, {HEADS} (or 1, broadcast over the heads); check the dim") in text, text


def test_at_a_batch_of_one_the_refusal_names_folded_batch_too() -> None:
    """Bloom's (b * H, 1, t) alibi at b = 1 reads as (H, 1, t): the entry without folded_batch cuts that call
    alike and refuses the next batch of 2, so the refusal says when to add it (it suggested dim=0 alone)."""
    torch.manual_seed(0)
    model, unit, plan, _ = bloom()
    plan["transformer.h.*.self_attention"] = sw.tp.Region(heads=("num_heads",), local=("split_size",))
    text = _refusal(model, unit, plan, batch=1)
    assert ("Give the Region an entry for it, sw.tp.Region(..., arguments={'alibi': sw.tp.HeadsAlong(dim=0)}) (with "
            "folded_batch=True where that dim holds the batch and the heads flattened, b * H rows, batch-major, as "
            "Bloom's alibi: at this batch of 1 the two read alike)") in text, text


def _refusal(model: nn.Module, unit: type, plan: dict[str, Any], seq: int = SEQ, batch: int = BATCH) -> str:
    """The tp2 step's refusal on its first batch (of ``batch`` samples)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    batch_ = (ids, torch.randint(VOCAB, (batch, seq), generator=gen))
    chain, params = sw.functionalize(model.double(), units=unit, example_input=ids)
    tp = sw.tensor_parallel(sw.train_step(chain, lm_loss, sw.optim.sgd(0.1)), "tp", plan)
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        sw.launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), batch_), 2)
    return str(caught.value)
