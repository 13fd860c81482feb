"""Weights on disk load shard by shard: each rank reads its own bytes and nothing else of any size.

An unmodified Hugging Face Llama (random, saved here) is loaded into a meta-built step at ZeRO-3
dp 2, ZeRO-3 dp 2 x pp 2 and tp 2, from the safetensors files ``save_pretrained`` writes and from
a DCP directory ``torch.distributed.checkpoint.save`` writes (on one rank: one record per tensor,
so reading by records would read everything). Bytes are counted at every read of the files
the loaders open, per rank thread. What a rank keeps is counted from its state (its flat shards
without padding, or its slices): it must read exactly that, plus what says where things are (the
safetensors headers; DCP's ``.metadata`` and, per record it reads, its zip directory and pickle,
under 1.5 KiB each). The values equal, bitwise, ``step.init`` of the whole tensors
(``init_from_state_dict``): no arithmetic is involved.
"""

from __future__ import annotations

import collections
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.engine.checkpoint import dcp_files, file_format, safetensors_files, weights
from shardwise.engine.checkpoint.record_io import CHUNK_BYTES

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

VOCAB, HIDDEN, SEQ = 512, 128, 8
RECORD_OVERHEAD = 1536  # a DCP record's zip directory, local headers and pickle


def _llama() -> Any:
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    ))


def _loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


def _meta_step() -> sw.Step:
    with torch.device("meta"):
        model = _llama()
    chain, _ = sw.functionalize(model, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                example_input=torch.zeros(2, SEQ, dtype=torch.long))
    return sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9))


STACKS: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", stage=3), sw.Mesh(dp=2)),
    "zero3 dp2 x pp2": (lambda s: sw.shard_params(sw.pipeline(s, "pp", "1f1b", 2), "dp", stage=3),
                        sw.Mesh(dp=2, pp=2)),
    "tp2": (lambda s: sw.tensor_parallel(s, "tp", sw.tp.llama_plan()), sw.Mesh(tp=2)),
}




@pytest.fixture
def bytes_read(count_reads: Callable[..., collections.Counter[str]]) -> collections.Counter[str]:
    """Bytes each thread (a rank) reads through the loaders' ``open``. (tests/engine/conftest.py)"""
    return count_reads(file_format, safetensors_files, weights, dcp_files)


def _kept_bytes(state: Any, mesh: sw.Mesh) -> int:
    """Bytes of the parameters this rank keeps (float32 on disk and at rest): its flat shards
    without their padding, or its slices."""
    sharding = state.layout.sharding
    if sharding is None:
        return sum(t.numel() * 4 for t in optree.tree_leaves(state.params))
    dp = mesh.axis_index(sharding.axis)
    return sum(min(lay.shard_numel, max(lay.numel - dp * lay.shard_numel, 0)) * 4
               for lay in sharding.units.values())


def _save(source: str, model: Any, root: Path) -> tuple[Path, int, int]:
    """(where, bytes of tensor data, bytes read whatever is kept), the weights saved as ``source``."""
    if source == "safetensors":
        model.save_pretrained(root, max_shard_size="600KB")  # sharded: an index and several files
        files = list(root.glob("*.safetensors"))
        headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
        index = (root / "model.safetensors.index.json").stat().st_size
        return root, sum(f.stat().st_size for f in files) - headers, headers + index
    dcp.save({"model": model.state_dict()}, checkpoint_id=root / "d", no_dist=True)
    records = len(model.state_dict())
    data = sum(f.stat().st_size for f in (root / "d").glob("*.distcp"))
    return root / "d", data, (root / "d" / ".metadata").stat().st_size + records * RECORD_OVERHEAD


