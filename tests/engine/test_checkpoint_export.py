"""``sw.checkpoint.save_pretrained``: a sharded step's weights written as transformers' ``save_pretrained``
writes them, one layer gathered at a time.

Each export is compared bitwise with ``full_state_dict`` of the same state (no arithmetic is
involved: the same values are gathered and written), its key set with what ``model.save_pretrained``
writes for a model of the same configuration on one device, and it is loaded back both by
``from_pretrained`` (no missing or unexpected key) and by ``init_from_pretrained`` on another mesh.
The memory test counts, per rank, the layers gathered and still alive when the next is gathered.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import shardwise as sw
from shardwise.engine.checkpoint import export, safetensors_writer
from shardwise.engine.checkpoint.file_format import CheckpointError
from shardwise.engine.layout import state_layout
from shardwise.testing.models import Block, TinyGPT

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
SEQ = 8


def _gpt2() -> Any:
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=0))


def _llama(tied: bool) -> Callable[[], Any]:
    return lambda: T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, tie_word_embeddings=tied,
    ))


def _mixtral() -> Any:
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ,
    ))


def _bert() -> Any:
    return T.BertForMaskedLM(T.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=2 * SEQ))


MODELS: dict[str, tuple[Callable[[], Any], str | None]] = {
    "gpt2 tied": (_gpt2, "gpt2.modeling_gpt2.GPT2Block"),
    "llama": (_llama(False), "llama.modeling_llama.LlamaDecoderLayer"),
    "llama tied": (_llama(True), "llama.modeling_llama.LlamaDecoderLayer"),
    "mixtral fused experts": (_mixtral, "mixtral.modeling_mixtral.MixtralDecoderLayer"),
    "bert mlm": (_bert, None),  # kept whole: one layer
}
STACKS: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh | None]] = {
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", stage=3), sw.Mesh(dp=2)),
    "zero1 dp2": (lambda s: sw.shard_params(s, "dp", stage=1), sw.Mesh(dp=2)),
    "one device": (lambda s: s, None),
    "ep2 x zero3 dp2": (lambda s: sw.shard_params(sw.expert_parallel(s, "ep"), "dp", stage=3), sw.Mesh(dp=2, ep=2)),
    "pp2": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), sw.Mesh(pp=2)),
}
# Every family sharded; the other stacks on a tied model (its head on the last stage under pp2) and on the
# fused experts (expert parallel: those only).
CASES = [(f, s) for s in STACKS for f in MODELS if s == "zero3 dp2" or (
    f == "mixtral fused experts" and s != "pp2") or (f == "gpt2 tied" and s != "ep2 x zero3 dp2")]


def _unit(path: str | None) -> Any:
    if path is None:
        return None
    module, name = path.rsplit(".", 1)
    return getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)


def _logits_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(64, (4, SEQ), generator=gen), torch.randint(64, (4, SEQ), generator=gen))
            for _ in range(n)]


def _launch(fn: Callable[[], Any], mesh: sw.Mesh | None) -> list[Any]:
    return [fn()] if mesh is None else sw.launch(fn, mesh.size)


def _train_and_export(step: Any, params: Any, mesh: sw.Mesh | None, directory: Path, **kw: Any
                      ) -> dict[str, torch.Tensor]:
    state = step.init(params, mesh)
    for batch in _batches():
        state, _ = step(state, batch)
    sw.checkpoint.save_pretrained(step, state, directory, **kw)
    return sw.checkpoint.full_state_dict(step, state)


def _files(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every stored tensor's shape and dtype, over the single file or the shards."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = f.get_slice(key)
                out[key] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


@pytest.mark.parametrize(("family", "stack"), CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_an_export_is_what_save_pretrained_writes_and_loads_back_equal(family: str, stack: str, tmp_path: Path
                                                                         ) -> None:
    make, unit = MODELS[family]
    torch.manual_seed(0)
    model = make()
    chain, params = sw.functionalize(model, units=_unit(unit), example_input=torch.zeros(2, SEQ, dtype=torch.long))
    transform, mesh = STACKS[stack]
    step = transform(sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1, momentum=0.9)))
    exported = _launch(functools.partial(_train_and_export, step, params, mesh, tmp_path / "out",
                                         config=model.config), mesh)[0]
    make().save_pretrained(tmp_path / "reference")
    assert _files(tmp_path / "out") == _files(tmp_path / "reference")  # keys, shapes, dtypes
    # the files save_pretrained writes, config.json with the architecture and dtype it fills in, and
    # generation_config.json where the model generates
    out, reference = tmp_path / "out", tmp_path / "reference"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for name in ("config.json", "generation_config.json"):
        if (reference / name).exists():
            assert json.loads((out / name).read_text()) == json.loads((reference / name).read_text()), name
    assert model.config.architectures is None  # the caller's config is left as it was
    loaded, info = type(model).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    got = loaded.state_dict()
    for key, value in exported.items():
        assert torch.equal(got[key], value), key
    # init_from_pretrained onto another mesh: the same parameters
    other = sw.shard_params(sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    back = sw.launch(lambda: sw.checkpoint.full_state_dict(
        other, sw.checkpoint.init_from_pretrained(other, tmp_path / "out", sw.Mesh(dp=4))), 4)[0]
    assert sorted(back) == sorted(exported)
    assert all(torch.equal(back[k], exported[k]) for k in exported)


def _tiny_gpt(layers: int = 4) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, d_model=16, n_heads=2, n_layers=layers, seq_len=SEQ)


@pytest.mark.parametrize("layout", ["pp2 x zero3 dp2", "tp2"])
def test_a_plain_module_exports_its_state_dict_keys_a_tied_weight_once(layout: str, tmp_path: Path) -> None:
    """TinyGPT (nanoGPT-like, its head tied to the token embedding across pipeline stages): its
    state_dict keys, the tie under its first name (safetensors' save_model keeps another; both load)."""
    model = _tiny_gpt()
    if layout == "tp2":
        chain, params = sw.functionalize(model, units=Block)
        step = sw.tensor_parallel(sw.train_step(chain, sw.tp.vocab_parallel_cross_entropy, sw.optim.sgd(0.1)),
                                  "tp", sw.tp.tiny_gpt_plan())
        mesh = sw.Mesh(tp=2)
    else:
        chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
        step = sw.pipeline(sw.shard_params(sw.train_step(chain, _logits_loss, sw.optim.adamw(1e-2)), "dp", stage=3),
                           "pp", "1f1b", 2)
        mesh = sw.Mesh(dp=2, pp=2)
    exported = sw.launch(functools.partial(_train_and_export, step, params, mesh, tmp_path), mesh.size)[0]
    assert set(_files(tmp_path)) == set(model.state_dict()) - {"head.weight"}
    fresh = TinyGPT(vocab=64, d_model=16, n_heads=2, n_layers=4, seq_len=SEQ)
    from safetensors.torch import load_model

    load_model(fresh, tmp_path / "model.safetensors")
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, exported[key]), key
    assert not torch.equal(exported["tok_emb.weight"], model.tok_emb.weight.detach())  # it trained


