"""State a layer's first call sets from its input's VALUES (engine/run/first_call_state.py): an ActNorm-style
lazy initialization, a list of batch means. torch's loop sets it from the whole batch; where the step cuts
the batch (ZeRO-1/3 over dp2, accumulation=2, a pipeline's micro-batches) each rank or micro-batch would set
it from its share (the review: 0.24% off at dp2, 0.40% at accumulation=2, a raw fake-tensor error at pp2), so
it is refused, naming the layer, the attribute and the fix. State set from the input's SHAPE, state set before
wrapping, and plain Hugging Face models pass and equal the one-device step (float64, assert_equivalent's
default tolerance, which only a cross-rank or cross-micro-batch sum's rounding uses)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw

_spec = importlib.util.spec_from_file_location(
    "_torch_loop", Path(__file__).resolve().parents[1] / "transforms" / "_torch_loop.py")
assert _spec is not None and _spec.loader is not None
_torch_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_torch_loop)


class _LazyInit(nn.Module):
    """ActNorm-style: its scale set on the first call from the input's spread."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = x.detach().std(0)
        return self.lin(x / self.scale)


class _MeansOnce(nn.Module):
    """A list of batch means it appends to on its first call (later calls read it)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.means: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.means:
            self.means.append(float(x.detach().mean()))
        return self.lin(x) - self.means[0]


class _ShapeCache(nn.Module):
    """A lazily built cache of the input's width (a table of positions), set once from the shape alone."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]
        return self.lin(x + self.table)


CUTS = {
    "zero1 dp2": (lambda s: sw.shard_params(s, "dp", 1), lambda: sw.Mesh(dp=2)),
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", 3), lambda: sw.Mesh(dp=2)),
    "dp1 accumulation=2": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2), lambda: sw.Mesh(dp=1)),
    "pp2 1f1b 2 micro-batches": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), lambda: sw.Mesh(pp=2)),
}


def _model(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(cls(4), nn.Tanh(), nn.Linear(4, 2)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 4, generator=g, dtype=torch.float64) + 3.0,
             torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(3)]


def _equivalent(model: nn.Module, cut: str, transform: Any = None, backend: str = "threads") -> Any:
    transform, mesh = CUTS[cut] if transform is None else (transform, lambda: sw.Mesh(dp=1))
    chain, params = sw.functionalize(copy.deepcopy(model))
    reference, _ = sw.functionalize(copy.deepcopy(model))  # its own module: state kept in forward is not shared
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    ref = sw.train_step(reference, F.mse_loss, sw.optim.sgd(0.1))
    return sw.testing.assert_equivalent(transform(step), ref, mesh(), _batches(), params, backend=backend)


def _message(error: BaseException | None) -> str:
    text = []
    while error is not None:
        text += [str(error), *getattr(error, "__notes__", [])]
        error = error.__cause__
    return "\n".join(text)


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize(("cls", "attribute"), [(_LazyInit, "scale"), (_MeansOnce, "means")])
def test_state_set_from_the_input_values_is_refused_where_the_batch_is_cut(
        cls: type[nn.Module], attribute: str, cut: str) -> None:
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        _equivalent(_model(cls), cut)
    message = _message(caught.value)
    assert f"layer '0' set its module's attributes ['{attribute}'] on its first call from its input's values" \
        in message, message
    assert "Initialize the state before wrapping the model" in message, message
    words = "shard_params over axis 'dp' of size 2" if "dp2" in cut else "2 micro-batches"
    assert f"this step cuts the batch ({words}" in message, message


def test_every_rank_refuses_on_processes() -> None:
    """Each rank's probe sees its own share's values: all refuse alike, none waits on another."""
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        _equivalent(_model(_LazyInit), "zero3 dp2", backend="processes")
    assert "layer '0' set its module's attributes ['scale'] on its first call" in _message(caught.value)


@pytest.mark.parametrize("cls", [_LazyInit, _MeansOnce])
def test_one_device_equals_torch_loop(cls: type[nn.Module]) -> None:
    """Nothing cut: the first call sees the whole batch, as torch's does, bit for bit."""
    _torch_loop.assert_one_device_equals_torch_sgd(_model(cls), _batches())


@pytest.mark.parametrize("cls", [_LazyInit, _MeansOnce])
def test_remat_alone_passes(cls: type[nn.Module]) -> None:
    """remat recomputes on the whole batch: the state is set once, from it (a recompute reads it)."""
    _equivalent(_model(cls), "remat", transform=sw.remat)


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("cls", [_LazyInit, _MeansOnce])
def test_state_initialized_before_wrapping_passes(cls: type[nn.Module], cut: str) -> None:
    model = _model(cls)
    with torch.no_grad():
        model(torch.cat([x for x, _ in _batches()]))  # the user's fix: one call on a full batch first
    _equivalent(model, cut)  # raises where refused or not equal to the one-device step


@pytest.mark.parametrize("cut", list(CUTS))
def test_a_cache_set_from_the_shape_passes(cut: str) -> None:
    _equivalent(_model(_ShapeCache), cut)


T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
HF = {
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), "GPT2Block"),
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
        **_SMALL, num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")),
        "LlamaDecoderLayer"),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(
        **_SMALL, max_position_embeddings=64, attn_implementation="eager", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)), "BertLayer"),
}


def _token_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("cut", ["zero1 dp2", "pp2 1f1b 2 micro-batches"])
@pytest.mark.parametrize("model", list(HF))
def test_plain_hf_models_are_not_refused(model: str, cut: str) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [({"input_ids": ids}, ids) for ids in (torch.randint(64, (4, 12), generator=g) for _ in range(2))]
    build, unit = HF[model]

    def step() -> tuple[Any, Any]:
        torch.manual_seed(0)
        module = build().double()
        units = next(type(m) for m in module.modules() if type(m).__name__ == unit)
        chain, params = sw.functionalize(module, units=units, example_input=batches[0][0])
        return sw.train_step(chain, _token_loss, sw.optim.sgd(0.1)), params

    (tested, params), (reference, _) = step(), step()
    transform, mesh = CUTS[cut]
    sw.testing.assert_equivalent(transform(tested), reference, mesh(), batches, params, backend="threads")
