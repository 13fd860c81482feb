"""A forward's own ``F.embedding(..., scale_grad_by_freq=True)`` (engine/model/functional_frequencies.py).

The module form, ``nn.Embedding(scale_grad_by_freq=True)``, is refused where the batch is cut (test_embedding_
options.py); the same call made in a user's own forward (``F.embedding``, ``torch.embedding``,
``F.embedding_bag``) was not told by any attribute and trained another model silently (grad_norm rel err 2.9e-3
under ZeRO-3 dp2, paramwrite's repro). functionalize now sees the call, on an example input (a
TorchFunctionMode around each layer's call) or, without one, in the fx-traced code, and every batch-cutting
transform refuses it naming the module and the call. One device stays bitwise equal to torch's loop; the same
call with ``scale_grad_by_freq=False`` is not refused. float64, threads backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw

from ._torch_loop import assert_one_device_equals_torch_sgd

CALLS: dict[str, Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]] = {
    "F.embedding": lambda idx, w, freq: F.embedding(idx, w, scale_grad_by_freq=freq).flatten(1),
    "torch.embedding": lambda idx, w, freq: torch.embedding(w, idx, -1, freq).flatten(1),
    "F.embedding_bag": lambda idx, w, freq: F.embedding_bag(idx, w, None, None, 2.0, freq, "sum").repeat(1, 3),
}


class OwnLookup(nn.Module):
    """Looks its rows up itself, by ``call``."""

    def __init__(self, call: str, freq: bool) -> None:
        super().__init__()
        self.call, self.freq = call, freq
        self.weight = nn.Parameter(torch.randn(10, 4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return CALLS[self.call](idx, self.weight, self.freq)


class Wrapped(nn.Module):
    """The lookup one module down: the refusal names the inner module."""

    def __init__(self, call: str, freq: bool) -> None:
        super().__init__()
        self.inner = OwnLookup(call, freq)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx)


CUTS: dict[str, tuple[Callable[[sw.Step], sw.Step], str]] = {
    "zero1 dp2": (lambda s: sw.shard_params(s, "dp", 1), "under shard_params (data parallel over axis 'dp')"),
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", 3), "under shard_params (data parallel over axis 'dp')"),
    "dp1 accumulation=2": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
                           "under shard_params (data parallel over axis 'dp', accumulation=2)"),
    "pp2 mb2": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), "under pipeline with 2 micro-batches"),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(10, (8, 3), generator=g), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(3)]


def _sequential(call: str, freq: bool = True, wrapped: bool = False) -> nn.Module:
    torch.manual_seed(0)
    first = Wrapped(call, freq) if wrapped else OwnLookup(call, freq)
    return nn.Sequential(first, nn.Linear(12, 2)).double()


def _refusal(step: sw.Step, cut: str) -> str:
    transform, words = CUTS[cut]
    with pytest.raises(ValueError) as caught:
        transform(step)
    text = str(caught.value)
    assert f"{words} each rank (or micro-batch) calls it on a part of the batch" in text, text
    assert "set scale_grad_by_freq=False" in text, text
    return text


@pytest.mark.parametrize("example", [False, True], ids=["traced", "run on an example"])
@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("call", list(CALLS))
def test_an_own_call_is_refused_where_the_batch_is_cut(call: str, cut: str, example: bool) -> None:
    x = _batches()[0][0] if example else None
    chain, _ = sw.functionalize(_sequential(call, wrapped=True), example_input=x)
    text = _refusal(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), cut)
    assert text.startswith(
        f"'0.inner' ({call}(..., scale_grad_by_freq=True) in OwnLookup.forward) divides each row's gradient"), text


@pytest.mark.parametrize("call", list(CALLS))
def test_an_own_call_on_one_device_equals_torch(call: str) -> None:
    """Losses and parameters bitwise equal to torch's loop over 3 steps."""
    model = _sequential(call)
    assert_one_device_equals_torch_sgd(model, _batches())


@pytest.mark.parametrize("example", [False, True], ids=["traced", "run on an example"])
@pytest.mark.parametrize("call", list(CALLS))
def test_the_same_call_without_scale_grad_by_freq_is_not_refused(call: str, example: bool) -> None:
    x = _batches()[0][0] if example else None
    chain, params = sw.functionalize(_sequential(call, freq=False, wrapped=True), example_input=x)
    reference, _ = sw.functionalize(_sequential(call, freq=False, wrapped=True))
    report = sw.testing.assert_equivalent(
        sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "dp", 3),
        sw.train_step(reference, F.mse_loss, sw.optim.sgd(0.1)), sw.Mesh(dp=2), _batches(), params)
    assert max(report.max_rel_err) < 1e-12, report


# --- split into units: the call in some units only, and in the code before / after them ---------------------


def _picked(h: torch.Tensor) -> torch.Tensor:
    """Row ids a sample's own values pick (so that they differ between the batch's parts)."""
    return h.detach()[..., 0].mul(1000).long().remainder(10)


