"""``init_from_pretrained`` reads what ``from_pretrained`` reads, where the file's keys are not the module's.

transformers 5 holds a mixture of experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H]) but
``save_pretrained`` writes one tensor per expert (Mixtral: ``block_sparse_moe.experts.N.w1.weight``,
``.w3``, ``.w2``; Qwen2-MoE: ``mlp.experts.N.gate_proj.weight``, ...), and converts back on load. A
base model's save (the hub's ``gpt2``) lacks the head model's ``transformer.`` prefix and carries
legacy ``attn.bias`` tensors; old Llama conversions carry per-layer ``rotary_emb.inv_freq``.
Each is loaded into a meta-built step, sharded, and compared bitwise with ``init_from_state_dict``
of the module's own ``state_dict`` (no arithmetic is involved); the fused experts are read a rank's
share at a time (bytes counted where the loaders open files, per rank thread). What
``from_pretrained`` would not load is still refused, naming the cause.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
from safetensors.torch import load_file, save_file

import shardwise as sw
from shardwise.engine.checkpoint import hf_layout, safetensors_files
from shardwise.engine.checkpoint.errors import CheckpointError

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
SEQ = 8


def _mixtral() -> Any:
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=12, num_experts_per_tok=2, max_position_embeddings=2 * SEQ,
    ))  # 12 experts: expert 10 must follow 9 (from_pretrained's natural order), not 1


def _qwen2_moe() -> Any:
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ,
    ))


def _llama() -> Any:
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ,
    ))


def _gpt2_config() -> Any:
    return T.GPT2Config(vocab_size=64, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=2)


MODELS: dict[str, tuple[Callable[[], Any], str]] = {
    "mixtral": (_mixtral, "models.mixtral.modeling_mixtral.MixtralDecoderLayer"),
    "qwen2_moe": (_qwen2_moe, "models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeDecoderLayer"),
    "llama": (_llama, "models.llama.modeling_llama.LlamaDecoderLayer"),
    "gpt2": (lambda: T.GPT2LMHeadModel(_gpt2_config()), "models.gpt2.modeling_gpt2.GPT2Block"),
}


def _unit(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(__import__(f"transformers.{module}", fromlist=[name]), name)


def _loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _meta_step(family: str) -> sw.Step:
    make, unit = MODELS[family]
    with torch.device("meta"):
        model = make()
    chain, _ = sw.functionalize(model, units=_unit(unit), example_input=torch.zeros(2, SEQ, dtype=torch.long))
    return sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))


STACKS: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", stage=3), sw.Mesh(dp=2)),
    "ep2 x zero3 dp2": (lambda s: sw.shard_params(sw.expert_parallel(s, "ep"), "dp", stage=3), sw.Mesh(dp=2, ep=2)),
}




@pytest.fixture
def bytes_read(count_reads: Callable[..., collections.Counter[str]]) -> collections.Counter[str]:
    """Bytes each thread (a rank) reads through the safetensors reader's ``open``. (tests/engine/conftest.py)"""
    return count_reads(safetensors_files)


def _assert_states_equal(got: list[Any], want: list[Any]) -> None:
    for a, b in zip(got, want, strict=True):
        for x, y in zip(optree.tree_leaves((a.params, a.opt_state)), optree.tree_leaves((b.params, b.opt_state)),
                        strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_moe_save_pretrained_loads_its_fused_experts_a_share_per_rank(
    family: str, stack: str, tmp_path: Path, bytes_read: collections.Counter[str]
) -> None:
    """The file holds one tensor per expert; the module fused ones. Each rank reads the per-expert
    tensors' rows that make up its part of the fused ones: about 1/world of the data."""
    torch.manual_seed(0)
    real = MODELS[family][0]()
    real.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert not any(k.endswith("gate_up_proj") for k in stored)  # the per-expert layout, as the hub's files
    transform, mesh = STACKS[stack]
    step = transform(_meta_step(family))
    loaded = sw.launch(lambda: sw.checkpoint.init_from_pretrained(step, tmp_path, mesh), mesh.size)
    reads = [bytes_read[f"shardwise-rank-{r}"] for r in range(mesh.size)]
    whole = sw.launch(lambda: sw.checkpoint.init_from_state_dict(step, real.state_dict(), mesh), mesh.size)
    _assert_states_equal(loaded, whole)
    experts = sum(t.numel() * t.element_size() for k, t in stored.items() if ".experts." in k)
    others = sum(t.numel() * t.element_size() for k, t in stored.items() if ".experts." not in k)
    share = experts / mesh.size + others / mesh.axis_size("dp")  # ZeRO-3 over dp; the experts over ep too
    header = 8 + int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    for read in reads:
        assert read <= share + header, (read, share, header)


def test_a_mixtral_exported_by_a_sharded_step_and_saved_with_save_pretrained_resumes(tmp_path: Path) -> None:
    """full_state_dict (module keys) -> save_pretrained(state_dict=) (per-expert keys) ->
    init_from_pretrained on another mesh -> full_state_dict: the same tensors."""
    torch.manual_seed(0)
    real = _mixtral()
    ids = torch.randint(64, (4, SEQ), generator=torch.Generator().manual_seed(1))
    transform, mesh = STACKS["ep2 x zero3 dp2"]
    step = transform(_meta_step("mixtral"))

    def trained() -> dict[str, torch.Tensor]:
        state = sw.checkpoint.init_from_state_dict(step, real.state_dict(), mesh)
        state, _ = step(state, (ids, ids))
        return sw.checkpoint.full_state_dict(step, state)

    exported = sw.launch(trained, mesh.size)[0]
    _mixtral().save_pretrained(tmp_path, state_dict=exported)
    other, other_mesh = STACKS["zero3 dp2"]
    resumed_step = other(_meta_step("mixtral"))

    def resumed() -> dict[str, torch.Tensor]:
        return sw.checkpoint.full_state_dict(
            resumed_step, sw.checkpoint.init_from_pretrained(resumed_step, tmp_path, other_mesh))

    back = sw.launch(resumed, other_mesh.size)[0]
    assert sorted(back) == sorted(exported)
    assert all(torch.equal(back[k], exported[k]) for k in exported)


def test_a_file_under_the_modules_own_keys_loads_as_it_is(tmp_path: Path) -> None:
    """The way round a conversion init_from_pretrained cannot apply: the module's state_dict saved as it is."""
    torch.manual_seed(0)
    real = _mixtral()
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, tmp_path / "model.safetensors")
    step = _meta_step("mixtral")
    _assert_states_equal([sw.checkpoint.init_from_pretrained(step, tmp_path)],
                         [sw.checkpoint.init_from_state_dict(step, real.state_dict())])


