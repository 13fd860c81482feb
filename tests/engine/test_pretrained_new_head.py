"""A fine-tune's start: a model with a new head from its backbone's weights (checkpoint/new_and_unused.py).

``BertForSequenceClassification.from_pretrained`` of a ``BertForMaskedLM`` save initializes ``classifier.*`` and
``bert.pooler.*`` and drops ``cls.*``. A start here refused it (missing and unexpected keys), and a model built on
the meta device had no other way to start from those weights. ``new=`` and ``unused=`` name them; the rest is
read as before, and every rank makes the new tensors from the model's initializer as ``step.init`` makes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import shardwise as sw
from shardwise.engine.checkpoint.errors import CheckpointError

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

NEW, UNUSED = ["bert.pooler.*", "classifier.*"], ["cls.*"]
HEAD = ("bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias")


def _config() -> Any:
    return T.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 1])


def _loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, labels)


@pytest.fixture(scope="module", autouse=True)
def float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture(scope="module")
def mlm_save(float64: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlm")
    torch.manual_seed(0)
    T.BertForMaskedLM(_config()).save_pretrained(path)
    return path


def _step(meta: bool = True) -> Any:
    with torch.device("meta" if meta else "cpu"):
        model = T.BertForSequenceClassification(_config())
    chain, params = sw.functionalize(model, example_input=_batch()[0])
    return sw.train_step(chain, _loss, sw.optim.sgd(0.1)), params


def test_without_new_and_unused_the_mismatch_is_refused_naming_them(mlm_save: Path) -> None:
    step, _ = _step()
    with pytest.raises(CheckpointError, match=r"missing \['bert.pooler.dense.bias'.*unexpected \['cls.predictions"
                                              r".*pass new=\['bert.pooler.\*', 'classifier.\*'\] and "
                                              r"unused=\['cls.\*'\]"):
        sw.checkpoint.init_from_pretrained(step, mlm_save)


def test_the_backbone_is_read_and_the_head_made_as_step_init_makes_it(mlm_save: Path) -> None:
    step, params = _step()
    state = sw.checkpoint.init_from_pretrained(step, mlm_save, new=NEW, unused=UNUSED)
    got = sw.checkpoint.full_state_dict(step, state)
    reference = T.BertForSequenceClassification.from_pretrained(mlm_save, dtype=torch.float64).state_dict()
    backbone = [k for k in reference if k not in HEAD]
    assert len(backbone) > 30 and all(torch.equal(got[k], reference[k]) for k in backbone)
    made = sw.checkpoint.full_state_dict(step, step.init(params, seed=0))  # the meta build's own init
    assert all(torch.equal(got[k], made[k]) for k in HEAD)
    assert 0.01 < float(got["classifier.weight"].std()) < 0.04 and not got["classifier.bias"].any()
    other = sw.checkpoint.full_state_dict(step, sw.checkpoint.init_from_pretrained(
        step, mlm_save, seed=1, new=NEW, unused=UNUSED))
    assert not torch.equal(other["classifier.weight"], got["classifier.weight"])  # seeded, not fixed


def test_a_step_from_there_is_torchs_step_on_the_same_weights(mlm_save: Path) -> None:
    step, _ = _step()
    state = sw.checkpoint.init_from_pretrained(step, mlm_save, new=NEW, unused=UNUSED)
    start = sw.checkpoint.full_state_dict(step, state)
    model = T.BertForSequenceClassification.from_pretrained(mlm_save, dtype=torch.float64)
    model.load_state_dict({k: start[k] for k in model.state_dict()})
    ids, labels = _batch()
    loss = _loss(model(ids), labels)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    state, metrics = step(state, (ids, labels))
    assert float(metrics["loss"]) == pytest.approx(loss.item(), rel=1e-12)
    after = sw.checkpoint.full_state_dict(step, state)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(after[k], v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout", ["zero3 dp2", "zero1 dp2 x pp2"])
def test_every_mesh_starts_from_the_same_head_and_trains_as_one_device(mlm_save: Path, layout: str) -> None:
    step, _ = _step()
    one = sw.checkpoint.init_from_pretrained(step, mlm_save, new=NEW, unused=UNUSED)
    want = sw.checkpoint.full_state_dict(step, step(one, _batch())[0])
    if layout == "zero3 dp2":
        split, mesh = sw.shard_params(step, "dp", stage=3), sw.Mesh(dp=2)
    else:
        with torch.device("meta"):
            model = T.BertForSequenceClassification(_config())
        chain, _ = sw.functionalize(model, units=T.models.bert.modeling_bert.BertLayer, example_input=_batch()[0])
        base = sw.train_step(chain, _loss, sw.optim.sgd(0.1))
        split, mesh = sw.shard_params(sw.pipeline(base, "pp", "1f1b", 2), "dp", stage=1), sw.Mesh(dp=2, pp=2)

    def rank() -> dict[str, torch.Tensor]:
        state = sw.checkpoint.init_from_pretrained(split, mlm_save, mesh, new=NEW, unused=UNUSED)
        return sw.checkpoint.full_state_dict(split, split(state, _batch())[0])

    got = sw.launch(rank, mesh.size)[0]
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)


def test_an_eager_model_is_refused_naming_the_meta_build(mlm_save: Path) -> None:
    step, _ = _step(meta=False)
    with pytest.raises(CheckpointError, match=r"cannot make: it was built eagerly.*meta device.*from_pretrained"):
        sw.checkpoint.init_from_pretrained(step, mlm_save, new=NEW, unused=UNUSED)


@pytest.mark.parametrize("new, unused, message", [
    (["classifer.*", "bert.pooler.*"], UNUSED,
     r"new= names 'classifer.\*', which matches none of the missing \(or mis-shaped\) keys"),
    ([*NEW, "bert.embeddings.*"], UNUSED,
     r"new= names 'bert.embeddings.\*', which matches none.*is read: drop 'bert.embeddings.\*'"),
    (NEW, ["cls.predictions.bias"], r"missing \[\], unexpected \['cls.predictions.transform"),
    (NEW, ["lm_head.*"], r"unused= names 'lm_head.\*', which matches none of the unexpected keys"),
])
def test_a_pattern_that_names_nothing_missing_or_unexpected_is_refused(
        mlm_save: Path, new: list[str], unused: list[str], message: str) -> None:
    step, _ = _step()
    with pytest.raises(CheckpointError, match=message):
        sw.checkpoint.init_from_pretrained(step, mlm_save, new=new, unused=unused)


@pytest.mark.parametrize("value", [5, [""], ["classifier.*", 3], {"classifier.*": 1}])
def test_new_and_unused_must_be_patterns(mlm_save: Path, value: Any) -> None:
    step, _ = _step()
    with pytest.raises(TypeError, match=r"init_from_pretrained: new=.* is not a list of state_dict keys or fnmatch"):
        sw.checkpoint.init_from_pretrained(step, mlm_save, new=value)


def test_a_file_of_another_model_is_not_advised_new(tmp_path: Path) -> None:
    torch.manual_seed(0)
    T.GPT2Model(T.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    step, _ = _step()
    with pytest.raises(CheckpointError, match=r"load the weights of the model this step was built from$"):
        sw.checkpoint.init_from_pretrained(step, tmp_path)


def test_init_from_dcp_takes_new_a_mis_shaped_layer_and_a_frozen_new_one_is_made(tmp_path: Path) -> None:
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    dcp.save({"model": backbone.state_dict()}, checkpoint_id=str(tmp_path))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2),
                                    torch.nn.Linear(2, 2))
    model[3].weight.requires_grad_(False)
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(CheckpointError, match=r"pass new=\['3.\*'\]$"):
        sw.checkpoint.init_from_dcp(step, tmp_path, prefix="model.", new=["2.*"])
    with pytest.raises(CheckpointError, match=r"'2.weight' has shape \[8, 8\], the model's params\['2'\]\['weight'\]"
                                              r".*pass new=\['2.weight'\]"):
        sw.checkpoint.init_from_dcp(step, tmp_path, prefix="model.", new=["3.*"])
    # 2.* is stored as Linear(8, 8)'s: named new, it is made (ignore_mismatched_sizes), its stored tensors unread
    state = sw.checkpoint.init_from_dcp(step, tmp_path, prefix="model.", new=["2.*", "3.*"])
    got = sw.checkpoint.full_state_dict(step, state)
    assert torch.equal(got["0.weight"], backbone[0].weight) and torch.equal(got["0.bias"], backbone[0].bias)
    made = sw.checkpoint.full_state_dict(step, step.init(params))
    assert torch.equal(got["2.weight"], made["2.weight"])
    assert torch.equal(chain.layers[3].buffers["weight"], chain.init.tensor("3.weight", 0))
