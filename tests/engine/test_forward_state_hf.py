"""Hugging Face models keep Python state and caches their forward sets from the input (rotary
``max_seq_len_cached`` and ``attention_scaling``, dynamic RoPE's ``inv_freq``): the checks of
engine/run/forward_state.py and ModuleCall's rebinding check must not refuse them where a step calls
a layer twice (accumulation=2, remat), and the steps equal the one-device step (float64 model and
loss: HF's own loss casts the logits to float32, which accumulation would round differently; no
dropout, whose masks are drawn per micro-batch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.engine.model.module_call import ModuleCall

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _llama(**rope: Any) -> Any:
    return T.LlamaForCausalLM(T.LlamaConfig(
        **_SMALL, num_key_value_heads=2, max_position_embeddings=8, attn_implementation="eager", **rope))


MODELS = {
    "llama": (lambda: _llama(), "LlamaDecoderLayer"),
    # positions past max_position_embeddings=8: the rotary embedding rebinds inv_freq and sets
    # max_seq_len_cached on the first call (from the capture's input: the same on every later call)
    "llama dynamic rope": (lambda: _llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "LlamaDecoderLayer"),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **_SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        attn_implementation="eager", experts_implementation="eager")), "MixtralDecoderLayer"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), "GPT2Block"),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(
        **_SMALL, max_position_embeddings=64, attn_implementation="eager", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)), "BertLayer"),
}

CUTS = {
    "dp1 accumulation=2": lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
    "remat": sw.remat,
}


def _token_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the model's float64."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _step(model: str, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    build, unit = MODELS[model]
    torch.manual_seed(0)
    module = build().double()
    units = next(type(m) for m in module.modules() if type(m).__name__ == unit)
    chain, params = sw.functionalize(module, units=units, example_input=batch)
    return sw.train_step(chain, _token_loss, sw.optim.sgd(0.1)), params


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_hf_caches_set_from_the_input_are_not_refused(model: str, cut: str) -> None:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(64, (4, 12), generator=g)
        batches.append(({"input_ids": ids}, ids))
    step, params = _step(model, batches[0][0])
    reference, _ = _step(model, batches[0][0])
    # raises where the step is refused or differs from the one-device step
    sw.testing.assert_equivalent(CUTS[cut](step), reference, sw.Mesh(dp=1), batches, params)


def _batches(lengths: tuple[int, ...]) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [({"input_ids": ids}, ids) for ids in (torch.randint(64, (4, n), generator=g) for n in lengths)]


# Past max_position_embeddings=8: 12 grows inv_freq, a shorter length over 8 (10) after it neither
# grows nor resets and reads the grown one, a length under 8 after a growth resets it.
LENGTHS = [(6, 12, 6), (6, 12, 10), (12, 6, 12), (12, 10, 6, 10), (6, 12, 12, 10, 6, 10)]


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_dynamic_rope_keeps_its_rebound_inv_freq_as_torch(lengths: tuple[int, ...]) -> None:
    """The rotary embedding rebinds inv_freq on a growth and on a reset, and torch's loop keeps the
    new tensor for the calls after: the layer keeps it too (rope_state.py), so the one-device step
    equals torch's loop exactly (the same float64 computation, no reduction between). Before, a call
    that neither grew nor reset (10 after 12) read the captured inv_freq: 8e-7 off."""
    batches = _batches(lengths)
    step, params = _step("llama dynamic rope", batches[0][0])
    torch.manual_seed(0)
    model = MODELS["llama dynamic rope"][0]().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = step.init(params)
    for batch, ids in batches:
        state, metrics = step(state, (batch, ids))
        opt.zero_grad()
        loss = _token_loss(model(**batch), ids)
        loss.backward()
        opt.step()
        assert float(metrics["loss"]) == loss.item(), (ids.shape[1], float(metrics["loss"]), loss.item())


MESH_CUTS = {
    "dp1 accumulation=2": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2), lambda: sw.Mesh(dp=1)),
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", 3), lambda: sw.Mesh(dp=2)),
    "remat": (sw.remat, lambda: sw.Mesh(dp=1)),
    # the rotary embedding runs in the embed layer, on the first stage; its output goes down the pipe
    "pp2 1f1b 2 micro-batches": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), lambda: sw.Mesh(pp=2)),
}


@pytest.mark.parametrize("lengths", [(6, 12, 10), (12, 6, 12)], ids=str)
@pytest.mark.parametrize("cut", list(MESH_CUTS))
def test_dynamic_rope_across_lengths_equals_the_one_device_step(cut: str, lengths: tuple[int, ...]) -> None:
    """Each rank's copy of the rotary embedding sees the lengths one device sees (these cut rows, not
    the sequence) and keeps its rebound inv_freq; a second micro-batch or a recompute reads what the
    first call left, which gives the same frequencies. Before, the second micro-batch of a growing step
    read the captured inv_freq (accumulation=2 captured at 6, run at 12: 2e-7 off)."""
    batches = _batches(lengths)
    transform, mesh = MESH_CUTS[cut]
    step, params = _step("llama dynamic rope", batches[0][0])
    reference, _ = _step("llama dynamic rope", batches[0][0])
    sw.testing.assert_equivalent(transform(step), reference, mesh(), batches, params)


def _rows_of_other_positions(lengths: tuple[int, ...], padded: tuple[int, ...] = (0, 1)) -> list[Any]:
    """Rows ``padded`` positioned as left-padded rows (0 for the padding, then counting), the others from 0: rows 0
    and 1 are the first share of every cut of 4 rows in 2, rows 0 and 2 one of each share."""
    out = []
    for batch, ids in _batches(lengths):
        n = ids.shape[1]
        positions = torch.arange(n).repeat(4, 1)
        positions[list(padded)] = (torch.arange(n) - n // 2).clamp(min=0)
        out.append(({**batch, "position_ids": positions}, ids))
    return out


@pytest.mark.parametrize("cut", [c for c in MESH_CUTS if c != "remat"])
def test_dynamic_rope_on_rows_of_other_largest_positions_is_refused_where_the_rows_are_cut(cut: str) -> None:
    """Each share took its own rows' largest position where one device takes the batch's: one share scaled
    inv_freq, the other not (ZeRO-3 dp2 before: 4.2e-6 to 1.7e-5 relative in the first step's loss, Qwen3,
    no error). Rows of one largest position give every share the batch's: they pass, as one device does."""
    transform, mesh = MESH_CUTS[cut]
    batches = _rows_of_other_positions((12, 6))
    step, params = _step("llama dynamic rope", batches[0][0])
    reference, _ = _step("llama dynamic rope", batches[0][0])
    with pytest.raises((ValueError, sw.collectives.RankFailed),
                       match=r"model\.rotary_emb is a rotary embedding of rope_type 'dynamic', .* its original length "
                             r"\(8\), and the "
                             r"shares of batch\[0\]\['position_ids'\] reach different largest positions \(\[5, 11\], "
                             r"the batch 11\): this step cuts the batch"):
        sw.testing.assert_equivalent(transform(step), reference, mesh(), batches, params)
    # Every share reaches the batch's largest position (one padded row in each): they decide as one device.
    one_in_each = _rows_of_other_positions((12, 6), padded=(0, 2))
    sw.testing.assert_equivalent(transform(step), reference, mesh(), one_in_each, params)
    # Shorter than the original length (8): no share grows, each resets where one device does (review: refused
    # before, equivalent at 3.3e-16 once let through).
    short = _rows_of_other_positions((6, 7, 6))
    sw.testing.assert_equivalent(transform(step), reference, mesh(), short, params)


