"""A Hugging Face layer known to read other rows of its batch for a token's output (Doge's mixture of experts)
under the transforms that cut the batch.

``DogeCDMoE`` views its router's logits ``(batch, seq, 2 * keys)`` as ``(2, batch * seq, keys)``: each token
is routed with a token of the batch's other half. Under data parallel or a pipeline's micro-batches each part
of the batch routed its tokens with other partners: the first loss differed from the single-device step's by
9e-5 (relative), without an error. It is refused where the batch is cut, naming the module and why; where every
rank computes on the whole batch (a pipeline of one micro-batch) it is the single-device step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
from transformers.models.doge.modeling_doge import DogeDecoderLayer  # noqa: E402

VOCAB = 32


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _doge(is_moe: bool) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    config = T.DogeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, is_moe=is_moe,
                          num_experts=16, num_experts_per_tok=2, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (4, 8), generator=gen), torch.randint(0, VOCAB, (4, 8), generator=gen))
               for _ in range(2)]
    chain, params = sw.functionalize(T.DogeForCausalLM(config).double(), units=DogeDecoderLayer,
                                     example_input=batches[0][0])
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


@pytest.mark.parametrize(("cut", "words"), [
    (lambda s: sw.shard_params(s, "dp", 3), r"shard_params \(data parallel over axis 'dp'\)"),
    (lambda s: sw.pipeline(s, "pp", "1f1b", microbatches=2), r"pipeline with 2 micro-batches"),
    (lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
     r"shard_params \(data parallel over axis 'dp', accumulation=2\)"),
])
def test_a_router_reading_other_rows_is_refused_where_the_batch_is_cut(cut: Any, words: str) -> None:
    step, _, _ = _doge(is_moe=True)
    with pytest.raises(ValueError, match=(
            r"'model.layers.0.mlp' \(DogeCDMoE: its router's logits are viewed as \(2, batch \* seq, keys\).*"
            rf"Under {words} each rank \(or micro-batch\) calls the model on a part of the batch.*"
            r"Run it without cutting the batch")):
        cut(step)


def test_doge_moe_on_the_whole_batch_and_dense_doge_cut_are_the_single_device_step() -> None:
    step, params, batches = _doge(is_moe=True)
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", microbatches=1), step, sw.Mesh(pp=2), batches,
                                 params)
    dense, params, batches = _doge(is_moe=False)
    sw.testing.assert_equivalent(sw.shard_params(dense, "dp", 3), dense, sw.Mesh(dp=2), batches, params)