class Block(nn.Module):
    """A unit that adds a lookup of rows its hidden state picks, with or without counting them."""

    def __init__(self, freq: bool) -> None:
        super().__init__()
        self.freq = freq
        self.table = nn.Parameter(torch.randn(10, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(h)) + F.embedding(_picked(h), self.table, scale_grad_by_freq=self.freq)


class Stack(nn.Module):
    """Embedding code (``where="embed"``), units, head code (``where="head"``); ``freq_units``: the units
    whose lookup counts."""

    def __init__(self, where: str | None, freq_units: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.where = where
        self.wte = nn.Parameter(torch.randn(10, 4))
        self.blocks = nn.ModuleList([Block(i in freq_units) for i in range(3)])
        self.out = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = F.embedding(idx, self.wte, scale_grad_by_freq=self.where == "embed")
        for block in self.blocks:
            h = block(h)
        if self.where == "head":
            h = h + F.embedding(_picked(h), self.wte, scale_grad_by_freq=True)
        return self.out(h).mean(1)


class DictStack(Stack):
    """The same, called with a dict of keyword arguments as a Hugging Face model is: split by recording its
    calls (embed, units, head)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids)


def _units_step(model: nn.Module, example: Any) -> sw.Step:
    torch.manual_seed(0)
    chain, _ = sw.functionalize(model.double(), units=Block, example_input=example)
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))


SPLITS: dict[str, Callable[[str | None, tuple[int, ...]], tuple[nn.Module, Any]]] = {
    "fx traced": lambda where, units: (Stack(where, units), None),
    "fx run on an example": lambda where, units: (Stack(where, units), _batches()[0][0]),
    "recorded (HF-like dict input)": lambda where, units: (DictStack(where, units),
                                                          {"input_ids": _batches()[0][0]}),
}


# (the code that calls, the units whose lookup counts) -> what the refusal names first: for fx's split,
# the code around the units runs in the segment of the unit next to it; a recorded split has its own
# "embed" and "head" layers.
NAMED = {
    ("unit 1", None, (1,)): ("'blocks.1'", "Block.forward", "'blocks.1'", "Block.forward"),
    ("units 0 and 2", None, (0, 2)): ("'blocks.0'", "Block.forward", "'blocks.0'", "Block.forward"),
    ("embed code", "embed", ()): ("'blocks.0'", "the model's own forward", "'embed'", "DictStack.forward"),
    ("head code", "head", ()): ("'blocks.2'", "the model's own forward", "'head'", "DictStack.forward"),
}


@pytest.mark.parametrize("cut", ["zero1 dp2", "zero3 dp2", "dp1 accumulation=2", "pp2 mb2"])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("case", list(NAMED), ids=[c[0] for c in NAMED])
def test_a_call_in_some_units_or_around_them_is_refused(
    case: tuple[str, str | None, tuple[int, ...]], split: str, cut: str
) -> None:
    _, where, units = case
    model, example = SPLITS[split](where, units)
    fx_path, fx_code, recorded_path, recorded_code = NAMED[case]
    path, code = (recorded_path, recorded_code) if split.startswith("recorded") else (fx_path, fx_code)
    text = _refusal(_units_step(model, example), cut)
    assert text.startswith(f"{path} (F.embedding(..., scale_grad_by_freq=True) in {code}) divides each row's "), text


@pytest.mark.parametrize("split", ["fx run on an example", "recorded (HF-like dict input)"])
@pytest.mark.parametrize("case", list(NAMED), ids=[c[0] for c in NAMED])
def test_a_call_in_a_meta_built_model_is_refused(case: tuple[str, str | None, tuple[int, ...]], split: str) -> None:
    """Checked on fake tensors, where an identical unit is run once: the others are read from their traced code."""
    _, where, units = case
    with torch.device("meta"):
        model, example = SPLITS[split](where, units)
    fx_path, fx_code, recorded_path, recorded_code = NAMED[case]
    path, code = (recorded_path, recorded_code) if split.startswith("recorded") else (fx_path, fx_code)
    text = _refusal(_units_step(model, example), "zero3 dp2")
    assert text.startswith(f"{path} (F.embedding(..., scale_grad_by_freq=True) in {code}) divides each row's "), text


@pytest.mark.parametrize("split", list(SPLITS))
def test_units_without_counting_are_not_refused(split: str) -> None:
    model, example = SPLITS[split](None, ())
    step = _units_step(model, example)
    for cut in ("zero3 dp2", "pp2 mb2"):
        assert CUTS[cut][0](step).transforms, cut


# --- a Hugging Face model whose input embedding a user replaced by their own lookup ---------------------------


class FreqLookup(nn.Module):
    """A user's own input embedding: the model's table (tied to its lm_head), looked up counting the ids."""

    def __init__(self, weight: nn.Parameter, freq: bool) -> None:
        super().__init__()
        self.weight, self.freq = weight, freq

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, scale_grad_by_freq=self.freq)


@pytest.mark.parametrize("freq", [True, False])
def test_a_gpt2_with_an_own_counting_lookup_is_refused_where_the_batch_is_cut(freq: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.wte = FreqLookup(model.transformer.wte.weight, freq)
    chain, _ = sw.functionalize(model, units=transformers.models.gpt2.modeling_gpt2.GPT2Block,
                                example_input=torch.randint(50, (2, 8)))
    step = sw.train_step(chain, lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                         sw.optim.sgd(0.1))
    if not freq:
        assert sw.shard_params(step, "dp", 3).transforms
        return
    text = _refusal(step, "zero3 dp2")
    assert text.startswith("'transformer.wte' (F.embedding(..., scale_grad_by_freq=True) in FreqLookup.forward) "
                           "divides each row's gradient"), text
