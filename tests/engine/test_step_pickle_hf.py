"""A step of a Hugging Face model split per layer pickles (the processes backend sends it to every rank).

BERT's, RoBERTa's and ELECTRA's layers hold a ``GELUActivation``, whose ``act`` is ``F.gelu``, a builtin
function: each layer's reuse key (what tells that two layers compute alike, ``engine/model/reuse.py``)
held its type, which pickle cannot find by name, and every such step was refused on process ranks
("step.chain._layers[1].fn.fn._reuse_key[...] is a type"). The unpickled step keeps its layers' keys
(alike layers still alike) and trains bitwise as the original.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.engine.model.reuse import reuse_key

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")


def test_a_bert_step_split_per_layer_round_trips_through_pickle() -> None:
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    model = T.BertForMaskedLM(config).double()
    assert model.bert.encoder.layer[0].intermediate.intermediate_act_fn.act is F.gelu  # what made it fail
    ids = torch.randint(2, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    chain, params = sw.functionalize(model, units=T.models.bert.modeling_bert.BertLayer, example_input=ids)
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1))
    copy = pickle.loads(pickle.dumps(step))

    def keys(s: sw.Step) -> list[object]:
        return [reuse_key(layer.fn) for layer in s.chain.layers]

    # the two BertLayers' keys: alike before and after (the embedding's and the head's are their own objects)
    original, unpickled = keys(step)[1:3], keys(copy)[1:3]
    assert original[0] is not None and original[0] == original[1], original
    assert unpickled[0] is not None and unpickled[0] == unpickled[1], unpickled
    batch = (ids, ids)
    (_, want), (_, got) = step(step.init(params), batch), copy(copy.init(params), batch)
    assert torch.equal(got["loss"], want["loss"]), (got["loss"], want["loss"])


def _loss(out: object, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())  # type: ignore[attr-defined]
