"""sw.context_parallel on an unmodified Hugging Face Llama trained on padded and packed batches: equal to
the single-device step, the Plan's collectives what runs, and what it cannot do refused with the fix.

A batch is ``({"input_ids", "attention_mask"[, "position_ids"]}, targets)``: the layer that reads it
all-gathers the rank's part of the padding mask (or of the position ids) and sends the whole
sequence's TokenMask to every attention in the mask's place. float64 on thread ranks; results agree
to rounding (assert_equivalent's float64 default). Padded targets are -100 and the loss a mean over
counted tokens (``tokens=``), so ranks holding different counts still make the global mean.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ = 32, 16
PACKED = torch.tensor([
    [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7],
    [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2],
])


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def counted(inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return (targets != -100).sum()


def data(kind: str) -> list[tuple[dict[str, Any], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        inputs: dict[str, Any] = {"input_ids": ids[:, :-1]}
        targets = ids[:, 1:].clone()  # shifted on the whole sequence, before the cut
        if kind == "packed":
            inputs.update(attention_mask=None, position_ids=PACKED)  # transformers reads the documents from these
        else:
            mask = torch.ones(2, SEQ, dtype=torch.long)
            if kind == "left":
                mask[0, :5], mask[1, :3] = 0, 0
            else:
                mask[0, 11:], mask[1, 13:] = 0, 0
            inputs["attention_mask"] = mask
            targets[mask == 0] = -100
        out.append((inputs, targets))
    return out


def llama(kind: str, **config: Any) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0, **config,
    )
    batches = data(kind)
    chain, params = sw.functionalize(T.LlamaForCausalLM(cfg).double(),
                                     units=T.models.llama.modeling_llama.LlamaDecoderLayer, example_input=batches[0][0])
    return sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9), tokens=counted), params, batches


@pytest.mark.parametrize(("kind", "attention", "cp"), [
    ("left", "ring", 4), ("right", "ring", 2), ("packed", "ring", 2), ("left", "ulysses", 2), ("packed", "ulysses", 2),
])
def test_padded_and_packed_batches_equal_the_single_device_step(kind: str, attention: str, cp: int) -> None:
    step, params, batches = llama(kind)
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp", attention=attention), step, sw.Mesh(cp=cp), batches,
                                 params)


def test_the_mask_is_gathered_once_and_the_ledger_equals_the_plan() -> None:
    step, params, batches = llama("left")
    cp, mesh = sw.shard_params(sw.context_parallel(step, "cp"), "dp", 1), sw.Mesh(dp=2, cp=2)
    batch = (
        {k: torch.cat([v, v]) for k, v in batches[0][0].items()}, torch.cat([batches[0][1], batches[0][1]]),
    )
    plan = cp.plan(mesh, params, batch)
    gathers = [c for c in plan.collectives(0) if c.axis == "cp" and c.op == "all_gather" and "uint8" in str(c.dtype)]
    # One all-gather of the rank's [2, 8] part of the padding mask (uint8) a step: 16 bytes to the other rank.
    assert [c.nbytes for c in gathers] == [2 * (SEQ // 2)]

    def run() -> list[tuple[str, str, str, int]]:
        state = cp.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            cp(state, batch)
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    for rank, got in enumerate(sw.launch(run, mesh.size, timeout=120)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"


def refused(step: sw.Step, params: Any, batch: Any, match: str) -> None:
    cp = sw.context_parallel(step, "cp")
    with pytest.raises(Exception, match=match):
        sw.launch(lambda: cp(cp.init(params, sw.Mesh(cp=2)), batch), 2, timeout=120)


def test_labels_in_the_batch_dict_are_refused() -> None:
    """transformers would shift them inside each rank's part: a wrong target at every chunk's end."""
    step, params, batches = llama("left")
    inputs, targets = batches[0]
    refused(step, params, ({**inputs, "labels": targets}, targets), r"labels, which the model would shift")
    # With shift_labels too (how transformers' own context parallel passes them), the model's loss over a part
    # is still not split: refused, the message saying so rather than an unknown op's refusal in its head.
    refused(step, params, ({**inputs, "labels": targets, "shift_labels": targets}, targets),
            r"labels, which the model would shift.*with shift_labels in the batch too: the model's own loss")


def test_labels_one_per_sequence_are_refused_as_a_loss_it_does_not_split() -> None:
    """A sequence classifier's labels (one per sequence) were refused with the advice to shift them on the
    whole sequence, which does not apply: its loss is pooled from one token, which context parallel does not
    split; the refusal says so."""
    step, params, batches = llama("left")
    inputs, targets = batches[0]
    labels = torch.zeros(inputs["input_ids"].shape[0], dtype=torch.long)
    with pytest.raises(ValueError, match=r"labels of shape \[2\], not one per token.*a loss per sequence.*leave "
                                         r"context_parallel out") as info:
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, ({**inputs, "labels": labels}, targets))
    assert "shift" not in str(info.value)


def test_position_ids_without_an_attention_mask_entry_are_refused_with_the_fix() -> None:
    step, params, _ = llama("left")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    batch = ({"input_ids": ids, "position_ids": PACKED}, ids)
    with pytest.raises(ValueError, match=r"add 'attention_mask': None to the batch dict"):
        sw.context_parallel(step, "cp").plan(sw.Mesh(cp=2), params, batch)


def test_a_four_dimensional_mask_is_refused() -> None:
    step, params, batches = llama("left")
    inputs, targets = batches[0]
    mask = torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool).tril()
    refused(step, params, ({**inputs, "attention_mask": mask}, targets), r"4-D mask of its own cannot be cut")


def test_sliding_window_attention_shorter_than_the_sequence_is_refused() -> None:
    step, params, batches = llama("left", sliding_window=4)
    refused(step, params, batches[0], r"sliding-window attention \(config.sliding_window=4")


@pytest.mark.parametrize("family", ["Mistral", "Qwen2", "Mistral given layer_types"])
def test_a_sliding_window_between_a_part_and_the_sequence_is_refused_without_a_mask(family: str) -> None:
    """A window of 12 over 16 tokens cut in two parts of 8: each rank's part fits in the window, so the model
    makes no mask, and the ring attended over every earlier key: another model without an error (the loss
    differed from the single device's by 1e-4 relative). Refused, with or without a mask in the batch."""
    torch.manual_seed(0)
    extra: dict[str, Any] = {"use_sliding_window": True, "max_window_layers": 0} if family == "Qwen2" else {}
    if family == "Mistral given layer_types":  # Mistral's modeling ignores them (it warns) and windows every layer
        family, extra = "Mistral", {"layer_types": ["full_attention"]}
    cfg = getattr(T, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0, sliding_window=12, **extra,
    )
    ids = torch.randint(0, VOCAB, (2, SEQ + 1))
    layer = getattr(getattr(T.models, family.lower()), f"modeling_{family.lower()}")
    chain, params = sw.functionalize(getattr(T, f"{family}ForCausalLM")(cfg).double(),
                                     units=getattr(layer, f"{family}DecoderLayer"), example_input=ids[:, :-1])
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    refused(step, params, (ids[:, :-1], ids[:, 1:]), r"sliding-window attention \(config.sliding_window=12")


def test_qwen2_moe_full_attention_layers_are_not_read_as_a_window() -> None:
    """Qwen2-MoE without sliding windows (its default, and real checkpoints') stores config.sliding_window = 0
    and gives its full-attention layers no window attribute: every unmodified Qwen2-MoE was refused as
    sliding-window attention; its layer_types say every layer attends to every earlier token."""
    torch.manual_seed(0)
    cfg = T.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ, attn_implementation="sdpa",
        experts_implementation="eager",  # float64: grouped_mm takes float32 and below
        bos_token_id=0, eos_token_id=0,
    )
    assert cfg.sliding_window == 0 and set(cfg.layer_types) == {"full_attention"}
    ids = torch.randint(0, VOCAB, (2, 2, SEQ + 1))
    batches = [(x[:, :-1], x[:, 1:]) for x in ids]
    layer = T.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeDecoderLayer
    chain, params = sw.functionalize(T.Qwen2MoeForCausalLM(cfg).double(), units=layer, example_input=batches[0][0])
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1, momentum=0.9))
    sw.testing.assert_equivalent(sw.context_parallel(step, "cp"), step, sw.Mesh(cp=2), batches, params)