def test_dynamic_rope_on_rows_of_other_positions_trains_on_one_device_and_under_remat() -> None:
    batches = _rows_of_other_positions((12, 6))
    step, params = _step("llama dynamic rope", batches[0][0])
    reference, _ = _step("llama dynamic rope", batches[0][0])
    sw.testing.assert_equivalent(sw.remat(step), reference, sw.Mesh(dp=1), batches, params)


def test_dynamic_rope_whose_buffers_functional_call_swaps_is_refused_where_its_cache_moves() -> None:
    """Given both names of an aliased buffer, ModuleCall hands the call to functional_call, whose swap
    back drops a rebound inv_freq where the layer cannot keep it: a call within the original length
    runs, a growth is refused (a later call would read the captured frequencies)."""
    config = T.LlamaConfig(**_SMALL, max_position_embeddings=8, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    rope = T.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    rope.register_buffer("original_inv_freq", rope.inv_freq, persistent=False)  # an alias: two names, one tensor
    call = ModuleCall(rope)
    tensors = dict(rope.named_buffers(remove_duplicate=False))
    x = torch.zeros(1, 12, 32)
    cos, _ = call.call(tensors, (x, torch.arange(6)[None]), {})
    assert cos.shape == (1, 6, 16)
    with pytest.raises(ValueError, match=r"max_seq_len_cached': 8\} -> \{'max_seq_len_cached': 12\}.*functional_call"):
        call.call(tensors, (x, torch.arange(12)[None]), {})


def _phi3_longrope() -> Any:
    # original_max_position_embeddings is Phi3Config's own argument (4096 by default, which the rope
    # parameters take): 8 here, so the batches of 12 positions take the long frequencies.
    return T.Phi3ForCausalLM(T.Phi3Config(
        **_SMALL, num_key_value_heads=2, max_position_embeddings=16, original_max_position_embeddings=8,
        attn_implementation="eager", pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                         "long_factor": [3.0] * 8}))