def test_a_mixed_precision_step_exports_its_master_parameters(tmp_path: Path) -> None:
    """bf16 compute, f32 masters sharded at ZeRO-3: the file holds the masters, as full_state_dict."""
    model = _tiny_gpt()
    chain, params = sw.functionalize(model, units=Block)
    step = sw.mixed_precision(sw.shard_params(sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1)), "dp", stage=3),
                              "params=f32,compute=bf16")
    exported = sw.launch(functools.partial(_train_and_export, step, params, sw.Mesh(dp=2), tmp_path), 2)[0]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        for key in f.keys():  # noqa: SIM118
            assert f.get_tensor(key).dtype == torch.float32 and torch.equal(f.get_tensor(key), exported[key]), key


def test_a_small_max_shard_size_writes_shards_and_an_index_that_transformers_loads(tmp_path: Path) -> None:
    make, unit = MODELS["llama"]
    torch.manual_seed(0)
    model = make()
    chain, params = sw.functionalize(model, units=_unit(unit), example_input=torch.zeros(2, SEQ, dtype=torch.long))
    step = sw.shard_params(sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    (tmp_path / "model.safetensors").write_bytes(b"an earlier single-file save")  # replaced by the shards
    exported = sw.launch(functools.partial(_train_and_export, step, params, sw.Mesh(dp=2), tmp_path,
                                           max_shard_size="20KB", config=model.config), 2)[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    stored = _files(tmp_path)
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(
        torch.Size(shape).numel() * 4 for shape, _ in stored.values())  # float32
    for shard in shards:  # none past the limit, but a tensor larger than it alone
        with safe_open(tmp_path / shard, "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118
        assert len(sizes) == 1 or sum(torch.Size(s).numel() * 4 for s in sizes) <= 20_000
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in exported.items())


def test_no_rank_holds_more_than_one_layer_gathered(tmp_path: Path, gathers_alive: Any) -> None:
    """ZeRO-3 over 2 ranks, 6 layers: when a rank gathers a layer, nothing it gathered before is alive
    (a whole-model gather, as full_params, keeps every unit: this fails for it)."""
    seen = gathers_alive(state_layout)
    model = _tiny_gpt(layers=6)
    chain, params = sw.functionalize(model, units=Block)
    assert len(chain) == 6
    step = sw.shard_params(sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1)), "dp", stage=3)

    def export_then_read() -> tuple[int, int, dict[str, torch.Tensor]]:
        state = step.init(params, sw.Mesh(dp=2))
        for batch in _batches():
            state, _ = step(state, batch)
        sw.checkpoint.save_pretrained(step, state, tmp_path)
        rank = threading.current_thread().name  # the export's gathers, before full_state_dict's (which keeps all)
        most, count = seen.most.get(rank, 0), seen.count[rank]
        return most, count, sw.checkpoint.full_state_dict(step, state)

    results = sw.launch(export_then_read, 2)
    assert [count for _, count, _ in results] == [len(chain)] * 2, results
    assert [most for most, _, _ in results] == [0, 0]
    exported = results[0][2]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert all(torch.equal(f.get_tensor(k), exported[k]) for k in f.keys())  # noqa: SIM118


