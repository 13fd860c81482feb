"""Loading shard by shard: each rank reads only the bytes it keeps, and gets the same values.

Bytes are counted where the loaders open files (every read of every file, metadata
included), per rank thread. At ZeRO-3 over four ranks a rank keeps a quarter of every
parameter and of its momentum, so it reads about a quarter of the data: the bound 0.3
leaves room for the indexes and, in a shardwise checkpoint, for the 64 KiB chunks at each
end of a range that are read whole to check their crc32 (stated exactly where it matters).
The values are compared bitwise with loading whole tensors (no arithmetic is involved).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardwise as sw
from shardwise.engine.checkpoint import dcp_files, file_format, safetensors_files, weights
from shardwise.engine.checkpoint.errors import CheckpointError
from shardwise.engine.checkpoint.names import state_dict_names
from shardwise.engine.checkpoint.record_io import CHUNK_BYTES
from shardwise.engine.checkpoint.state_dict import full_state_dict, read_dcp_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
WIDTH, LAYERS = 1024, 4  # 4 MiB per layer in float32: large against a 64 KiB chunk




@pytest.fixture
def bytes_read(count_reads: Callable[..., collections.Counter[str]]) -> collections.Counter[str]:
    """Bytes each thread (a rank) reads through the loaders' ``open`` (tests/engine/conftest.py)."""
    return count_reads(file_format, safetensors_files, weights, dcp_files)


def _rank_reads(counts: collections.Counter[str], world: int) -> list[int]:
    return [counts[f"shardwise-rank-{r}"] for r in range(world)]


def _linear_step(stage: int = 3) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    return model, sw.shard_params(step, "dp", stage=stage), params


def _data_bytes(path: Path, suffix: str) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(suffix))


def _saved(path: Path, step: Any, params: Any, world: int) -> None:
    batch = (torch.randn(8, WIDTH), torch.randn(8, WIDTH))

    def main() -> None:
        state, _ = step(step.init(params, sw.Mesh(dp=world)), batch)
        sw.checkpoint.save(path, state, step)

    sw.launch(main, world)


def _states_equal(a: Any, b: Any) -> None:
    import optree

    leaves_a, leaves_b = (
        optree.tree_leaves((a.params, a.opt_state)),
        optree.tree_leaves((b.params, b.opt_state)),
    )
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert torch.equal(x, y)


def _cut_from_whole(path: Path, step: Any, state: Any, rank: int) -> Any:
    """What rank ``rank`` of a ZeRO-3 ``state`` holds, cut by its layout from the checkpoint's
    whole tensors as ``read_dcp_state_dict`` reads them (``torch.load`` of every record)."""
    whole_sd = read_dcp_state_dict(path)
    sharding = state.layout.sharding
    keys = state_dict_names(step.base_chain).param_key

    def tree(prefix: str) -> dict[str, dict[str, torch.Tensor]]:
        return {u: {n: whole_sd[f"{prefix}{keys[(u, n)]}"] for n in lay.names} for u, lay in sharding.units.items()}

    return state._replace(
        params=sharding.shards_of(tree("model."), rank),
        opt_state=state.opt_state._replace(momentum=sharding.shards_of(tree("optim.momentum."), rank)),
    )


@pytest.mark.parametrize("saved_on", [1, 4])
def test_a_zero3_rank_reads_a_quarter_of_a_checkpoint_and_loads_what_whole_reads_give(
    saved_on: int,
    tmp_path: Path,
    bytes_read: collections.Counter[str],
) -> None:
    _, step, params = _linear_step()
    _saved(tmp_path / "c", step, params, saved_on)  # saved on one rank: each record a whole tensor
    total = _data_bytes(tmp_path / "c", ".distcp")
    loaded = sw.launch(lambda: sw.checkpoint.load(tmp_path / "c", step, sw.Mesh(dp=4)), 4)
    # a quarter, the chunks at the two ends of its range of each layer and of its momentum,
    # and the JSON files (every rank reads every index)
    slack = 2 * CHUNK_BYTES * 2 * LAYERS + _data_bytes(tmp_path / "c", ".json")
    for reads in _rank_reads(bytes_read, 4):
        assert total / 4 < reads < total / 4 + slack < 0.3 * total, (reads, total)
    # the same state from whole tensors (DCP's own reader of the same files), cut by the layout
    for rank, state in enumerate(loaded):
        _states_equal(state, _cut_from_whole(tmp_path / "c", step, state, rank))


