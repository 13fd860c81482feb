"""An unmodified transformers GPTBigCode with ``multi_query=True`` (one key/value head for every query head) under
tensor parallel: its count is refused naming ``config.multi_query`` (count_fields.py recognises the flag on a config
without Falcon's ``new_decoder_architecture``), and the ways out the refusal names equal one device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

ATTENTION = {"transformer.h.*.attn": sw.tp.Region(heads=("num_heads", "kv_heads"), local=("split_size", "embed_dim")),
             "transformer.h.*.attn.c_attn": sw.tp.Colwise(), "transformer.h.*.attn.c_proj": sw.tp.Rowwise()}
MLP = {"transformer.h.*.mlp.c_fc": sw.tp.Colwise(), "transformer.h.*.mlp.c_proj": sw.tp.Rowwise()}


def _problem(multi_query: bool) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    config = T.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, multi_query=multi_query,
                                attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                attn_implementation="sdpa")
    model = T.GPTBigCodeForCausalLM(config).double()
    ids = torch.randint(0, 64, (2, 2, 9), generator=torch.Generator().manual_seed(1))
    data = [(x[:, :-1], x[:, 1:]) for x in ids]
    chain, params = sw.functionalize(model, units=T.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeBlock,
                                     example_input=data[0][0])

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    return sw.train_step(chain, loss, sw.optim.sgd(0.1)), params, data


def test_multi_query_gpt_bigcode_is_refused_naming_the_config_field_and_the_ways_out() -> None:
    step, params, data = _problem(multi_query=True)
    with pytest.raises(sw.collectives.RankFailed) as failed:
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", {**ATTENTION, **MLP}), step, sw.Mesh(tp=2), data,
                                     params, rtol=1e-9)
    text = str(failed.value)
    assert ("tensor_parallel: transformer.h.0.attn.kv_heads is 1 (the model's config.multi_query=True), which the 2 "
            "ranks of axis 'tp' do not divide") in text, text
    assert "Leave the attention out of the plan (plan['transformer.h.*.attn'] and its projections' entries)" in text
    assert "build the model with config.multi_query=False" in text, text
    assert "new_decoder_architecture" not in text, text  # (Falcon's field: not this model's)


@pytest.mark.parametrize("fix", ["attention-left-out", "multi_query=False"])
def test_the_ways_out_for_multi_query_gpt_bigcode_equal_one_device(fix: str) -> None:
    step, params, data = _problem(multi_query=fix != "multi_query=False")
    plan = MLP if fix == "attention-left-out" else {**ATTENTION, **MLP}
    sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", plan), step, sw.Mesh(tp=2), data, params, rtol=1e-9)
