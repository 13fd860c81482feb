"""A forward's own ``F.embedding(..., scale_grad_by_freq=True)`` (engine/model/functional_frequencies.py,
engine/run/frequency_watch.py).

The module form, ``nn.Embedding(scale_grad_by_freq=True)``, is refused where the batch is cut (test_embedding_
options.py); the same call made in a user's own forward (``F.embedding``, ``torch.embedding``,
``F.embedding_bag``) was not told by any attribute and trained another model silently (grad_norm rel err 2.9e-3
under ZeRO-3 dp2, paramwrite's repro). functionalize sees the call on an example input (a TorchFunctionMode
around each layer's call), and the batch-cutting transform refuses it when it is added; without one (or for a
meta-built model's unit reused from an identical one) the step refuses it at the layer's first call, with the
same words, on every rank that runs it. No forward runs once more to find it. One device stays bitwise equal
to torch's loop; the same call with ``scale_grad_by_freq=False`` and tensor_parallel alone are not refused.
float64, threads backend (one case under gloo processes).
"""

from __future__ import annotations

import contextlib
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
    # the aten ops called themselves (a packet, an overload): seen as such by the TorchFunctionMode
    "torch.ops.aten.embedding": lambda idx, w, freq: torch.ops.aten.embedding(w, idx, -1, freq).flatten(1),
    "torch.ops.aten.embedding_bag.default": lambda idx, w, freq: torch.ops.aten.embedding_bag.default(
        w, idx.flatten(), torch.arange(0, idx.numel(), idx.size(1)), freq, 0)[0].repeat(1, 3),
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


CUTS: dict[str, tuple[Callable[[sw.Step], sw.Step], str, sw.Mesh]] = {
    "zero1 dp2": (lambda s: sw.shard_params(s, "dp", 1), "under shard_params (data parallel over axis 'dp')",
                  sw.Mesh(dp=2)),
    "zero3 dp2": (lambda s: sw.shard_params(s, "dp", 3), "under shard_params (data parallel over axis 'dp')",
                  sw.Mesh(dp=2)),
    "dp1 accumulation=2": (lambda s: sw.shard_params(s, "dp", 1, accumulation=2),
                           "under shard_params (data parallel over axis 'dp', accumulation=2)", sw.Mesh(dp=1)),
    "pp2 mb2": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), "under pipeline with 2 micro-batches", sw.Mesh(pp=2)),
}