def test_records_without_chunk_checksums_are_read_whole_and_checked(tmp_path: Path) -> None:
    _, step, params = _linear_step()
    _saved(tmp_path / "c", step, params, 2)
    expected = sw.launch(lambda: sw.checkpoint.load(tmp_path / "c", step, sw.Mesh(dp=2)), 2)
    for rank in range(2):  # as saved before ranged reads
        index = json.loads((tmp_path / "c" / f"rank{rank}.json").read_text())
        index.pop("sha256")
        for record in index["records"]:
            record.pop("data_offset", None)
            record.pop("chunk_crc32s", None)
        file_format.write_json(tmp_path / "c" / f"rank{rank}.json", index)
    file_format.write_commit_marker(tmp_path / "c")
    for a, b in zip(
        expected,
        sw.launch(lambda: sw.checkpoint.load(tmp_path / "c", step, sw.Mesh(dp=2)), 2),
        strict=True,
    ):
        _states_equal(a, b)
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(sw.collectives.RankFailed, match="crc32 does not match"):
        sw.launch(lambda: sw.checkpoint.load(tmp_path / "c", step, sw.Mesh(dp=2)), 2)


def test_a_corrupt_chunk_a_rank_reads_is_refused_naming_the_file(tmp_path: Path) -> None:
    _, step, params = _linear_step()
    _saved(tmp_path / "c", step, params, 1)
    index = json.loads((tmp_path / "c" / "rank0.json").read_text())
    record = max(index["records"], key=lambda r: r["length"])
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[record["offset"] + record["data_offset"] + 3] ^= (
        0xFF  # in the first chunk, which rank 0 reads
    )
    data.write_bytes(bytes(raw))
    with pytest.raises(sw.collectives.RankFailed, match=r"__0_0\.distcp .*chunk's crc32 does not match"):
        sw.launch(lambda: sw.checkpoint.load(tmp_path / "c", step, sw.Mesh(dp=4)), 4)


def test_pretrained_safetensors_at_zero3_dp4_read_a_quarter(
    tmp_path: Path, bytes_read: collections.Counter[str]
) -> None:
    model, step, _ = _linear_step()
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        meta = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    chain, _ = sw.functionalize(meta)
    step = sw.shard_params(
        sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3
    )
    total = _data_bytes(tmp_path, ".safetensors")

    def main() -> dict:
        return full_state_dict(step, sw.checkpoint.init_from_pretrained(step, tmp_path, sw.Mesh(dp=4)))

    exported = sw.launch(main, 4)
    for reads in _rank_reads(bytes_read, 4):
        assert 0.2 * total < reads < 0.27 * total, (reads, total)
    for key, value in model.state_dict().items():
        assert torch.equal(exported[0][key], value), key


T = pytest.importorskip(
    "transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed"
)
VOCAB, HIDDEN, SEQ = 64, 32, 8


def _llama() -> Any:
    cfg = T.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    return T.LlamaForCausalLM(cfg)


def _hf_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


def _meta_llama_step() -> Any:
    with torch.device("meta"):
        model = _llama()
    block = T.models.llama.modeling_llama.LlamaDecoderLayer
    chain, _ = sw.functionalize(
        model, units=block, example_input=torch.zeros(2, SEQ, dtype=torch.long)
    )
    return sw.train_step(chain, _hf_loss, sw.optim.sgd(0.1, momentum=0.9))


STACKS = {
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", stage=3), sw.Mesh(dp=2)),
    "tp2": (lambda s: sw.tensor_parallel(s, "tp", sw.tp.llama_plan()), sw.Mesh(tp=2)),
}


