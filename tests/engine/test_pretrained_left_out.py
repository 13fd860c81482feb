"""What a transformers ``save_pretrained`` leaves out and ``from_pretrained`` loads all the same: a start from
those files takes it likewise (checkpoint/model_made.py).

Marian (every opus-mt checkpoint) never saves its frozen sinusoidal position tables, which its
``_keys_to_ignore_on_load_missing`` names and its initializer computes; a BART file may lack
``final_logits_bias`` (zeros) likewise; a frozen tied embedding (GPT-2's ``wte``, which ``lm_head.weight`` is)
is stored under one name. Each was refused as missing, for a meta-built and an eager model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(3, 48, (4, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}, ids


def _start(build: Any, tmp_path: Path, meta: bool, freeze: str | None = None) -> tuple[Any, Any]:
    """ZeRO-3 over 2 ranks from ``tmp_path``'s files: each rank's first loss, and the chain's frozen and buffer
    tensors after the load."""
    with torch.device("meta" if meta else "cpu"):
        model = build()
    if freeze is not None:
        model.get_parameter(freeze).requires_grad_(False)
    chain, _ = sw.functionalize(model, example_input=_batch()[0])
    step = sw.shard_params(sw.train_step(chain, _loss, sw.optim.sgd(0.1)), "dp", 3)

    def rank() -> float:
        state = sw.checkpoint.init_from_pretrained(step, tmp_path, sw.Mesh(dp=2))
        return float(step(state, _batch())[1]["loss"])

    losses = sw.launch(rank, 2)
    return losses, {name: t.clone() for layer in chain.layers for name, t in layer.buffers.items()}


def _marian() -> Any:
    return T.MarianMTModel(T.MarianConfig(
        vocab_size=48, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1,
        decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


@pytest.mark.parametrize("meta", [True, False], ids=["meta", "eager"])
def test_marians_unsaved_sinusoidal_tables_are_made_by_the_model(tmp_path: Path, meta: bool) -> None:
    torch.manual_seed(0)
    _marian().save_pretrained(tmp_path)
    assert not [k for k in load_file(tmp_path / "model.safetensors") if "embed_positions" in k]
    reference = T.MarianMTModel.from_pretrained(tmp_path)
    losses, held = _start(_marian, tmp_path, meta)
    for key in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        assert torch.equal(held[key], reference.get_parameter(key)), key
    inputs, labels = _batch()
    want = _loss(reference(**inputs), labels).item()
    assert losses[0] == pytest.approx(want, rel=1e-6) and losses[0] == losses[1]


def _bart() -> Any:
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=48, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2))


@pytest.mark.parametrize("meta", [True, False], ids=["meta", "eager"])
def test_a_bart_file_without_final_logits_bias_loads_it_as_from_pretrained_does(tmp_path: Path, meta: bool) -> None:
    torch.manual_seed(0)
    _bart().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["final_logits_bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = T.BartForConditionalGeneration.from_pretrained(tmp_path)
    losses, held = _start(_bart, tmp_path, meta)
    assert torch.equal(held["final_logits_bias"], reference.final_logits_bias)
    inputs, labels = _batch()
    assert losses[0] == pytest.approx(_loss(reference(**inputs), labels).item(), rel=1e-6)


def test_a_missing_tensor_the_model_does_not_make_is_still_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _bart().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.encoder.layers.0.fc1.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(sw.collectives.RankFailed, match=r"missing \['model.encoder.layers.0.fc1.bias'\]"):
        _start(_bart, tmp_path, True)


def _gpt2() -> Any:
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=48, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


@pytest.mark.parametrize("meta", [True, False], ids=["meta", "eager"])
def test_a_frozen_tied_embedding_loads_from_its_one_stored_name(tmp_path: Path, meta: bool) -> None:
    torch.manual_seed(0)
    _gpt2().save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    reference = T.GPT2LMHeadModel.from_pretrained(tmp_path)
    reference.transformer.wte.weight.requires_grad_(False)
    losses, held = _start(_gpt2, tmp_path, meta, freeze="transformer.wte.weight")
    assert torch.equal(held["transformer.wte.weight"], reference.transformer.wte.weight)
    inputs, labels = _batch()
    assert losses[0] == pytest.approx(_loss(reference(input_ids=inputs["input_ids"]), labels).item(), rel=1e-6)


def test_a_dcp_start_through_a_frozen_tied_name_still_checks_its_files_were_not_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store read through the tied weight's stored name wraps the DCP files; the check that no file was
    replaced while the load read them asked the wrapper, which had none, and was skipped (the review)."""
    import torch.distributed.checkpoint as dcp

    from shardwise.engine.checkpoint import dcp_files
    from shardwise.engine.checkpoint.errors import CheckpointError

    torch.manual_seed(0)
    model = _gpt2()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # the tie stored once
    dcp.save({"model": state}, checkpoint_id=str(tmp_path))
    model.transformer.wte.weight.requires_grad_(False)
    chain, _ = sw.functionalize(model, example_input=_batch()[0])
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1))
    sw.checkpoint.init_from_dcp(step, tmp_path, prefix="model.")  # loads through the tied name

    def replaced(self: Any) -> None:
        raise CheckpointError("replaced while this load read it")

    monkeypatch.setattr(dcp_files.DcpFiles, "check_unreplaced", replaced)
    with pytest.raises(CheckpointError, match="replaced while this load read it"):
        sw.checkpoint.init_from_dcp(step, tmp_path, prefix="model.")