def _batches(inputs: Callable[[torch.Tensor], Any] = lambda idx: idx) -> list[tuple[Any, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(inputs(torch.randint(10, (8, 3), generator=g)), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(3)]


def _sequential(call: str, freq: bool = True, wrapped: bool = False) -> nn.Module:
    torch.manual_seed(0)
    first = Wrapped(call, freq) if wrapped else OwnLookup(call, freq)
    return nn.Sequential(first, nn.Linear(12, 2)).double()


def _checked(text: str, cut: str) -> str:
    words = CUTS[cut][1]
    assert f"{words} each rank (or micro-batch) calls it on a part of the batch" in text, text
    assert "set scale_grad_by_freq=False" in text, text
    return text


def _refusal(step: sw.Step, cut: str) -> str:
    """The refusal when the transform is added (functionalize saw the call)."""
    with pytest.raises(ValueError) as caught:
        CUTS[cut][0](step)
    return _checked(str(caught.value), cut)


def _first_call_refusal(build: Callable[[], tuple[sw.Step, Any]], cut: str, batches: list[Any],
                        backend: str = "threads") -> str:
    """The refusal at the step's first call (functionalize saw no call): the transform is added, and the step
    (run against one device) refuses. A rank that does not run the layer (a pipeline's other stage) fails as
    any rank's failure does, RankFailed naming the refusing rank's error."""
    step, params = build()
    reference, _ = build()
    transform, _, mesh = CUTS[cut]
    sharded = transform(step)
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        sw.testing.assert_equivalent(sharded, reference, mesh, batches, params, backend=backend)
    return _checked(str(caught.value), cut)


def _step_of(model: nn.Module, example: Any = None, **options: Any) -> tuple[sw.Step, Any]:
    chain, params = sw.functionalize(model, example_input=example, **options)
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("call", list(CALLS))
def test_an_own_call_seen_on_the_example_is_refused_when_the_batch_is_cut(call: str, cut: str) -> None:
    step, _ = _step_of(_sequential(call, wrapped=True), _batches()[0][0])
    text = _refusal(step, cut)
    assert text.startswith(
        f"'0.inner' ({call}(..., scale_grad_by_freq=True) in OwnLookup.forward) divides each row's gradient"), text


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("call", list(CALLS))
def test_an_own_call_without_an_example_is_refused_at_the_first_call(call: str, cut: str) -> None:
    text = _first_call_refusal(lambda: _step_of(_sequential(call, wrapped=True)), cut, _batches())
    assert f"'0.inner' ({call}(..., scale_grad_by_freq=True) in OwnLookup.forward) divides each row's gradient" \
        in text, text


@pytest.mark.parametrize("cut", ["zero3 dp2", "pp2 mb2"])
def test_the_first_call_refusal_under_gloo_processes(cut: str) -> None:
    """ZeRO-3: both ranks run the layer and refuse at its first call. The pipeline: the counting unit is on the
    last stage, so rank 1 refuses while rank 0 waits for its gradient, and is stopped as for any rank's failure.
    No rank hangs (the launch's timeout would fail the test)."""
    if cut == "zero3 dp2":
        build, named = lambda: _step_of(_sequential("F.embedding", wrapped=True)), ("'0.inner'", "OwnLookup")
    else:
        build, named = lambda: _units_step(Stack(None, (2,)), None), ("'blocks.2'", "Block")
    text = _first_call_refusal(build, cut, _batches(), backend="processes")
    assert f"{named[0]} (F.embedding(..., scale_grad_by_freq=True) in {named[1]}.forward) divides each row's " \
        "gradient" in text, text


class Counting(nn.Module):
    """Counts its forward's calls: a step must not run it once more than torch's loop (no trace, no extra run)."""

    def __init__(self) -> None:
        super().__init__()
        self.lookup = OwnLookup("F.embedding", True)
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lookup(idx)


def test_functionalize_without_an_example_runs_no_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Counting(), nn.Linear(12, 2)).double()
    chain, _ = sw.functionalize(model)
    assert model[0].calls == 0
    assert [sum(m.calls for m in module.modules() if isinstance(m, Counting))
            for module in _modules_of(chain)] == [0, 0]


def _modules_of(chain: Any) -> list[nn.Module]:
    from shardwise.engine.model.module_call import module_fn

    return [module_fn(layer.fn).replicas.module for layer in chain]


@pytest.mark.parametrize("call", list(CALLS))
def test_an_own_call_on_one_device_equals_torch(call: str) -> None:
    """Losses and parameters bitwise equal to torch's loop over 3 steps."""
    model = _sequential(call)
    assert_one_device_equals_torch_sgd(model, _batches())


@pytest.mark.parametrize("example", [False, True], ids=["no example", "run on an example"])
@pytest.mark.parametrize("call", list(CALLS))
def test_the_same_call_without_scale_grad_by_freq_is_not_refused(call: str, example: bool) -> None:
    x = _batches()[0][0] if example else None
    step, params = _step_of(_sequential(call, freq=False, wrapped=True), x)
    reference, _ = _step_of(_sequential(call, freq=False, wrapped=True))
    for cut in CUTS:
        transform, _, mesh = CUTS[cut]
        report = sw.testing.assert_equivalent(transform(step), reference, mesh, _batches(), params)
        assert max(report.max_rel_err) < 1e-12, (cut, report)


@pytest.mark.parametrize("example", [False, True], ids=["no example", "run on an example"])
def test_tensor_parallel_alone_is_not_refused(example: bool) -> None:
    """Every tp rank calls the lookup on the whole batch: its counts are the batch's, and the step is one
    device's (up to the Rowwise sum's rounding)."""

    def build() -> tuple[sw.Step, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(OwnLookup("F.embedding", True), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        return _step_of(model, _batches()[0][0] if example else None)

    step, params = build()
    reference, _ = build()
    tp = sw.tensor_parallel(step, "tp", {"1": sw.tp.Colwise(), "3": sw.tp.Rowwise()})
    report = sw.testing.assert_equivalent(tp, reference, sw.Mesh(tp=2), _batches(), params, rtol=1e-12)
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

    def reset_parameters(self) -> None:  # its own table (a meta-built model's parameters are made by it)
        nn.init.normal_(self.table)

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

    def reset_parameters(self) -> None:
        nn.init.normal_(self.wte)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = F.embedding(idx, self.wte, scale_grad_by_freq=self.where == "embed")
        for block in self.blocks:
            h = block(h)
        if self.where == "head":
            h = h + F.embedding(_picked(h), self.wte, scale_grad_by_freq=True)
        return self.out(h).mean(1)


class IndexedBlock(Block):
    """Counts in the unit whose ``layer_idx`` is 1 alone. ``layer_idx`` is a position, left out of what makes
    units alike (engine/model/reuse.py): a meta-built model's check on fake tensors runs unit 0 and reuses its
    run for units 1 and 2, so unit 1's call is not seen there."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__(False)
        self.layer_idx = layer_idx

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        counted = self.layer_idx == 1
        return torch.tanh(self.proj(h)) + F.embedding(_picked(h), self.table, scale_grad_by_freq=counted)


class IndexedStack(Stack):
    """A Stack of IndexedBlocks."""

    def __init__(self, where: str | None, freq_units: tuple[int, ...] = ()) -> None:
        super().__init__(where)
        self.blocks = nn.ModuleList([IndexedBlock(i) for i in range(3)])


class DictStack(Stack):
    """The same, called with a dict of keyword arguments as a Hugging Face model is: split by recording its
    calls (embed, units, head)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids)


class IndexedDictStack(IndexedStack):
    """An IndexedStack called with a dict of keyword arguments."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids)


def _units_step(model: nn.Module, example: Any) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    return _step_of(model.double(), example, units=Block)


# split -> (the model for (where, units), the example input or None, a batch's input from its ids)
SPLITS: dict[str, tuple[Callable[[str | None, tuple[int, ...]], nn.Module], Any, Callable[[torch.Tensor], Any]]] = {
    "fx, no example": (Stack, None, lambda idx: idx),
    "fx run on an example": (Stack, _batches()[0][0], lambda idx: idx),
    "recorded (HF-like dict input)": (DictStack, {"input_ids": _batches()[0][0]}, lambda idx: {"input_ids": idx}),
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


def _named(case: tuple[str, str | None, tuple[int, ...]], split: str) -> str:
    fx_path, fx_code, recorded_path, recorded_code = NAMED[case]
    path, code = (recorded_path, recorded_code) if split.startswith("recorded") else (fx_path, fx_code)
    return f"{path} (F.embedding(..., scale_grad_by_freq=True) in {code}) divides each row's gradient"


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("case", list(NAMED), ids=[c[0] for c in NAMED])
def test_a_call_in_some_units_or_around_them_is_refused(
    case: tuple[str, str | None, tuple[int, ...]], split: str, cut: str
) -> None:
    """On an example: when the transform is added; without one: at the step's first call of the layer."""
    _, where, units = case
    make, example, inputs = SPLITS[split]
    if example is None:
        text = _first_call_refusal(lambda: _units_step(make(where, units), None), cut, _batches(inputs))
        assert _named(case, split) in text, text
    else:
        text = _refusal(_units_step(make(where, units), example)[0], cut)
        assert text.startswith(_named(case, split)), text


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("case", list(NAMED), ids=[c[0] for c in NAMED])
def test_a_call_in_a_meta_built_model_is_refused(case: tuple[str, str | None, tuple[int, ...]], split: str) -> None:
    """Checked on fake tensors on an example: when the transform is added; without one, at the first call of
    the step, on the parameters Step.init made."""
    _, where, units = case
    make, example, inputs = SPLITS[split]

    def build() -> tuple[sw.Step, Any]:
        with torch.device("meta"):
            model = make(where, units)
        return _units_step(model, example)

    if example is None:
        text = _first_call_refusal(build, "zero3 dp2", _batches(inputs))
        assert _named(case, split) in text, text
    else:
        text = _refusal(build()[0], "zero3 dp2")
        assert text.startswith(_named(case, split)), text


@pytest.mark.parametrize("cut", list(CUTS))
def test_a_unit_reused_from_an_identical_one_on_fake_tensors_is_refused_at_the_first_call(cut: str) -> None:
    """A meta-built model recorded on an example: units 1 and 2 reuse unit 0's fake run, so functionalize
    never sees unit 1's call; the step's first call of unit 1 does."""

    def build(meta: bool) -> tuple[sw.Step, Any]:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = IndexedDictStack(None)
        return _units_step(model, {"input_ids": _batches()[0][0]})

    named = "'blocks.1' (F.embedding(..., scale_grad_by_freq=True) in IndexedBlock.forward) divides each row's gradient"
    assert _refusal(build(meta=False)[0], cut).startswith(named)  # real tensors: each unit runs, and is seen
    text = _first_call_refusal(lambda: build(meta=True), cut, _batches(lambda idx: {"input_ids": idx}))
    assert named in text, text


@pytest.mark.parametrize("split", list(SPLITS))
def test_units_without_counting_are_not_refused(split: str) -> None:
    make, example, inputs = SPLITS[split]
    step, params = _units_step(make(None, ()), example)
    reference, _ = _units_step(make(None, ()), example)
    for cut in ("zero3 dp2", "pp2 mb2"):
        transform, _, mesh = CUTS[cut]
        report = sw.testing.assert_equivalent(transform(step), reference, mesh, _batches(inputs), params)
        assert max(report.max_rel_err) < 1e-12, (cut, report)


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