def test_a_conversion_other_than_stacks_and_concatenations_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loading = pytest.importorskip("transformers.core_model_loading")
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path)
    transposed = loading.WeightConverter(source_patterns="lm_head.weight", target_patterns="lm_head.weight",
                                         operations=[loading.Transpose(dim0=0, dim1=1)])
    monkeypatch.setattr(hf_layout, "_conversions", lambda model: [transposed])
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' as \['lm_head\.weight'\].*\['Transpose'\].*"
                                              r"save_model\(Model\.from_pretrained\(directory\)"):
        sw.checkpoint.init_from_pretrained(_meta_step("llama"), tmp_path)


def test_a_base_model_save_without_the_prefix_and_with_legacy_keys_loads_tied(tmp_path: Path) -> None:
    """The hub's gpt2 layout: GPT2Model's keys (no ``transformer.``) and ``h.N.attn.bias``, which
    GPT2's ``_keys_to_ignore_on_load_unexpected`` drops; the head is tied to ``wte``."""
    torch.manual_seed(0)
    base = T.GPT2Model(_gpt2_config())
    base.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    stored.update({f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 2 * SEQ, 2 * SEQ)) for i in range(2)})
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    real = T.GPT2LMHeadModel(_gpt2_config())
    real.transformer.load_state_dict(base.state_dict())
    transform, mesh = STACKS["zero3 dp2"]
    step = transform(_meta_step("gpt2"))
    loaded = sw.launch(lambda: sw.checkpoint.init_from_pretrained(step, tmp_path, mesh), mesh.size)
    whole = sw.launch(lambda: sw.checkpoint.init_from_state_dict(step, real.state_dict(), mesh), mesh.size)
    _assert_states_equal(loaded, whole)


def test_a_llama_file_with_legacy_per_layer_inv_freq_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    real = _llama()
    real.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        stored[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = real.model.rotary_emb.inv_freq.clone()
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    step = _meta_step("llama")
    _assert_states_equal([sw.checkpoint.init_from_pretrained(step, tmp_path)],
                         [sw.checkpoint.init_from_state_dict(step, real.state_dict())])


def test_a_tensor_the_model_neither_loads_nor_ignores_is_still_refused(tmp_path: Path) -> None:
    """Llama ignores no ``attn.bias``: GPT-2's legacy key in a Llama file is unexpected."""
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    stored["model.layers.0.attn.bias"] = torch.zeros(2)
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['model\.layers\.0\.attn\.bias'\]"):
        sw.checkpoint.init_from_pretrained(_meta_step("llama"), tmp_path)


def test_a_save_under_a_prefix_the_module_lacks_is_refused_naming_the_prefix(tmp_path: Path) -> None:
    """A plain module (no base_model_prefix to map) saved from a wrapper: the prefix is named."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    save_file({f"model.{k}": v for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    chain, _ = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(CheckpointError, match=r"the unexpected keys are the missing ones with the prefix 'model\.'"):
        sw.checkpoint.init_from_pretrained(step, tmp_path)


def test_a_tensor_stored_both_fused_and_per_expert_is_refused_naming_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    real = _mixtral()
    real.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    stored["model.layers.0.mlp.experts.down_proj"] = real.model.layers[0].mlp.experts.down_proj.detach().clone()
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"holds the model's 'model\.layers\.0\.mlp\.experts\.down_proj' twice"):
        sw.checkpoint.init_from_pretrained(_meta_step("mixtral"), tmp_path)


def _refused_after(tmp_path: Path, expert: str, into: str | None, match: str) -> None:
    """A Mixtral's save_pretrained file with expert ``expert``'s tensors stored as expert ``into`` (or
    dropped): init_from_pretrained refuses it, matching ``match``."""
    torch.manual_seed(0)
    _mixtral().save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    for k in [k for k in stored if f".experts.{expert}." in k]:
        value = stored.pop(k)
        if into is not None:
            stored[k.replace(f".experts.{expert}.", f".experts.{into}.")] = value
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=match):
        sw.checkpoint.init_from_pretrained(_meta_step("mixtral"), tmp_path)


def test_a_gap_in_the_expert_indices_is_refused_not_loaded_a_slot_early(tmp_path: Path) -> None:
    """Expert 1's tensors stored as expert 13 (of 12): stacked in order, experts 2-11 loaded a slot early."""
    _refused_after(tmp_path, "1", "13", r"holds indices \[0, 2, 3.*: \[1\] missing")


def test_a_missing_last_expert_is_refused_naming_the_stacked_tensors(tmp_path: Path) -> None:
    _refused_after(tmp_path, "11", None, r"has shape \[11, .*stacked from the files' tensors per expert: 11 x "
                                        r"'model\.layers\.\d\.block_sparse_moe\.experts\.0\.w")