@pytest.mark.parametrize("shards", ["one file", "sharded"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_an_unmodified_llama_loads_shard_by_shard_as_saved(
    stack: str, shards: str, tmp_path: Path, bytes_read: collections.Counter[str]
) -> None:
    torch.manual_seed(0)
    real = _llama()
    real.save_pretrained(tmp_path, max_shard_size="20KB" if shards == "sharded" else "5GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards == "sharded")
    transform, mesh = STACKS[stack]
    step = transform(_meta_llama_step())

    def main() -> dict:
        return full_state_dict(step, sw.checkpoint.init_from_pretrained(step, tmp_path, mesh))

    expected = real.state_dict()
    for exported in sw.launch(main, mesh.size):
        assert set(exported) == set(expected)
        for key, value in expected.items():
            assert torch.equal(exported[key], value), key
    total = _data_bytes(tmp_path, ".safetensors")
    for reads in _rank_reads(bytes_read, mesh.size):
        assert reads < 0.75 * total, (
            reads,
            total,
        )  # half of every split tensor, plus the replicated norms


def test_a_dcp_checkpoint_of_a_module_loads_chunk_by_chunk(tmp_path: Path) -> None:
    torch.manual_seed(0)
    real = _llama()
    dcp.save({"model": real.state_dict()}, checkpoint_id=tmp_path / "d", no_dist=True)
    step = sw.shard_params(_meta_llama_step(), "dp", stage=3)

    def main() -> dict:
        return full_state_dict(
            step, sw.checkpoint.init_from_dcp(step, tmp_path / "d", sw.Mesh(dp=2), prefix="model.")
        )

    for exported in sw.launch(main, 2):
        for key, value in real.state_dict().items():
            assert torch.equal(exported[key], value), key


def test_a_dcp_directory_saved_sharded_is_read_a_share_per_rank(
    tmp_path: Path, bytes_read: collections.Counter[str]
) -> None:
    _, step, params = _linear_step()
    _saved(tmp_path / "c", step, params, 4)  # a shardwise checkpoint is a DCP directory too
    total = _data_bytes(tmp_path / "c", ".distcp")
    states = sw.launch(
        lambda: sw.checkpoint.init_from_dcp(step, tmp_path / "c", sw.Mesh(dp=4), prefix="model."), 4
    )
    for reads in _rank_reads(bytes_read, 4):
        assert reads < 0.3 * total, (
            reads,
            total,
        )  # only the parameters' chunks, and of those its own
    expected = sw.launch(lambda: sw.checkpoint.load(tmp_path / "c", step, sw.Mesh(dp=4)).params, 4)
    for state, held in zip(states, expected, strict=True):
        for unit, shard in held.items():
            assert torch.equal(state.params[unit], shard), unit


def _pretrained(tmp_path: Path, edit: Any) -> tuple[Any, Path]:
    model, _, _ = _linear_step()
    sd = dict(model.state_dict())
    edit(sd)
    save_file(sd, tmp_path / "model.safetensors")
    with torch.device("meta"):
        meta = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    chain, _ = sw.functionalize(meta)
    return sw.shard_params(
        sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3
    ), tmp_path


def test_a_missing_tensor_is_refused_naming_its_key(tmp_path: Path) -> None:
    step, path = _pretrained(tmp_path, lambda sd: sd.pop("2.bias"))
    with pytest.raises(CheckpointError, match=r"missing \['2\.bias'\], unexpected \[\]"):
        sw.checkpoint.init_from_pretrained(step, path, sw.Mesh(dp=1))


def test_a_mis_shaped_tensor_is_refused_naming_its_key(tmp_path: Path) -> None:
    step, path = _pretrained(
        tmp_path, lambda sd: sd.update({"1.weight": torch.zeros(WIDTH, WIDTH - 1)})
    )
    with pytest.raises(
        CheckpointError, match=r"'1\.weight' has shape \[1024, 1023\], the model's params\['1'\]"
    ):
        sw.checkpoint.init_from_pretrained(step, path, sw.Mesh(dp=1))


def test_an_unexpected_tensor_is_refused_naming_its_key(tmp_path: Path) -> None:
    step, path = _pretrained(tmp_path, lambda sd: sd.update({"extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected \['extra\.weight'\]"):
        sw.checkpoint.init_from_pretrained(step, path, sw.Mesh(dp=1))


def test_a_shard_file_the_index_names_but_the_directory_lacks_is_refused_naming_it(tmp_path: Path) -> None:
    """A cut-short copy of a sharded save: was a bare FileNotFoundError from deep in the reader."""
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path, max_shard_size="20KB")
    last = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json names \['{last.name}'\], which are not there"):
        sw.checkpoint.init_from_pretrained(_meta_llama_step(), tmp_path)


def test_an_integer_tensor_for_a_floating_point_parameter_is_refused_naming_its_key(tmp_path: Path) -> None:
    """Int8 codes under a weight's own name (a quantized save) were cast to the master dtype and trained on."""
    step, path = _pretrained(tmp_path, lambda sd: sd.update({"1.weight": torch.ones(WIDTH, WIDTH, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=r"'1\.weight' is stored as torch\.int8, the model's params\['1'\]"):
        sw.checkpoint.init_from_pretrained(step, path, sw.Mesh(dp=1))
