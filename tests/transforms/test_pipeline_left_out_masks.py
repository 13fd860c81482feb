"""A pipeline's transfers follow the micro-batches it runs, not functionalize's example.

BERT-style eager attention masks (BERT, ELECTRA) are None for a batch without a padded row. The Plan predicts
what each stage passes on by running the chain on fake tensors, which cannot read the mask, so it followed the
example: functionalized on an unpadded example and trained on padded batches (or the reverse) the pipeline was
refused, and so were micro-batches padded differently within a step. Under ``pipeline(follow_batches=True)``
the first layer also runs on each real micro-batch with fake parameters (engine/plan/predict.py:
first_output), so each micro-batch's boundaries are predicted as it runs, and the Plan lists what each rank's
own micro-batches send. Each case trains as the single-device step (float64, assert_equivalent's default), and
the collectives one step issues on every rank are the Plan's (op, axis, dtype, bytes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, SEQ, BATCH = 64, 8, 4
TINY = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 16, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0, "attn_implementation": "eager"}


def bert() -> tuple[nn.Module, type[nn.Module]]:
    return T.BertForMaskedLM(T.BertConfig(**TINY)), T.models.bert.modeling_bert.BertLayer


def electra() -> tuple[nn.Module, type[nn.Module]]:
    model = T.ElectraForMaskedLM(T.ElectraConfig(embedding_size=8, **TINY))
    return model, T.models.electra.modeling_electra.ElectraLayer


FAMILIES = {"bert": bert, "electra": electra}


def batches(padded_rows: list[list[int]], rows: int = BATCH) -> list[tuple[dict[str, Tensor], Tensor]]:
    """One batch per entry, right-padded (mask 0, target -100) in the rows listed; with 2 micro-batches of
    a 4-row batch, rows 0-1 are micro-batch 0 and rows 2-3 micro-batch 1."""
    g = torch.Generator().manual_seed(3)
    out = []
    for padded in padded_rows:
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[padded, SEQ - 3:] = 0
        out.append(({"input_ids": ids, "attention_mask": mask}, targets.masked_fill(mask == 0, -100)))
    return out


def loss(out: Any, targets: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def counted(inputs: Any, targets: Tensor) -> Tensor:
    return (targets != -100).sum()


def step_of(family: str, example: dict[str, Tensor]) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    model, block = FAMILIES[family]()
    chain, params = sw.functionalize(model.double(), units=block, example_input=example)
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9), tokens=counted), params


UNPADDED, PADDED, MIXED = [], [0, 2], [0]  # MIXED: micro-batch 0 padded, micro-batch 1 not
MASK_BYTES = 2 * SEQ * SEQ * 8  # a 2-row micro-batch's eager mask, (2, 1, 8, 8) float64


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_batches_after_an_unpadded_example_train_as_one_device(family: str, schedule: str) -> None:
    """The example leaves the mask out, every batch has one (a padded row in each micro-batch): refused
    before ("the Plan predicted ... None"), now the single-device step, and the Plan is what runs."""
    data = batches([PADDED, PADDED])
    step, params = step_of(family, batches([UNPADDED])[0][0])
    piped = sw.pipeline(step, "pp", schedule, microbatches=2, follow_batches=True)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), data, params)
    plan = sw.testing.assert_plan_is_run(piped, sw.Mesh(pp=2), params, data[0])
    assert MASK_BYTES in {c.nbytes for c in plan.collectives(0) if c.op == "send"}  # the masks cross, as planned


def test_without_follow_batches_a_micro_batch_unlike_the_example_is_refused_naming_the_option() -> None:
    """By default nothing runs on the real micro-batches (that costs a first layer per micro-batch and
    step): padded batches after an unpadded example are refused, naming the example and follow_batches."""
    data = batches([PADDED])
    step, params = step_of("bert", batches([UNPADDED])[0][0])
    piped = sw.pipeline(step, "pp", "1f1b", microbatches=2)
    with pytest.raises(sw.collectives.RankFailed, match=r"micro-batch 0,.*has one where the example had none"
                                                        r".*example_input like your batches.*follow_batches=True"):
        sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), data, params)


def test_follow_batches_is_a_bool() -> None:
    step, _ = step_of("bert", batches([UNPADDED])[0][0])
    with pytest.raises(TypeError, match=r"pipeline\(follow_batches='yes'\): True or False"):
        sw.pipeline(step, "pp", "1f1b", microbatches=2, follow_batches="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unpadded_batches_after_a_padded_example_train_as_one_device(family: str) -> None:
    data = batches([UNPADDED, UNPADDED])
    step, params = step_of(family, batches([PADDED])[0][0])
    piped = sw.pipeline(step, "pp", "1f1b", microbatches=2, follow_batches=True)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), data, params)
    sw.testing.assert_plan_is_run(piped, sw.Mesh(pp=2), params, data[0])


def test_micro_batches_padded_differently_in_one_step_train_as_one_device() -> None:
    """One micro-batch with a mask, the next without, in one step and across steps: each micro-batch's
    transfers are predicted on it (they were refused: "every micro-batch must pass on the same
    structure"), and its Plan lists each micro-batch's bytes."""
    data = batches([MIXED, UNPADDED, PADDED, [2]])
    step, params = step_of("bert", batches([UNPADDED])[0][0])
    piped = sw.pipeline(step, "pp", "1f1b", microbatches=2, poison=True, follow_batches=True)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), data, params)
    plan = sw.testing.assert_plan_is_run(piped, sw.Mesh(pp=2), params, data[0])
    carried = {a.microbatch: [w.nbytes for w in a.wire] for a in plan.for_rank(0) if a.kind == "send_activation"}
    assert MASK_BYTES in carried[0] and MASK_BYTES not in carried[1]


