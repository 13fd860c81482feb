"""A tied weight stored under both its names: equal copies load, differing ones are refused.

TinyGPT ties ``head.weight`` to ``tok_emb.weight``. ``save_pretrained`` stores one name, a torch
``state_dict`` (and ``dcp.save`` of it) both, holding one tensor. A file whose two copies differ
(an untied fine-tune's weights) was loaded by ``init_from_pretrained`` and ``init_from_dcp``
from its first copy, the other's values silently dropped; ``init_from_state_dict`` refused it.
Now all three refuse, on every rank alike even where only the last rank's share of the elements
differs, while each rank reads only its share of each copy. Values are compared bitwise with the
file (no arithmetic is involved).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardwise as sw
from shardwise.engine.checkpoint import dcp_files, safetensors_files
from shardwise.engine.checkpoint.errors import CheckpointError
from shardwise.testing.models import CausalSelfAttention, TinyGPT

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
VOCAB, WIDTH, SEQ = 512, 32, 8


def _gpt() -> TinyGPT:
    return TinyGPT(vocab=VOCAB, d_model=WIDTH, n_heads=2, n_layers=2, seq_len=SEQ).double()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _causal_mask(module: torch.nn.Module) -> None:
    """The only tensor functionalize makes (the parameters are read from the file)."""
    if isinstance(module, CausalSelfAttention):
        module.mask.copy_(torch.ones_like(module.mask).tril())


def _meta_step() -> Any:
    with torch.device("meta"):
        model = _gpt()
    chain, _ = sw.functionalize(model, units=["tok_emb", "blocks", "head"],
                                example_input=torch.zeros(2, SEQ, dtype=torch.long), init_fn=_causal_mask)
    return sw.shard_params(sw.train_step(chain, _loss, sw.optim.sgd(0.1)), "dp", stage=3)


def _write(tmp_path: Path, source: str, state_dict: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """The file written as ``source`` (safetensors, or DCP as ``dcp.save({"model": sd})``) and the
    loader of it: ``load(step, mesh)``."""
    sd = {k: v.detach().clone().contiguous() for k, v in state_dict.items()}
    if source == "safetensors":
        save_file(sd, tmp_path / "model.safetensors")
        return lambda step, mesh: sw.checkpoint.init_from_pretrained(step, tmp_path, mesh)
    dcp.save({"model": sd}, checkpoint_id=tmp_path / "d", no_dist=True)
    return lambda step, mesh: sw.checkpoint.init_from_dcp(step, tmp_path / "d", mesh, prefix="model.")


def _state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return dict(_gpt().state_dict())  # both names, one tensor


def _refusal(load: Callable[..., Any], world: int) -> list[str]:
    """Each rank's refusal of the load (every rank must refuse, alike)."""
    step = _meta_step()

    def main() -> str:
        with pytest.raises(CheckpointError) as refused:
            load(step, sw.Mesh(dp=world))
        return str(refused.value)

    return sw.launch(main, world)


@pytest.mark.parametrize("source", ["safetensors", "dcp"])
def test_differing_copies_of_a_tied_weight_are_refused_on_every_rank_naming_both(source: str, tmp_path: Path) -> None:
    sd = _state_dict()
    sd["head.weight"] = sd["tok_emb.weight"].clone()
    sd["head.weight"][-1, -1] += 1.0  # in the last rank's share only
    load = _write(tmp_path, source, sd)
    for world in (1, 2):
        refusals = _refusal(load, world)
        assert len(set(refusals)) == 1, refusals
        assert "'head.weight' is tied to 'tok_emb.weight' in the module" in refusals[0]
        assert "their values differ" in refusals[0] and "tie_word_embeddings=False" in refusals[0]
        assert "keep one copy (drop 'head.weight'" in refusals[0]


def test_copies_of_another_shape_are_refused_naming_both(tmp_path: Path) -> None:
    sd = _state_dict()
    sd["head.weight"] = sd["tok_emb.weight"][:-1].clone()
    (refusal,) = _refusal(_write(tmp_path, "safetensors", sd), 1)
    assert "'head.weight' is tied to 'tok_emb.weight'" in refusal and f"[{VOCAB - 1}, {WIDTH}]" in refusal


@pytest.mark.parametrize("stored", ["both equal", "tok_emb only", "head only"])
@pytest.mark.parametrize("source", ["safetensors", "dcp"])
def test_a_tied_weight_stored_once_or_as_equal_copies_loads_as_stored(
    source: str, stored: str, tmp_path: Path
) -> None:
    sd = _state_dict()
    dropped = {"both equal": None, "tok_emb only": "head.weight", "head only": "tok_emb.weight"}[stored]
    load = _write(tmp_path, source, {k: v for k, v in sd.items() if k != dropped})
    step = _meta_step()
    for exported in sw.launch(lambda: sw.checkpoint.full_state_dict(step, load(step, sw.Mesh(dp=2))), 2):
        assert set(exported) == set(sd)
        for key, value in sd.items():
            assert torch.equal(exported[key], value), key


@pytest.fixture
def bytes_read(count_reads: Callable[..., collections.Counter[str]]) -> collections.Counter[str]:
    """Bytes each thread (a rank) reads through the safetensors reader's ``open``. (tests/engine/conftest.py)"""
    return count_reads(safetensors_files, dcp_files)


def test_comparing_the_copies_reads_each_ranks_share_of_them(
    tmp_path: Path, bytes_read: collections.Counter[str]
) -> None:
    """Against the same file with one copy, a rank reads its quarter of each of the two copies more."""
    sd = _state_dict()
    world, step = 4, _meta_step()
    reads = {}
    for stored in ("once", "twice"):
        path = tmp_path / stored
        path.mkdir()
        load = _write(path, "safetensors", sd if stored == "twice" else {k: v for k, v in sd.items()
                                                                         if k != "head.weight"})
        bytes_read.clear()
        sw.launch(lambda load=load: load(step, sw.Mesh(dp=world)), world)
        reads[stored] = [bytes_read[f"shardwise-rank-{r}"] for r in range(world)]
    share = 2 * sd["tok_emb.weight"].numel() * 8 // world
    for once, twice in zip(reads["once"], reads["twice"], strict=True):
        assert share <= twice - once <= share + 256, (once, twice, share)  # + the header's one more entry
