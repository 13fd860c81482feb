"""Interop: torch.distributed.checkpoint reads a shardwise checkpoint into a plain module and a DCP
checkpoint of a module starts a shardwise step; the exported state_dict loads strictly into the
module (tied weights, persistent buffers) and through a transformers model's save_pretrained."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.file_format import CheckpointError
from shardwise.engine.checkpoint.state_dict import (
    full_state_dict,
    init_from_state_dict,
    read_dcp_state_dict,
)
from shardwise.testing.models import TinyGPT

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _gpt() -> TinyGPT:
    return TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8).double()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train_save_export(step: Any, params: Any, mesh: sw.Mesh, batch: Any, path: Path) -> dict:
    state, _ = step(step.init(params, mesh), batch)
    ck.save(path, state, step)
    return full_state_dict(step, state)


def test_dcp_loads_a_pipelined_zero3_checkpoint_into_a_plain_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _gpt()
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.pipeline(
        sw.shard_params(sw.train_step(chain, _lm_loss, sw.optim.adamw(1e-2)), "dp", stage=3), "pp", "1f1b", 2
    )
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(32, (4, 8), generator=gen), torch.randint(32, (4, 8), generator=gen))
    exported = sw.launch(
        functools.partial(_train_save_export, step, params, sw.Mesh(dp=2, pp=2), batch, tmp_path / "c"), 4
    )
    fresh = _gpt()
    target = fresh.state_dict()
    dcp.load({"model": target}, checkpoint_id=tmp_path / "c", no_dist=True)
    assert set(target) == set(exported[0])
    for key, value in target.items():
        assert torch.equal(value, exported[0][key]), key
    assert not torch.equal(target["tok_emb.weight"], model.tok_emb.weight.detach())  # it trained
    assert fresh.head.weight is fresh.tok_emb.weight
    # the optimizer state is there for DCP too, under optim.<state>.<key>
    moments = {"exp_avg": {"tok_emb.weight": torch.zeros(32, 16, dtype=torch.float64)}}  # a tied weight once
    dcp.load({"optim": moments}, checkpoint_id=tmp_path / "c", no_dist=True)
    assert moments["exp_avg"]["tok_emb.weight"].abs().sum() > 0


def test_a_dcp_checkpoint_of_a_module_starts_a_sharded_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _gpt()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "d", no_dist=True)
    chain, _ = sw.functionalize(_gpt(), units=["tok_emb", "blocks", "head"])  # other random weights
    step = sw.shard_params(sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    with pytest.raises(CheckpointError, match=r"torch\.distributed\.checkpoint directory"):
        ck.load(tmp_path / "d", step, sw.Mesh(dp=1))
    state_dict = read_dcp_state_dict(tmp_path / "d", prefix="model.")

    def main() -> dict:
        return full_state_dict(step, init_from_state_dict(step, state_dict, sw.Mesh(dp=2)))

    for exported in sw.launch(main, 2):
        assert set(exported) == set(model.state_dict())
        for key, value in model.state_dict().items():
            assert torch.equal(exported[key], value), key


def test_init_from_state_dict_refuses_a_state_dict_of_another_module() -> None:
    chain, _ = sw.functionalize(_gpt(), units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1))
    other = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=3, seq_len=8).double().state_dict()
    with pytest.raises(CheckpointError, match=r"unexpected \['blocks\.2\."):
        init_from_state_dict(step, other)
    untied = _gpt().state_dict()
    untied["head.weight"] = untied["head.weight"] + 1
    with pytest.raises(CheckpointError, match=r"'head\.weight' is tied to 'tok_emb\.weight'"):
        init_from_state_dict(step, untied)


def test_init_from_state_dict_takes_the_modules_shapes_and_dtypes_as_load_state_dict_does() -> None:
    """A bias of another shape was loaded as given and broadcast in the forward (another model without an
    error); a bfloat16 state_dict made a float64 model's parameters bfloat16 (a GPT trains in bf16, its
    embedding's lookups casting the rest). nn.Module.load_state_dict refuses the one and casts the other:
    so does init_from_state_dict (and integer codes are refused)."""
    chain, _ = sw.functionalize(_gpt(), units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1))
    good = _gpt().state_dict()
    for key, value, message in [
        ("head.bias" if "head.bias" in good else "ln_f.bias", torch.zeros(1, dtype=torch.float64), r"has shape \[1\]"),
        ("ln_f.weight", torch.ones(16, dtype=torch.int8), r"is torch\.int8, the model's"),
    ]:
        with pytest.raises(CheckpointError, match=rf"'{key}' {message}"):
            init_from_state_dict(step, {**good, key: value})
    half = {k: v.bfloat16() for k, v in good.items()}
    state = init_from_state_dict(step, half)
    for layer, tensors in state.params.items():
        for name, t in tensors.items():
            assert t.dtype == torch.float64, (layer, name, t.dtype)
            key = name if name in half else f"{layer}.{name}"
            assert torch.equal(t, half[key].double()), key


def test_full_state_dict_loads_strictly_with_shared_children_and_buffers() -> None:
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(3).eval(), torch.nn.Tanh(), shared).double()
    norm = model[1]
    assert isinstance(norm, torch.nn.BatchNorm1d) and norm.running_mean is not None
    norm.running_mean.fill_(0.5)
    chain, params = sw.functionalize(model)
    step = sw.pipeline(
        sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "pp", "gpipe", 1, partition=[2, 2]
    )
    batch = (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))

    def main() -> dict:
        state, _ = step(step.init(params, sw.Mesh(pp=2)), batch)
        return full_state_dict(step, state)

    exported = sw.launch(main, 2)[0]
    assert set(exported) == set(model.state_dict())  # '3.weight' too, and num_batches_tracked
    assert exported["3.weight"] is exported["0.weight"]
    reference = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    expected = reference.full_params(reference(reference.init(params), batch)[0])
    assert torch.allclose(exported["0.weight"], expected["0"]["weight"], rtol=1e-12, atol=0)
    fresh = torch.nn.Sequential(
        torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Tanh(), torch.nn.Linear(3, 3)
    ).double()
    fresh[3] = fresh[0]
    fresh.load_state_dict(exported, strict=True)
    assert torch.equal(fresh.state_dict()["1.running_mean"], torch.full((3,), 0.5, dtype=torch.float64))


def test_a_transformers_model_saves_the_exported_state_dict(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    chain, params = sw.functionalize(model, units=transformers.models.gpt2.modeling_gpt2.GPT2Block)
    step = sw.shard_params(sw.train_step(chain, _lm_loss_of_output, sw.optim.adamw(1e-2)), "dp", stage=3)
    ids = torch.randint(32, (4, 8), generator=torch.Generator().manual_seed(1))

    def main() -> dict:
        state, _ = step(step.init(params, sw.Mesh(dp=2)), (ids, ids))
        return full_state_dict(step, state)

    exported = sw.launch(main, 2)[0]
    fresh = transformers.GPT2LMHeadModel(config)
    fresh.load_state_dict(exported, strict=True)
    fresh.save_pretrained(tmp_path / "hf", state_dict=dict(exported))  # it drops tied names from the dict it is given
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, exported[key]), key
    assert not torch.equal(exported["transformer.wte.weight"], model.transformer.wte.weight.detach())


def _lm_loss_of_output(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return _lm_loss(output.logits, targets)


class _RopeBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x * freqs[: x.shape[1]]))


class _RopeNet(torch.nn.Module):
    """torchtitan's layout: a non-persistent buffer of the model (its freqs_cis) passed to every block."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs_cis", torch.linspace(0.5, 1.5, 16).unsqueeze(-1), persistent=False)
        self.layers = torch.nn.ModuleList(_RopeBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.freqs_cis)
        return x