MODELS["phi3 longrope"] = (_phi3_longrope, "Phi3DecoderLayer")


@pytest.mark.parametrize("lengths", [(6, 12, 6), (12, 10, 6, 12)], ids=str)
def test_longrope_overwriting_inv_freq_on_every_call_trains_as_torch(lengths: tuple[int, ...]) -> None:
    """Phi-3's longrope copies the long or the short frequencies into inv_freq in place on every call
    (``longrope_frequency_update``), by that call's largest position: nothing carries between calls. It
    was refused as a buffer written in forward; each call now writes a copy of its own, and the
    one-device step equals torch's loop exactly on lengths either side of the original 8."""
    batches = _batches(lengths)
    step, params = _step("phi3 longrope", batches[0][0])
    torch.manual_seed(0)
    model = _phi3_longrope().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rope = model.model.rotary_emb
    built = step.base_chain["embed"].buffers["model.rotary_emb.inv_freq"]
    # (the frequencies of the example functionalize ran, long or short: every call overwrites them)
    as_built, version = built.clone(), built._version
    state = step.init(params)
    for batch, ids in batches:
        state, metrics = step(state, (batch, ids))
        opt.zero_grad()
        loss = _token_loss(model(**batch), ids)
        assert torch.equal(rope.inv_freq, rope.long_inv_freq if ids.shape[1] > 8 else rope.original_inv_freq)
        loss.backward()
        opt.step()
        assert float(metrics["loss"]) == loss.item(), (ids.shape[1], float(metrics["loss"]), loss.item())
    # the layer's own buffer is as it was built (the writes went into each call's copy)
    assert torch.equal(built, as_built) and built._version == version


@pytest.mark.parametrize("cut", list(MESH_CUTS))
def test_longrope_across_lengths_equals_the_one_device_step(cut: str) -> None:
    batches = _batches((12, 6, 10))
    transform, mesh = MESH_CUTS[cut]
    step, params = _step("phi3 longrope", batches[0][0])
    reference, _ = _step("phi3 longrope", batches[0][0])
    sw.testing.assert_equivalent(transform(step), reference, mesh(), batches, params)


@pytest.mark.parametrize("cut", [c for c in MESH_CUTS if c != "remat"])
def test_longrope_on_shares_either_side_of_the_original_length_is_refused(cut: str) -> None:
    """One share's rows left-padded to positions below the original length took the short frequencies where one
    device, seeing the batch's largest position, takes the long ones (ZeRO-3 dp2: 6.7e-6 relative in the first
    loss, no error, once the write was let through). Shares of different largest positions on the same side of
    it decide as one device does and pass."""
    transform, mesh = MESH_CUTS[cut]
    batches = _rows_of_other_positions((12, 6))  # rows 0, 1 reach 5 (short), rows 2, 3 reach 11 (long)
    step, params = _step("phi3 longrope", batches[0][0])
    reference, _ = _step("phi3 longrope", batches[0][0])
    with pytest.raises((ValueError, sw.collectives.RankFailed),
                       match=r"model\.rotary_emb is a rotary embedding of rope_type 'longrope', which picks long or "
                             r"short frequencies .* its original length \(8\), and the shares of "
                             r"batch\[0\]\['position_ids'\] reach different largest positions \(\[5, 11\], "
                             r"the batch 11\): this step cuts the batch"):
        sw.testing.assert_equivalent(transform(step), reference, mesh(), batches, params)
    # 16 positions, rows 0 and 1 reaching 11, the others 15: both past 8, both long, as one device
    both_long = _rows_of_other_positions((16, 16))
    for batch, _ in both_long:
        batch["position_ids"][:2] = torch.arange(16).clamp(max=11)
    sw.testing.assert_equivalent(transform(step), reference, mesh(), both_long, params)
