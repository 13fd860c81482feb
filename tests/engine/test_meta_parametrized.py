"""A parametrized tensor of a model built on the meta device (engine/model/parametrized_init.py).

A meta-built Wav2Vec2 (its positional convolution is under ``weight_norm``) failed in ``step.init`` with torch's
"weight_norm: expected v_in and g_in to be on the same device, but v_in is on meta": each original was made
alone, beside its meta sibling. The originals are made as the eager module holds them: from the tensor its
constructor's ``reset_parameters()`` made, by the parametrization's ``right_inverse``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import shardwise as sw
from shardwise.engine.model.materialize import path_seed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model() -> nn.Module:
    return nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 2))


def test_weight_norms_originals_are_the_eager_constructors_under_the_tensors_seed() -> None:
    with torch.device("meta"):
        empty = _model()
    chain, params = sw.functionalize(empty)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    made = step.init(params, seed=3).params["0"]
    torch.manual_seed(path_seed(3, "0.weight"))  # the eager constructor, drawing the weight from that seed
    eager = weight_norm(nn.Linear(4, 6))
    for name in ("parametrizations.weight.original0", "parametrizations.weight.original1"):
        assert torch.equal(made[name], eager.get_parameter(name)), name
    assert not torch.equal(made["parametrizations.weight.original1"], step.init(params, seed=4).params["0"][
        "parametrizations.weight.original1"])


def test_a_parametrized_module_without_reset_parameters_is_refused_naming_it() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

        def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
            return w / 2

    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(3, 3), Scale())
    parametrize.register_parametrization(empty[1], "weight", Double())
    chain, params = sw.functionalize(empty, init_fn=lambda module: None)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(sw.FunctionalizeError, match=r"'1.weight' is parametrized \(Double\), and its Scale has no "
                                                   r"reset_parameters\(\).*init_from_pretrained"):
        step.init(params)


@pytest.fixture
def float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_a_meta_built_wav2vec2_starts_and_trains_alike_on_every_mesh(float64: None) -> None:
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    config = T.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, final_dropout=0.0)
    with torch.device("meta"):
        empty = T.Wav2Vec2ForCTC(config)
    g = torch.Generator().manual_seed(1)
    inputs = {"input_values": torch.randn(4, 400, generator=g)}
    targets = torch.randn(4, 24, 12, generator=g)
    chain, params = sw.functionalize(empty, example_input=inputs)
    step = sw.train_step(chain, lambda out, y: F.mse_loss(out.logits, y), sw.optim.sgd(0.1))
    state = step.init(params)
    full = sw.checkpoint.full_state_dict(step, state)
    prefix = "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight."
    g0, v = full[prefix + "original0"], full[prefix + "original1"]
    assert torch.equal(g0, v.norm(dim=(0, 1), keepdim=True))  # weight_norm's g of the v made
    bound = 1 / math.sqrt(v.shape[1] * v.shape[2])  # Conv1d's reset_parameters: kaiming_uniform(a=sqrt(5))
    assert v.abs().max() <= bound and v.std() > bound / 3
    want = sw.checkpoint.full_state_dict(step, step(state, (inputs, targets))[0])
    zero3 = sw.shard_params(step, "dp", stage=3)

    def rank() -> dict[str, torch.Tensor]:
        state = zero3.init(params, sw.Mesh(dp=2))
        return sw.checkpoint.full_state_dict(zero3, zero3(state, (inputs, targets))[0])

    got = sw.launch(rank, 2)[0]
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)


def test_a_parametrization_stacked_on_another_keeps_the_firsts_originals() -> None:
    """The review: torch appends a second parametrization without its right_inverse (the originals stay weight_norm's
    of the constructor's weight); applying every right_inverse made them 0.5x the eager model's, without an error."""

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

        def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
            return w / 2

    def build() -> nn.Module:
        model = nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 2))
        parametrize.register_parametrization(model[0], "weight", Double())
        return model

    with torch.device("meta"):
        empty = build()
    chain, params = sw.functionalize(empty)
    made = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)).init(params, seed=3).params["0"]
    torch.manual_seed(path_seed(3, "0.weight"))
    eager = build()[0]
    for name in ("parametrizations.weight.original0", "parametrizations.weight.original1"):
        assert torch.equal(made[name], eager.get_parameter(name)), name