def test_a_non_persistent_buffer_every_block_reads_is_left_out_as_torch_leaves_it(tmp_path: Path) -> None:
    """Split into blocks, each segment (a GraphModule) held the model's freqs_cis as a persistent buffer of
    its own: full_state_dict and save refused the chain ("state_dict key 'freqs_cis' names two different
    tensors"), so such a model trained but could never be saved. Its keys are now the module's state_dict's,
    after a pickle too (a GraphModule's copy registers its buffers as persistent again)."""
    import pickle

    torch.manual_seed(0)
    model = _RopeNet()
    chain, params = sw.functionalize(model, units=_RopeBlock)
    for chain_ in (chain, pickle.loads(pickle.dumps(chain))):
        step = sw.train_step(chain_, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
        state, _ = step(step.init(params), (torch.randn(2, 16, 8), torch.randn(2, 16, 8)))
        assert sorted(sw.checkpoint.full_state_dict(step, state)) == sorted(model.state_dict())
    ck.save(tmp_path / "c", state, step)
    loaded = ck.load(tmp_path / "c", step)
    assert all(torch.equal(loaded.params[k][n], state.params[k][n]) for k in state.params for n in state.params[k])


def test_a_persistent_buffer_every_block_reads_is_one_entry(tmp_path: Path) -> None:
    """The same model with freqs_cis persistent: one state_dict entry (the model's), saved and loaded once."""
    torch.manual_seed(0)
    model = _RopeNet()
    model.register_buffer("freqs_cis", model.freqs_cis, persistent=True)
    chain, params = sw.functionalize(model, units=_RopeBlock)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    state = step.init(params)
    exported = sw.checkpoint.full_state_dict(step, state)
    assert sorted(exported) == sorted(model.state_dict()) and torch.equal(exported["freqs_cis"], model.freqs_cis)
    ck.save(tmp_path / "c", state, step)
    assert ck.load(tmp_path / "c", step).step == 0


def test_a_checkpoint_loads_into_the_same_model_functionalized_with_other_units(tmp_path: Path) -> None:
    """TinyGPT split as ["tok_emb", "blocks", "head"] (the README's ZeRO example) and per Block (its tensor-parallel
    one): the same module, so the same state_dict keys, but other layers. A checkpoint of the one was "of another
    model" for the other, naming the chains' internal names; it now loads by the state_dict keys it holds the
    tensors under, resharded from ZeRO-3 on two ranks to one device, and trains on as the saving step does."""
    from shardwise.testing.models import Block, TinyGPT

    def lm(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=8).double()
    chain_a, params_a = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    chain_b, _ = sw.functionalize(model, units=Block)
    step_a = sw.train_step(chain_a, lm, sw.optim.sgd(0.1, momentum=0.9))
    step_b = sw.train_step(chain_b, lm, sw.optim.sgd(0.1, momentum=0.9))
    zero3 = sw.shard_params(step_a, "dp", 3)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(64, (4, 8), generator=gen), torch.randint(64, (4, 8), generator=gen)) for _ in range(3)]

    def save() -> None:
        state = zero3.init(params_a, sw.Mesh(dp=2))
        for batch in batches[:2]:
            state, _ = zero3(state, batch)
        ck.save(tmp_path / "c", state, zero3)

    sw.launch(save, 2)
    state_a = step_a.init(params_a)
    for batch in batches[:2]:
        state_a, _ = step_a(state_a, batch)
    state_b = ck.load(tmp_path / "c", step_b)
    assert state_b.step == 2
    whole_a, whole_b = sw.checkpoint.full_state_dict(step_a, state_a), sw.checkpoint.full_state_dict(step_b, state_b)
    assert sorted(whole_a) == sorted(whole_b) == sorted(model.state_dict())
    # the same saved values whichever units read them: bitwise
    whole_saved = sw.checkpoint.full_state_dict(step_a, ck.load(tmp_path / "c", step_a))
    assert all(torch.equal(whole_saved[k], whole_b[k]) for k in whole_b)
    # and the single-device run's, to ZeRO-3's rounding (1e-17 here) against each tensor's scale
    assert all(float((whole_a[k] - whole_b[k]).abs().max()) <= 1e-12 * float(whole_a[k].abs().max()) for k in whole_a)
    next_a, metrics_a = step_a(state_a, batches[2])
    next_b, metrics_b = step_b(state_b, batches[2])
    assert float(metrics_b["loss"]) == pytest.approx(float(metrics_a["loss"]), rel=1e-12)
    # the update after the load used the loaded momentum: the parameters agree after it too
    after_a, after_b = sw.checkpoint.full_state_dict(step_a, next_a), sw.checkpoint.full_state_dict(step_b, next_b)
    assert all(float((after_a[k] - after_b[k]).abs().max()) <= 1e-12 * float(after_a[k].abs().max()) for k in after_a)
    # (and it matters: the same parameters with no momentum move elsewhere)
    no_momentum, _ = step_b(step_b.init(state_b.params), batches[2])
    moved = sw.checkpoint.full_state_dict(step_b, no_momentum)
    assert any(not torch.allclose(moved[k], after_b[k]) for k in after_b)