def _sgd_zero3_gpt2() -> tuple[sw.Step, Any, Any]:
    torch.manual_seed(0)
    model = _gpt2()
    chain, params = sw.functionalize(model, units=_unit(MODELS["gpt2 tied"][1]),
                                     example_input=torch.zeros(2, SEQ, dtype=torch.long))
    step = sw.shard_params(sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    return step, params, model.config


def test_a_writer_failing_mid_export_stops_every_rank_and_leaves_the_last_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step, params, config = _sgd_zero3_gpt2()
    out = tmp_path / "out"
    before = sw.launch(functools.partial(_train_and_export, step, params, sw.Mesh(dp=2), out, max_shard_size="50KB",
                                         config=config), 2)[0]
    files_before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(files_before) > 2  # shards and the index
    real, written = safetensors_writer.write_tensor, []

    def failing(f: Any, tensor: torch.Tensor) -> None:
        if len(written) == 2:
            raise OSError(28, "No space left on device")
        written.append(tensor)
        real(f, tensor)

    monkeypatch.setattr(safetensors_writer, "write_tensor", failing)
    errors: list[str] = []

    def export_more() -> None:
        state = step.init(params, sw.Mesh(dp=2))
        state, _ = step(state, _batches(1)[0])
        try:
            sw.checkpoint.save_pretrained(step, state, out, max_shard_size="50KB")
        except CheckpointError as err:
            errors.append(str(err))

    sw.launch(export_more, 2)
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert "failed on rank 0 (the writer): OSError: [Errno 28] No space left on device" in errors[0]
    assert errors[0].endswith(f"the files in {out} are as they were")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files_before  # no staging left, nothing replaced
    loaded = T.GPT2LMHeadModel.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in before.items())