@pytest.mark.parametrize("source", ["safetensors", "dcp"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_each_rank_reads_the_bytes_it_keeps_and_gets_the_whole_loads_values(
    source: str, stack: str, tmp_path: Path, bytes_read: collections.Counter[str]
) -> None:
    torch.manual_seed(0)
    real = _llama()
    path, total, overhead = _save(source, real, tmp_path)
    transform, mesh = STACKS[stack]
    step = transform(_meta_step())
    load = sw.checkpoint.init_from_pretrained if source == "safetensors" else (
        lambda s, p, m: sw.checkpoint.init_from_dcp(s, p, m, prefix="model."))

    def main() -> tuple[Any, int]:
        state = load(step, path, mesh)
        return state, _kept_bytes(state, mesh)

    loaded = sw.launch(main, mesh.size)
    reads = [bytes_read[f"shardwise-rank-{r}"] for r in range(mesh.size)]
    bytes_read.clear()
    whole = sw.launch(lambda: sw.checkpoint.init_from_state_dict(step, real.state_dict(), mesh), mesh.size)
    share = 0.3 if "pp2" in stack else 0.55  # of the data: a quarter (half, at dp 2 or tp 2), and the norms
    for (state, kept), read, expected in zip(loaded, reads, whole, strict=True):
        assert kept <= read <= kept + overhead, (read, kept, overhead)
        assert read < share * total, (read, total)
        for a, b in zip(optree.tree_leaves((state.params, state.opt_state)),
                        optree.tree_leaves((expected.params, expected.opt_state)), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _load_weights(source: str, width: int, layers: int, world: int) -> dict[str, int] | None:
    """On rank 0 of the suite's LIVE_MALLOC ranks (the others wait): save the model, then load it
    at ZeRO-3 over ``world`` thread ranks; the process's peak above the start of the load, and
    what the ranks hold."""
    if current_backend().rank != 0:
        return None
    import tempfile

    from safetensors.torch import save_file
    from torch import nn

    from shardwise.testing.memory import PeakRSS

    def model(w: int) -> nn.Sequential:
        return nn.Sequential(*[nn.Linear(w, w) for _ in range(layers)])

    def load(root: str, w: int) -> tuple[int, int]:
        path = f"{root}/{w}"
        if source == "safetensors":
            os.makedirs(path)
            save_file(model(w).state_dict(), f"{path}/model.safetensors")
        else:
            dcp.save({"model": model(w).state_dict()}, checkpoint_id=path, no_dist=True)
        with torch.device("meta"):
            chain, _ = sw.functionalize(model(w))
        step = sw.shard_params(sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)
        meter = PeakRSS()
        if source == "safetensors":
            states = sw.launch(lambda: sw.checkpoint.init_from_pretrained(step, path, sw.Mesh(dp=world)), world)
        else:
            states = sw.launch(
                lambda: sw.checkpoint.init_from_dcp(step, path, sw.Mesh(dp=world), prefix="model."), world)
        return meter.peak(), sum(t.numel() * t.element_size() for s in states for t in s.params.values())

    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as root:
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        load(root, 8)  # warm-up: the same code on a tiny model (imports, thread pool)
        peak, held = load(root, width)
    return {"peak": peak, "held": held}


@pytest.mark.gloo  # on the suite's LIVE_MALLOC gloo ranks
@pytest.mark.parametrize("source", ["safetensors", "dcp"])
def test_loading_weights_holds_the_ranks_shards_and_no_whole_layer(source: str, live_malloc_gloo4: Any) -> None:
    """Four thread ranks of one process load 8 x Linear(1024) at ZeRO-3: the process's peak above
    the start of the load is the four ranks' shards (the whole model, once) and less than half a
    layer more. Reading through a whole layer's tensor per rank (or a whole record) is over it."""
    width, layers, world = 1024, 8, 4
    layer = (width * width + width) * 4
    measured = live_malloc_gloo4.run(_load_weights, source, width, layers, world)[0]
    assert measured["held"] >= layers * layer  # every rank's shards: the model once, padded
    assert 0.9 * measured["held"] < measured["peak"] < measured["held"] + layer // 2, measured


def test_a_dcp_record_is_read_in_part_where_row_major_and_whole_where_not(tmp_path: Path) -> None:
    """A record whose tensor is not row-major in its storage (DCP saves a transposed view as it is)
    is read whole and loaded as DCP's reader does; the others by byte ranges. Both give the values."""
    base = torch.arange(40.0).view(8, 5)
    saved = {"rows": base[2:6], "transposed": base.t(), "plain": torch.arange(12.0).view(3, 4)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    files = dcp_files.DcpFiles(tmp_path)
    for key, value in saved.items():
        out = torch.full(tuple(value.shape), float("nan"))
        rows, cols = value.shape
        files.read_into(key, [(((1, 1), (rows - 1, cols - 2)), out[1:, 1:-1])])
        assert torch.equal(out[1:, 1:-1], value[1:, 1:-1]), key
        assert out[0].isnan().all() and out[:, 0].isnan().all() and out[:, -1].isnan().all(), key


def test_a_record_that_is_not_one_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    dcp.save({"w": torch.zeros(4, 4)}, checkpoint_id=tmp_path, no_dist=True)
    data = next(tmp_path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    data.write_bytes(bytes(len(raw)))  # zeros: no zip directory
    with pytest.raises(sw.checkpoint.CheckpointError, match=r"the chunk of w in .* is not a torch.save record"):
        dcp_files.DcpFiles(tmp_path).read_into("w", [(((0, 0), (4, 4)), torch.empty(4, 4))])


def test_a_checkpoint_saved_on_one_rank_loads_at_dp2_x_pp2_a_quarter_per_rank(
    tmp_path: Path, bytes_read: collections.Counter[str]
) -> None:
    """``checkpoint.load`` of a one-rank save at ZeRO-3 dp 2 x pp 2: each rank keeps a quarter of
    every parameter and of its momentum (its stage's layers, its flat shard of each), and reads
    that, the 64 KiB chunks at the two ends of each range it reads (read whole, for their crc32s)
    and the indexes. Saved again from there and loaded on one rank, the state is the saved one,
    bitwise."""
    width, layers = 1024, 4
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    one = sw.shard_params(base, "dp", stage=3)
    split = sw.shard_params(sw.pipeline(base, "pp", "1f1b", 2), "dp", stage=3)
    mesh, alone = sw.Mesh(dp=2, pp=2), sw.Mesh(dp=1)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen))

    def save_one() -> Any:
        state, _ = one(one.init(params, alone), batch)
        sw.checkpoint.save(tmp_path / "one", state, one)
        return state

    (saved,) = sw.launch(save_one, 1)
    bytes_read.clear()
    sw.launch(lambda: sw.checkpoint.save(tmp_path / "again", sw.checkpoint.load(tmp_path / "one", split, mesh), split),
              4)
    reads = [bytes_read[f"shardwise-rank-{r}"] for r in range(4)]
    total = sum(f.stat().st_size for f in (tmp_path / "one").glob("*.distcp"))
    indexes = sum(f.stat().st_size for f in (tmp_path / "one").glob("*.json"))
    ends = 2 * CHUNK_BYTES * 2 * (layers // 2)  # per range: its stage's 2 layers, weights and momentum
    for read in reads:
        assert total / 4 < read < total / 4 + ends + indexes < 0.35 * total, (read, total)
    (back,) = sw.launch(lambda: sw.checkpoint.load(tmp_path / "again", one, alone), 1)
    for x, y in zip(optree.tree_leaves((back.params, back.opt_state)),
                    optree.tree_leaves((saved.params, saved.opt_state)), strict=True):
        assert torch.equal(x, y)
