"""sw.context_parallel on an unmodified Hugging Face Llama: sdpa attention over the whole sequence,
rotary embeddings at the rank's global positions, equal to the single-device step; the Plan's
collectives are what runs; an attention it cannot split is refused by name.

float64 on thread ranks; results agree to rounding (assert_equivalent's float64 default).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ = 32, 16


def llama(attn_implementation: str = "sdpa") -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, attn_implementation=attn_implementation,
        bos_token_id=0, eos_token_id=0,
    )
    model = T.LlamaForCausalLM(cfg).double()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        batches.append((ids[:, :-1], ids[:, 1:]))  # shifted on the whole sequence, before the cut
    chain, params = sw.functionalize(model, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                     example_input=batches[0][0])
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_llama_over_cp_equals_the_single_device_step(attention: str) -> None:
    step, params, batches = llama()
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp", attention=attention), step, sw.Mesh(cp=2), batches,
                                 params)


def test_llama_over_dp_by_cp_with_zero_equals_the_single_device_step() -> None:
    step, params, batches = llama()
    composed = sw.shard_params(sw.context_parallel(step, "cp"), "dp", 3)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, cp=2), batches, params)


def test_llama_issues_exactly_the_collectives_its_plan_lists() -> None:
    step, params, batches = llama()
    cp, mesh = sw.context_parallel(step, "cp"), sw.Mesh(cp=2)
    plan = cp.plan(mesh, params, batches[0])
    assert sum(c.op == "ppermute" for c in plan.collectives(0)) == 2 * 2  # 2 layers x (cp - 1) x forward, backward

    def run() -> list[tuple[str, str, str, int]]:
        state = cp.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            cp(state, batches[0])
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    for rank, got in enumerate(sw.launch(run, mesh.size, timeout=120)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"


def test_eager_attention_is_refused_with_the_fix() -> None:
    step, _, _ = llama("eager")
    with pytest.raises(ValueError, match=r"self_attn \(LlamaAttention\) runs attn_implementation='eager'.*'sdpa'"):
        sw.context_parallel(step, "cp")


def _per_layer(family: str, **extra: Any) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    config = getattr(T, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, max_position_embeddings=2 * SEQ, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0, **extra,
    )
    model = getattr(T, f"{family}ForCausalLM")(config).double()
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # norms initialized to ones would hide a norm left out less well
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5, generator=gen)
    module = {"Qwen3Moe": "qwen3_moe"}.get(family, family.lower())
    layer = getattr(getattr(T.models, module), f"modeling_{module}")
    batches = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        batches.append((ids[:, :-1], ids[:, 1:]))
    chain, params = sw.functionalize(model, units=getattr(layer, f"{family}DecoderLayer"), example_input=batches[0][0])
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


@pytest.mark.parametrize("family", ["Granite", "Gemma"])
def test_an_attention_whose_forward_is_llamas_line_for_line_equals_the_single_device_step(family: str) -> None:
    """Granite's (its scaling the config's attention_multiplier) and Gemma's attention forwards are Llama's
    line for line; the rest of their layers (Granite's residual multiplier, Gemma's scaled embeddings) is per
    token. A scale other than 1/sqrt(head_dim) shows that the installed forward reads the module's own."""
    extra = {"attention_multiplier": 0.3, "residual_multiplier": 0.7, "embedding_multiplier": 2.0,
             "logits_scaling": 1.5} if family == "Granite" else {}
    step, params, batches = _per_layer(family, **extra)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params)


@pytest.mark.parametrize("family", ["Glm4", "Ernie4_5"])
def test_another_models_copy_of_a_verified_attention_is_split_by_its_code(family: str) -> None:
    """GLM-4's and ERNIE 4.5's attentions are classes of their own whose forward is Llama's line for line
    (Hugging Face's "Copied from"): recognised by their code (engine/model/reproduced.py's same_code), not by
    a list of names. GLM-4 rotates half of each head, interleaved, by its module's own apply_rotary_pos_emb,
    which the installed forward calls."""
    step, params, batches = _per_layer(family, pad_token_id=1)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params)


@pytest.mark.parametrize(("family", "stack"), [("Qwen3", "ring"), ("Qwen3", "ulysses"), ("Qwen3", "dp x cp zero3"),
                                                ("Qwen3Moe", "ring")])
def test_qwen3s_attention_with_its_per_head_norms_equals_the_single_device_step(family: str, stack: str) -> None:
    """Qwen3's q_norm and k_norm normalize each head of q and of k before the rotary embedding: on the rank's
    tokens, as the rest of the projections (they were refused before, as OLMo-2's were)."""
    extra = {"moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
             "experts_implementation": "eager"} if family == "Qwen3Moe" else {}  # grouped_mm: no float64
    step, params, batches = _per_layer(family, **extra)
    cp, mesh = sw.context_parallel(step, "cp", attention="ulysses" if stack == "ulysses" else "ring"), sw.Mesh(cp=2)
    if stack == "dp x cp zero3":
        cp, mesh = sw.shard_params(cp, "dp", 3), sw.Mesh(dp=2, cp=2)
    sw.testing.assert_equivalent(cp, step, mesh, batches, params)


def test_a_rotary_embedding_whose_frequencies_follow_the_sequence_length_is_refused() -> None:
    """Dynamic NTK rope recomputes its frequencies from the largest position a call sees, and keeps them:
    each rank sees only its part's, so ranks rotated by other frequencies than the single device (the loss
    differed by 4e-8 relative, with an example input shorter than the batches). Refused."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ // 2, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    chain, _ = sw.functionalize(T.LlamaForCausalLM(cfg).double(), units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                example_input=torch.randint(0, VOCAB, (2, SEQ)))
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"rotary_emb \(LlamaRotaryEmbedding\) is rope_type 'dynamic'"):
        sw.context_parallel(step, "cp")


def _with_attention_class(cls_of: Any) -> sw.Step:
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0,
    )
    model = T.LlamaForCausalLM(cfg).double()
    for layer in model.model.layers:
        layer.self_attn.__class__ = cls_of(type(layer.self_attn))
    chain, _ = sw.functionalize(model, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                example_input=torch.randint(0, VOCAB, (2, SEQ)))
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))


def _scaled(base: type) -> type:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out, weights = base.forward(self, *args, **kwargs)
        return 0.5 * out, weights  # what the user's forward adds, which the installed forward would drop

    return type("ScaledLlamaAttention", (base,), {"forward": forward})


@pytest.mark.parametrize(
    "cls_of",
    [_scaled, lambda base: type("LlamaAttention", (base,), {"forward": _scaled(base).forward, "__module__": __name__})],
    ids=["subclass_overriding_forward", "same_name_copy"],
)
def test_an_hf_attention_whose_forward_is_not_a_verified_one_is_refused(cls_of: Any) -> None:
    """context_parallel installs a Llama-shaped forward in place of the attention's: a forward that does more
    in its own code (here a scale; in other families a soft cap of the scores, another scaling) would be left
    out without an error. Only the attentions checked equal to the installed forward are split; the rest are
    refused, naming the class and where it is defined."""
    step = _with_attention_class(cls_of)
    with pytest.raises(ValueError, match=r"whose forward is not one context_parallel has checked"):
        sw.context_parallel(step, "cp")


def test_a_subclass_keeping_the_verified_forward_is_split() -> None:
    step = _with_attention_class(lambda base: type("MyLlamaAttention", (base,), {}))
    sw.context_parallel(step, "cp")  # accepted: the forward is LlamaAttention's own