def test_a_rank_failing_inside_a_gather_stops_every_rank_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank out of memory for a gathered layer, the others in the gather: the failure propagates with
    its cause, as in a step (it went to the agreement instead, where the others were in the gather: a
    collective mismatch that named neither), and the writer's staging files are removed."""
    step, params, config = _sgd_zero3_gpt2()
    out = tmp_path / "out"
    sw.launch(functools.partial(_train_and_export, step, params, sw.Mesh(dp=2), out, config=config), 2)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = state_layout.all_gather, collections.Counter()

    def out_of_memory_on_rank_1(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        rank = threading.current_thread().name
        calls[rank] += 1
        if rank.endswith("1") and calls[rank] == 3:
            raise torch.OutOfMemoryError("no memory for the gathered layer")
        return real(x, *args, **kw)

    monkeypatch.setattr(state_layout, "all_gather", out_of_memory_on_rank_1)
    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1 failed: OutOfMemoryError: no memory for the gathered"):
        sw.launch(lambda: sw.checkpoint.save_pretrained(step, step.init(params, sw.Mesh(dp=2)), out), 2, timeout=60)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no staging left, nothing replaced


def test_a_directory_the_writer_cannot_use_stops_every_rank(tmp_path: Path) -> None:
    step, params, _ = _sgd_zero3_gpt2()
    (tmp_path / "a file").write_text("not a directory")
    with pytest.raises(sw.collectives.RankFailed, match=r"a file is a file; pass a directory"):
        sw.launch(functools.partial(_train_and_export, step, params, sw.Mesh(dp=2), tmp_path / "a file"), 2)
    assert (tmp_path / "a file").read_text() == "not a directory"


@pytest.mark.parametrize(("size", "match"), [
    ("5 parsecs", r"max_shard_size='5 parsecs' is not a size"), (0, "max_shard_size=0 is not positive"),
    ("-1MB", "is not positive"), (2.5, "max_shard_size is a float"), ("infGB", "max_shard_size='infGB' is not a size"),
])
def test_a_bad_max_shard_size_is_refused_naming_it(size: Any, match: str, tmp_path: Path) -> None:
    chain, params = sw.functionalize(torch.nn.Linear(2, 2))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises((TypeError, ValueError), match=match):
        sw.checkpoint.save_pretrained(step, step.init(params), tmp_path, max_shard_size=size)


def test_an_empty_directory_name_is_refused(tmp_path: Path) -> None:
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"directory is empty"):
        sw.checkpoint.save_pretrained(step, step.init(params), "")


