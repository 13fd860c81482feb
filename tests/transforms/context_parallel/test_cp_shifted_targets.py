"""Targets a loss shifts by one itself: under context_parallel it shifts inside each rank's part.

A Llama trained on ``(ids, ids)`` with transformers' ``ForCausalLMLoss`` (``model.loss_function``, which
shifts the labels) was right on one device; under context_parallel each rank shifted within its own part,
pairing tokens across the cut and losing the boundary targets, without an error (loss off by 2e-3
relative at cp 2). Refused now: such a loss when context_parallel is applied, and targets that are the
input ids themselves when the batch is cut. Targets shifted on the whole sequence pass, and equal the
single-device step.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.testing.models import Block, TinyGPT

try:
    import transformers as T
except ImportError:  # the [hf] extra is not installed
    T = None
needs_hf = pytest.mark.skipif(T is None, reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ = 32, 16
SHIFTS = (r"(shifts the labels|must shift them) by one itself.*inside each rank's part.*Shift on the whole sequence "
          r"before the step")


def tiny_gpt() -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=2, seq_len=SEQ).double()
    chain, params = sw.functionalize(model, units=Block)
    return sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1, momentum=0.9)), params


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def ids(seed: int = 1, length: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("how", ["same", "equal"])
def test_targets_that_are_the_inputs_are_refused(how: str) -> None:
    """A loss of one's own that shifts (logits[:, :-1] against targets[:, 1:]) is right on such a batch on one
    device and shifts inside each part under cp: the batch is refused, at the Plan and at the step."""
    step, params = tiny_gpt()
    tokens = ids()
    batch = (tokens, tokens if how == "same" else tokens.clone())
    cp = sw.context_parallel(step, "cp")
    message = rf"targets {'are the very tensor' if how == 'same' else 'equal'} inputs, .*{SHIFTS}"
    with pytest.raises(ValueError, match=message):
        cp.plan(sw.Mesh(cp=2), params, batch)
    with pytest.raises(sw.collectives.RankFailed, match=message):
        sw.testing.assert_equivalent(cp, step, sw.Mesh(cp=2), [batch], params)


def test_targets_equal_to_a_batch_dicts_input_ids_are_refused() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=4, n_layers=1, seq_len=SEQ).double()

    class ByDict(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = model

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.gpt(batch["input_ids"])

    tokens = ids()
    chain, params = sw.functionalize(ByDict(), example_input={"input_ids": tokens})
    step = sw.train_step(chain, next_token_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=rf"targets equal inputs\['input_ids'\], .*{SHIFTS}"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, ({"input_ids": tokens}, tokens.clone()))


def test_targets_handed_to_the_model_as_an_input_are_not_taken_for_its_token_ids() -> None:
    """nanoGPT computes its loss in forward from ``targets`` it is given beside ``idx``: the batch
    ``({"idx": x, "targets": y}, y)``, y shifted on the whole sequence, was refused as targets that "are the very
    tensor inputs['targets']", sent to shift what was shifted. The token ids are what targets are compared with."""
    from shardwise.transforms.context_parallel.shifted import refuse_targets_equal_to_inputs

    tokens = ids()
    x, y = tokens[:, :-1], tokens[:, 1:]
    refuse_targets_equal_to_inputs(({"idx": x, "targets": y}, y), 1)  # passes
    with pytest.raises(ValueError, match=r"targets are the very tensor inputs\['idx'\]"):
        refuse_targets_equal_to_inputs(({"idx": x, "targets": x}, x), 1)


def test_targets_shifted_on_the_whole_sequence_pass_even_where_they_equal_the_inputs() -> None:
    """A sequence of one token throughout equals its own shift: such targets are right, and not refused."""
    step, params = tiny_gpt()
    tokens = ids(length=SEQ + 1)
    tokens[1] = 3
    batches = [(tokens[:, :-1], tokens[:, 1:]), (torch.full((2, SEQ), 5), torch.full((2, SEQ), 5))]
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params)


def llama(loss: Any) -> tuple[sw.Step, Any, Any]:
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0,
    )
    model = T.LlamaForCausalLM(cfg).double()
    chain, params = sw.functionalize(model, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                     example_input=ids())
    return sw.train_step(chain, loss(model), sw.optim.sgd(0.1, momentum=0.9)), params, model


def _in_a_function(model: Any) -> Any:
    def loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
        return T.loss.loss_utils.ForCausalLMLoss(out.logits, labels, VOCAB)

    return loss


LOSSES = {
    "the model's loss_function": lambda model: lambda out, labels: model.loss_function(out.logits, labels, VOCAB),
    "a function calling ForCausalLMLoss": _in_a_function,
    "a partial of it": lambda model: functools.partial(T.loss.loss_utils.ForCausalLMLoss, vocab_size=VOCAB),
}


@needs_hf
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_loss_that_shifts_the_labels_itself_is_refused(loss: str) -> None:
    step, _, _ = llama(LOSSES[loss])
    with pytest.raises(ValueError, match=rf"loss_fn .* (is|calls) transformers' ForCausalLMLoss .*{SHIFTS}"):
        sw.context_parallel(step, "cp")
    with pytest.raises(ValueError, match=r"(is|calls) transformers' ForCausalLMLoss"):  # inside tensor_parallel's
        sw.context_parallel(sw.tensor_parallel(step, "tp", sw.tp.llama_plan()), "cp")


@needs_hf
def test_for_causal_lm_loss_given_shifted_labels_equals_the_single_device_step() -> None:
    """ForCausalLMLoss with shift_labels= shifts nothing: the targets, shifted on the whole sequence, pass. It
    computes in float32 (it upcasts the logits), whose rounding the tolerance allows."""

    def shifted(model: Any) -> Any:
        return lambda out, targets: model.loss_function(out.logits, None, VOCAB, shift_labels=targets.contiguous())

    step, params, _ = llama(shifted)
    tokens = ids(length=SEQ + 1)
    batches = [(tokens[:, :-1], tokens[:, 1:])] * 2
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params, rtol=1e-6)
