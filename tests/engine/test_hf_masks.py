"""transformers' mask decisions on a meta build's fake recording made as on real tensors (engine/model/hf_masks.py).

A meta-built encoder-decoder under a pipeline was refused on its first step ("the Plan predicted ... (2, 1, 8, 8)
torch.bool ... Give functionalize an example_input like your batches", though the example was the batch): the
decoder's causal mask, made after the first unit on fake tensors, which transformers takes for tracing, was
recorded where the real run leaves None. The private helper this relies on is checked first, loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.model.hf_masks import mask_decisions_as_at_run_time

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_transformers_still_asks_is_tracing_and_the_block_makes_it_blind_to_fake_tensors() -> None:
    """transformers' private helper: if this fails, transformers changed how it decides to leave a mask out."""
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert callable(masking.is_tracing)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(2, 4, dtype=torch.bool))
    assert masking.is_tracing(fake)  # transformers' own answer: a fake tensor is traced
    with mask_decisions_as_at_run_time():
        assert not masking.is_tracing(fake) and not masking.is_tracing(torch.ones(1))
    assert masking.is_tracing(fake)  # only inside the block


class Logits(nn.Module):
    """BART wrapped to return its logits (so that it splits per layer), as the guide wraps it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, attention_mask=attention_mask).logits


def _bart() -> Any:
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=48, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, use_cache=False,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.fixture(autouse=True)
def float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_a_meta_built_encoder_decoder_trains_under_a_pipeline_as_torch_does(padded: bool) -> None:
    ids = torch.randint(3, 48, (4, 8), generator=torch.Generator().manual_seed(1))
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "labels": ids}
    if padded:  # a padded row in each micro-batch of two
        mask = torch.ones(4, 8, dtype=torch.long)
        mask[0, 6:] = mask[2, 5:] = 0
        inputs["attention_mask"] = mask
    torch.manual_seed(0)
    reference = Logits(_bart())
    with torch.device("meta"):
        empty = Logits(_bart())
    units = (T.models.bart.modeling_bart.BartEncoderLayer, T.models.bart.modeling_bart.BartDecoderLayer)
    chain, _ = sw.functionalize(empty, units=units, example_input=inputs)
    step = sw.pipeline(sw.train_step(chain, _loss, sw.optim.sgd(0.1)), "pp", "1f1b", 2)
    start = reference.state_dict()

    def rank() -> float:
        state = sw.checkpoint.init_from_state_dict(step, start, sw.Mesh(pp=2))
        return float(step(state, (inputs, ids))[1]["loss"])

    losses = sw.launch(rank, 2)
    want = _loss(reference(**inputs), ids).item()
    assert losses[0] == losses[1] == pytest.approx(want, rel=1e-12)