def test_a_directory_inside_a_staging_directory_is_refused(tmp_path: Path) -> None:
    """The next export into the parent would remove it, and the export in it with it."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"inside an export's staging directory '\.shardwise-export\.partial'"):
        sw.checkpoint.save_pretrained(step, step.init(params), tmp_path / ".shardwise-export.partial" / "x")
    assert not (tmp_path / ".shardwise-export.partial").exists()


def test_sizes_parse_as_transformers_parses_them() -> None:
    parse = functools.partial(safetensors_writer.parse_max_shard_size, "test")
    assert [parse("5GB"), parse("500MB"), parse(" 1.5kb "), parse(7)] == [5 * 10**9, 5 * 10**8, 1500, 7]


def test_a_state_of_another_step_is_refused(tmp_path: Path) -> None:
    step, params, _ = _sgd_zero3_gpt2()
    other = sw.train_step(step.base_chain, _logits_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match="save_pretrained: this TrainState was made by"):
        sw.checkpoint.save_pretrained(step, other.init(params), tmp_path)
    with pytest.raises(TypeError, match=r"save_pretrained: state is a dict, not the TrainState"):
        sw.checkpoint.save_pretrained(step, params, tmp_path)


def _export_on_gloo(directory: str, bad: str) -> tuple[dict[str, torch.Tensor], str]:
    model = _tiny_gpt()
    chain, params = sw.functionalize(model, units=Block)
    step = sw.shard_params(sw.train_step(chain, _logits_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    exported = _train_and_export(step, params, sw.Mesh(dp=2), Path(directory))
    try:
        sw.checkpoint.save_pretrained(step, step.init(params, sw.Mesh(dp=2)), bad)
    except CheckpointError as err:
        return exported, str(err)
    return exported, "no error"


@pytest.mark.gloo
def test_two_processes_export_and_both_hear_of_the_writers_failure(gloo2: Any, tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("")
    results = gloo2.run(_export_on_gloo, str(tmp_path / "out"), str(tmp_path / "a file"))
    exported = results[0][0]
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(set(exported) - {"head.weight"})
        assert all(torch.equal(f.get_tensor(k), exported[k]) for k in f.keys())  # noqa: SIM118
    assert [r[1] for r in results] == [results[0][1]] * 2 and "is a file; pass a directory" in results[0][1]


def _what_a_loader_reads(directory: Path) -> dict[str, torch.Tensor] | None:
    """The weights transformers' loader (and init_from_pretrained) reads: model.safetensors before an
    index; None where there are none, or the index names a file that is not there (a refusal)."""
    from safetensors.torch import load_file

    if (directory / "model.safetensors").is_file():
        return load_file(directory / "model.safetensors")
    if not (directory / "model.safetensors.index.json").is_file():
        return None
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    if not all((directory / name).is_file() for name in weight_map.values()):
        return None
    return {key: load_file(directory / name)[key] for key, name in weight_map.items()}


# (the earlier export's max_shard_size, this one's): shards over shards of the same names, a single file
# over shards, shards over a single file, fewer shards over more.
TRANSITIONS = {"same shard names": (100, 100), "single over shards": (100, None),
               "shards over single": (None, 100), "fewer shards": (100, 200)}


@pytest.mark.parametrize("transition", TRANSITIONS)
def test_a_crash_anywhere_in_the_final_moves_leaves_one_export_whole_or_none(
    transition: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rename and removal of the commit fails in turn (a crash there): what a loader then reads is the
    earlier export or this one, whole, or nothing; never the earlier index over this export's shards."""
    import os

    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    batch = (torch.randn(2, 4), torch.randn(2, 4))
    before = step.init(params)
    after, _ = step(step.init(params), batch)
    earlier, this = TRANSITIONS[transition]
    sizes = {True: earlier, False: this}
    real_replace, real_unlink = os.replace, Path.unlink
    for crash_at in range(20):
        out = tmp_path / f"crash{crash_at}"
        sw.checkpoint.save_pretrained(step, before, out, max_shard_size=sizes[True] or "5GB")
        old = _what_a_loader_reads(out)
        def counted(real: Callable[..., Any], *args: Any, steps: list[int] = [0], at: int = crash_at,  # noqa: B006
                    **kw: Any) -> Any:
            if steps[0] == at:
                raise OSError("crashed here")
            steps[0] += 1
            return real(*args, **kw)

        monkeypatch.setattr(export.os, "replace", functools.partial(counted, real_replace))
        monkeypatch.setattr(Path, "unlink", lambda path, *a, **kw: counted(real_unlink, path, *a, **kw))
        try:
            sw.checkpoint.save_pretrained(step, after, out, max_shard_size=sizes[False] or "5GB")
            finished = True
        except CheckpointError as err:
            assert "never a mix of both" in str(err) or "crashed here" in str(err)
            finished = False
        finally:
            monkeypatch.undo()
        new = sw.checkpoint.full_state_dict(step, after)
        read = _what_a_loader_reads(out)
        assert old is not None and set(old) == set(new)
        if finished:
            assert read is not None and all(torch.equal(read[k], new[k]) for k in new)
            assert not (out / export.STAGING).exists()
            break
        assert read is None or all(torch.equal(read[k], old[k]) for k in old) or all(
            torch.equal(read[k], new[k]) for k in new), f"{transition}: a mix after a crash at step {crash_at}"
    else:
        pytest.fail("the export never finished")
    assert crash_at >= 2  # it crashed at several points before


def test_a_single_file_beside_an_index_is_read_first_as_from_pretrained_reads(tmp_path: Path) -> None:
    """Both in one directory (an export's final moves between the two): init_from_pretrained reads what
    transformers' from_pretrained reads, model.safetensors; it read the index's shards."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    first = step.init(params)
    second, _ = step(step.init(params), (torch.randn(2, 4), torch.randn(2, 4)))
    sw.checkpoint.save_pretrained(step, first, tmp_path / "sharded", max_shard_size=100)
    sw.checkpoint.save_pretrained(step, second, tmp_path / "single")
    both = tmp_path / "sharded"
    (tmp_path / "single" / "model.safetensors").rename(both / "model.safetensors")
    assert (both / "model.safetensors.index.json").is_file()
    loaded = sw.checkpoint.full_state_dict(step, sw.checkpoint.init_from_pretrained(step, both))
    single = sw.checkpoint.full_state_dict(step, second)
    assert all(torch.equal(loaded[k], single[k]) for k in single)