def test_pipeline_replicas_holding_differently_padded_shares_each_send_their_own() -> None:
    """ZeRO-1 over dp=2 x a pp=2 pipeline: replica 0's rows are padded, replica 1's are not, so their first
    stages send other bytes. The Plan tells these ranks apart (it shared one prediction per pipeline
    index), and every rank issues what it lists."""
    data = batches([[0, 2], [5]], rows=2 * BATCH)  # rows 0-3 are replica 0's, rows 4-7 replica 1's
    step, params = step_of("bert", batches([UNPADDED], rows=2 * BATCH)[0][0])
    piped = sw.shard_params(sw.pipeline(step, "pp", "1f1b", microbatches=2, follow_batches=True), "dp", 1)
    mesh = sw.Mesh(dp=2, pp=2)
    sw.testing.assert_equivalent(piped, step, mesh, data, params)
    plan = sw.testing.assert_plan_is_run(piped, mesh, params, data[0])
    first_stages = [r for r in range(mesh.size) if mesh.coords_of(r)["pp"] == 0]
    sent = [sum(c.nbytes for c in plan.collectives(r) if c.op == "send") for r in first_stages]
    assert sent[0] > sent[1]  # replica 0 sends its masks, replica 1 none


def _gloo_rank() -> list[Any]:
    data = batches([PADDED, MIXED])
    step, params = step_of("bert", batches([UNPADDED])[0][0])
    piped = sw.pipeline(step, "pp", "1f1b", microbatches=2, follow_batches=True)
    return sw.testing.record_history(piped, piped.init(params, sw.Mesh(pp=2)), data)


@pytest.mark.gloo
def test_padded_micro_batches_after_an_unpadded_example_cross_gloo_processes(gloo2: Any) -> None:
    step, params = step_of("bert", batches([UNPADDED])[0][0])
    reference = sw.testing.record_history(step, step.init(params), batches([PADDED, MIXED]))
    sw.testing.compare_histories(gloo2.run(_gloo_rank), reference, rtol=1e-12)  # float64, as on threads


class _Seq2Seq(nn.Module):
    """BART taking both masks, returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, decoder_input_ids: Tensor,
                decoder_attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                          decoder_attention_mask=decoder_attention_mask).logits


def test_a_mask_left_out_after_the_first_layer_still_names_the_example() -> None:
    """What the first layer cannot decide stays predicted as the example had it, and a micro-batch unlike it
    is refused, naming the example: BART's decoder mask (sdpa: None without padding) is made between the
    stacks, after the encoder's units, where the fake run cannot read the decoder's mask."""
    torch.manual_seed(0)
    cfg = T.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
                       attention_dropout=0.0, max_position_embeddings=32, use_cache=False)
    bart = T.models.bart.modeling_bart
    (given, targets), = batches([UNPADDED])
    ids = given["input_ids"]
    decoder_mask = torch.ones_like(ids)
    inputs = {"input_ids": ids, "attention_mask": ids * 0 + 1, "decoder_input_ids": ids.flip(1),
              "decoder_attention_mask": decoder_mask}
    chain, params = sw.functionalize(_Seq2Seq(T.BartForConditionalGeneration(cfg).double()),
                                     units=[bart.BartEncoderLayer, bart.BartDecoderLayer], example_input=inputs)
    step = sw.train_step(chain, lambda logits, y: loss(T.utils.ModelOutput(logits=logits), y),
                         sw.optim.sgd(0.1, momentum=0.9), tokens=counted)
    # the decoder's mask crosses
    piped = sw.pipeline(step, "pp", "1f1b", microbatches=2, partition=[4, 3], follow_batches=True)
    decoder_mask[[0, 2], SEQ - 2:] = 0
    padded = ({**inputs, "decoder_attention_mask": decoder_mask}, targets.masked_fill(decoder_mask == 0, -100))
    with pytest.raises(sw.collectives.RankFailed, match=r"micro-batch 0,.*decided later cannot be read off.*has one "
                                                        r"where the example had none.*example_input like your batches"):
        sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), [padded], params)


def test_under_tensor_parallel_the_refusal_says_follow_batches_does_not_run() -> None:
    """Found by session 41's probing: under tensor parallel follow_batches is off (the split's layers run on fake
    tensors only inside its prediction), and the refusal said the first layer had been followed, blaming the model."""
    config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                           attn_implementation="sdpa")
    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(config).double()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (4, SEQ), generator=g)
    mask = torch.ones(4, SEQ, dtype=torch.long)
    mask[2:, :3] = 0  # left padding in micro-batch 1 only
    data = [({"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100))]
    chain, params = sw.functionalize(llama, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                     example_input=data[0][0])
    step = sw.train_step(chain, loss, sw.optim.sgd(0.1), tokens=counted)
    piped = sw.pipeline(sw.tensor_parallel(step, "tp", sw.tp.llama_plan()), "pp", "1f1b", 2, follow_batches=True)
    with pytest.raises(sw.collectives.RankFailed, match=r"pipeline\(follow_batches=True\) does not run under "
                       r"tensor_parallel"):
        sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2, tp=2), data, params)