def _dcp_readers(step: Any) -> dict[str, Any]:
    return {"read_dcp_state_dict": lambda path: sw.checkpoint.read_dcp_state_dict(path, "model."),
            "init_from_dcp": lambda path: sw.checkpoint.init_from_dcp(step, path, prefix="model.")}


def test_the_dcp_readers_check_a_shardwise_checkpoint_as_load_does(tmp_path: Path) -> None:
    """The DCP readers read a shardwise checkpoint (its files are DCP's) without its checks: a flipped
    byte in its metadata failed with the unpickler's own error, or came back as a key of another name
    (`0.bias` read as `0.bi`s`), a damaged record with an IndexError, and an interrupted save's files were
    read without a word. They now check what load checks, and find what it finds."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(0.1))
    good = tmp_path / "good"
    ck.save(good, step.init(params), step)
    expected = sw.checkpoint.read_dcp_state_dict(good, "model.")
    raw = (good / ".metadata").read_bytes()
    for offset in range(0, len(raw), max(1, len(raw) // 40)):  # a byte of every part of the metadata
        bad = tmp_path / f"flip{offset}"
        bad.mkdir()
        for file in good.iterdir():
            (bad / file.name).write_bytes(file.read_bytes())
        flipped = bytearray(raw)
        flipped[offset] ^= 1
        (bad / ".metadata").write_bytes(bytes(flipped))
        for read in _dcp_readers(step).values():
            with pytest.raises(CheckpointError, match=r"\.metadata \(listed in COMMITTED\) was modified"):
                read(bad)
    uncommitted = tmp_path / "uncommitted"
    uncommitted.mkdir()
    for file in good.iterdir():
        if file.name != "COMMITTED":
            (uncommitted / file.name).write_bytes(file.read_bytes())
    for read in _dcp_readers(step).values():
        with pytest.raises(CheckpointError, match="is not committed"):
            read(uncommitted)
    # a save stopped between its renames left the checkpoint as .previous: read there, as load reads it
    good.rename(tmp_path / ".moved.previous")
    got = sw.checkpoint.read_dcp_state_dict(tmp_path / "moved", "model.")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    sw.checkpoint.init_from_dcp(step, tmp_path / "moved", prefix="model.")


def test_the_dcp_readers_refuse_a_damaged_record_of_a_plain_dcp_checkpoint_by_name(tmp_path: Path) -> None:
    """A torch DCP checkpoint carries no checksums: a damaged record is refused naming its chunk and file
    (it was a bare IndexError from torch.load)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    chain, _ = sw.functionalize(module)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(0.1))
    dcp.save({"model": module.state_dict()}, checkpoint_id=str(tmp_path / "plain"))
    record = next((tmp_path / "plain").glob("*.distcp"))
    data = bytearray(record.read_bytes())
    data[0] ^= 1
    record.write_bytes(bytes(data))
    for read in _dcp_readers(step).values():
        with pytest.raises(CheckpointError, match=r"chunk of model\.\S+ in \S+\.distcp is not a torch\.save record"):
            read(tmp_path / "plain")
