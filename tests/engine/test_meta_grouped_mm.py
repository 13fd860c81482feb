"""Hugging Face mixtures of experts built on the meta device functionalize on an example, and train.

``functionalize`` runs a meta-built model on stand-in parameters, one zero each expanded to its
shape (no memory). transformers' Mixtral and Qwen2-MoE call ``torch._grouped_mm`` by default, whose
real and fake kernels refuse a stride of 0: with an example input (and with units, which record on
one) the split fell over with torch's "Invalid strides/sizes". Such a kernel now runs on a dense copy
of its stand-ins, made for that op only (``engine/torch_api.py``, ``dense_where_refused``), so the
memory stays one layer's (tests/engine/test_functionalize_memory.py measures it).

float32: grouped_mm has no float64 kernel, so the training checks use assert_equivalent's float32
tolerance (two steps of the sharded step against the single-device step from the same meta params).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB = 32
COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0)


def mixtral() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    return T.MixtralForCausalLM(cfg), T.models.mixtral.modeling_mixtral.MixtralDecoderLayer


def qwen2_moe() -> tuple[nn.Module, type[nn.Module]]:
    cfg = T.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=24)
    return T.Qwen2MoeForCausalLM(cfg), T.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeDecoderLayer


def llama() -> tuple[nn.Module, type[nn.Module]]:  # dense: no grouped_mm, and unchanged
    return T.LlamaForCausalLM(T.LlamaConfig(**COMMON)), T.models.llama.modeling_llama.LlamaDecoderLayer


FAMILIES: dict[str, Callable[[], tuple[nn.Module, type[nn.Module]]]] = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "llama": llama,
}


def batches() -> list[tuple[Tensor, Tensor]]:
    ids = torch.randint(VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
    return [(ids[:, :-1], ids[:, 1:])] * 2


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def meta_built(family: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, type[nn.Module]]:
    with torch.device("meta"):
        model, unit = FAMILIES[family]()
    model = model.to(dtype)
    if family != "llama" and getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        pytest.skip("this transformers does not call grouped_mm by default")
    return model, unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("split", ["whole", "per block"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_meta_built_hf_model_functionalizes_on_an_example(family: str, split: str, dtype: torch.dtype) -> None:
    model, unit = meta_built(family, dtype)
    chain, params = sw.functionalize(model, units=unit if split == "per block" else None,
                                     example_input=batches()[0][0])
    assert chain.names == (("embed", "model.layers.0", "model.layers.1", "head") if split == "per block"
                           else ("model",))
    assert all(t.is_meta and t.dtype == dtype for layer in params.values() for t in layer.values())
    assert any(t.dim() == 3 for layer in params.values() for t in layer.values()) == (family != "llama")


STACKS: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", stage=3), sw.Mesh(dp=2)),
    "ep2": (lambda s: sw.expert_parallel(s, "ep"), sw.Mesh(ep=2)),
}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_meta_built_hf_moe_is_made_by_shard_and_trains_as_on_one_device(family: str, stack: str) -> None:
    model, unit = meta_built(family)
    data = batches()
    chain, meta_params = sw.functionalize(model, units=unit, example_input=data[0][0])
    one_device = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    transform, mesh = STACKS[stack]
    step = transform(one_device)

    def full() -> Any:
        return step.full_params(step.init(meta_params, mesh, seed=0))

    reference = one_device.init(meta_params, seed=0).params
    for made in sw.launch(full, world=mesh.size):
        assert all(torch.equal(made[k][n], reference[k][n]) for k in reference for n in reference[k])
    assert sw.testing.assert_equivalent(step, one_device, mesh, data, meta_params).steps == 2
