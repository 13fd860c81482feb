"""State a layer's first call sets from its input's VALUES (engine/run/first_call_state.py): an ActNorm-style
lazy initialization, a list of batch means. torch's loop sets it from the whole batch; where the step cuts
the batch (ZeRO-1/3 over dp2, accumulation=2, a pipeline's micro-batches) each rank or micro-batch would set
it from its share (the review: 0.24% off at dp2, 0.40% at accumulation=2, a raw fake-tensor error at pp2), so
it is refused, naming the layer, the attribute and the fix. State set from the input's SHAPE, state set before
wrapping, and plain Hugging Face models pass and equal the one-device step (float64, assert_equivalent's
default tolerance, which only a cross-rank or cross-micro-batch sum's rounding uses)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import types
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
_layers_spec = importlib.util.spec_from_file_location(
    "_stateful_layers", Path(__file__).with_name("_stateful_layers.py"))
assert _layers_spec is not None and _layers_spec.loader is not None
_stateful_layers = importlib.util.module_from_spec(_layers_spec)
_layers_spec.loader.exec_module(_stateful_layers)
_ShapeCache, _HiddenTuple = _stateful_layers.ShapeCache, _stateful_layers.HiddenTuple


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


def test_a_refused_launch_run_again_in_the_same_process_is_refused_again() -> None:
    """A later launch's rank threads may get the numbers (threading.get_ident) of an earlier one's, which
    ended; their copies of the module are new, and their first calls are watched as the first launch's
    were (before: the third launch of the same refused step trained, each rank's scale from its share)."""
    chain, params = sw.functionalize(_model(_LazyInit))
    step = sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)

    def main() -> None:
        mesh = sw.Mesh(dp=2)
        step(step.init(params, mesh), _batches()[0])

    for _ in range(5):
        with pytest.raises(sw.collectives.RankFailed, match=r"set its module's attributes \['scale'\] on its first"):
            sw.launch(main, 2)


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


class _IdsLazyInit(nn.Module):
    """Fed token ids: an ActNorm-style scale set on the first call from the spread of the ids' embeddings."""

    def __init__(self, vocab: int = 10, d: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d))
        self.scale: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = F.embedding(ids, self.weight)
        if self.scale is None:
            self.scale = e.detach().std(dim=(0, 1))
        return (e / self.scale).flatten(1)


class _IdCounts(nn.Module):
    """Fed token ids: the ids' frequencies counted on the first call, weighting the embeddings after."""

    def __init__(self, vocab: int = 10, d: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d))
        self.freq: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = F.embedding(ids, self.weight)
        if self.freq is None:
            self.freq = torch.bincount(ids.flatten(), minlength=self.weight.shape[0]).to(e.dtype) / ids.numel()
        return (e * self.freq[ids].unsqueeze(-1)).flatten(1)


class _PositionsCache(nn.Module):
    """Fed positions (an arange along the last dim, every row alike): a rotary-style table of the positions'
    angles set on the first call, as Hugging Face's rotary embeddings read ``position_ids``: set from values
    that follow from the shape, alike on every share."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.table: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            freqs = torch.arange(1, self.lin.in_features + 1, dtype=self.lin.weight.dtype)
            self.table = torch.sin(positions[0, :, None] * freqs)
        return self.lin(self.table.expand(positions.shape[0], -1, -1))


def _ids_batches(positions: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.arange(3).expand(8, 3) if positions else torch.randint(1, 10, (8, 3), generator=g),
             torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(3)]


def _ids_equivalent(layer: type[nn.Module], cut: str, positions: bool = False) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(layer(), nn.Flatten(), nn.Tanh(), nn.Linear(12, 2)).double()
    transform, mesh = CUTS[cut]
    chain, params = sw.functionalize(copy.deepcopy(model))
    reference, _ = sw.functionalize(copy.deepcopy(model))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    ref = sw.train_step(reference, F.mse_loss, sw.optim.sgd(0.1))
    return sw.testing.assert_equivalent(transform(step), ref, mesh(), _ids_batches(positions), params)


@pytest.mark.parametrize("cut", ["zero3 dp2", "dp1 accumulation=2", "pp2 1f1b 2 micro-batches"])
@pytest.mark.parametrize(("cls", "attribute"), [(_IdsLazyInit, "scale"), (_IdCounts, "freq")])
def test_state_set_from_token_ids_is_refused_where_the_batch_is_cut(
        cls: type[nn.Module], attribute: str, cut: str) -> None:
    """The probe draws the ids' other values from their own (in range): before, it kept integer inputs, and
    these trained another model silently (the review: 2.8e-2 and 2.2e-2 relative in the loss at ZeRO-3 dp2)."""
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        _ids_equivalent(cls, cut)
    message = _message(caught.value)
    assert f"layer '0' set its module's attributes ['{attribute}'] on its first call from its input's values" \
        in message, message


@pytest.mark.parametrize("cut", ["zero3 dp2", "dp1 accumulation=2", "pp2 1f1b 2 micro-batches"])
def test_a_table_of_positions_passes(cut: str) -> None:
    """Positions keep their values in the probe (varied, as token ids are, this was refused)."""
    _ids_equivalent(_PositionsCache, cut, positions=True)


def test_the_probe_draws_integers_from_their_own_values() -> None:
    """Labels with -100 get other values among their own (never -50); a 0/1 mask, a bool tensor and one arange
    keep theirs; positions of other offsets per row (their max differs between shares) are varied."""
    from shardwise.engine.run.first_call_state import _other_values

    g = torch.Generator().manual_seed(3)
    labels = torch.randint(5, 64, (4, 16), generator=g)
    labels[:, :4] = -100
    mask = (torch.rand(4, 16, generator=g) > 0.3).long()
    given = {"labels": labels, "mask": mask, "flags": mask.bool(), "positions": torch.arange(16).expand(4, 16),
             "offset": torch.arange(16) + torch.arange(4)[:, None]}
    other = _other_values(given)
    assert not torch.equal(other["labels"], labels)
    assert set(other["labels"].unique().tolist()) <= set(labels.unique().tolist())
    assert not torch.equal(other["offset"], given["offset"])
    for kept in ("mask", "flags", "positions"):
        assert torch.equal(other[kept], given[kept]), kept


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


@pytest.mark.parametrize("cut", ["zero3 dp2", "dp1 accumulation=2", "pp2 1f1b 2 micro-batches"])
def test_dynamic_rope_grown_on_the_first_call_passes_the_probe(cut: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured at 6 positions, the first step's 12 (past max_position_embeddings=8) grow dynamic RoPE's cache,
    so the probe runs the embed layer again: on other token ids (drawn from the share's own), the padded
    attention mask (0/1) and the positions (an arange) kept, it grows the cache alike and the step equals the
    one-device step (float64, assert_equivalent's default tolerance)."""
    from shardwise.engine.run import first_call_state

    probed: list[Any] = []
    other_values = first_call_state._other_values
    monkeypatch.setattr(first_call_state, "_other_values", lambda given: probed.append(given) or other_values(given))
    g = torch.Generator().manual_seed(1)
    batches = []
    for n in (12, 6, 12):
        ids = torch.randint(64, (4, n), generator=g)
        mask = torch.ones(4, n, dtype=torch.long)
        mask[:, -2:] = 0
        batches.append(({"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(n).expand(4, n)}, ids))
    example = {k: v[:, :6] for k, v in batches[0][0].items()}

    def step() -> tuple[Any, Any]:
        torch.manual_seed(0)
        module = T.LlamaForCausalLM(T.LlamaConfig(
            **_SMALL, num_key_value_heads=2, max_position_embeddings=8, attn_implementation="eager",
            rope_scaling={"rope_type": "dynamic", "factor": 2.0})).double()
        chain, params = sw.functionalize(module, units=T.models.llama.modeling_llama.LlamaDecoderLayer,
                                         example_input=example)
        return sw.train_step(chain, _token_loss, sw.optim.sgd(0.1)), params

    (tested, params), (reference, _) = step(), step()
    transform, mesh = CUTS[cut]
    sw.testing.assert_equivalent(transform(tested), reference, mesh(), batches, params, backend="threads")
    assert probed, "the first step's growth of the rotary cache did not run the probe"
    given = probed[0]
    other = other_values(given)
    assert not torch.equal(other["input_ids"], given["input_ids"]), "the token ids were not varied"
    assert torch.equal(other["attention_mask"], given["attention_mask"]), "the 0/1 mask was not kept"
    assert torch.equal(other["position_ids"], given["position_ids"]), "the positions were not kept"


# functionalize's recording run of the meta build leaves the fake recurrent_states it set in the module, which its
# skeleton's copy deep-copies (torch warns reading a fake tensor's data pointer): left open, noted.
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")
def test_state_set_from_the_input_on_a_meta_builds_first_step_is_refused_in_our_words() -> None:
    """A meta-built RecurrentGemma (its RG-LRU sets ``recurrent_states`` from the input on its first call) whose
    first step is ZeRO-3's: the first call ran on fake tensors, and comparing its state read their values (torch's
    raw DataDependentOutputException); fake tensors are the same state only as one tensor now, and the step is
    refused naming the attribute, as an eager build's is."""
    T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
    config = T.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, lru_width=16, attention_window_size=8, conv1d_width=4, head_dim=8,
        block_types=["recurrent", "attention"])
    with torch.device("meta"):
        model = T.RecurrentGemmaForCausalLM(config)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    layer = T.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaDecoderLayer
    chain, params = sw.functionalize(model, units=layer, example_input=ids[:2])
    step = sw.shard_params(sw.train_step(
        chain, lambda o, y: F.cross_entropy(o.logits.flatten(0, 1), y.flatten()), sw.optim.sgd(0.1)), "dp", 3)
    with pytest.raises(sw.collectives.RankFailed, match=r"set its module's attributes "
                                                         r"\['temporal_block\.rg_lru\.recurrent_states'\]"):
        sw.launch(lambda: step(step.init(params, sw.Mesh(dp=2), seed=0), (ids, ids)), 2)


class _TensorList(nn.Module):
    """A list of feature means, a tensor appended on every call, the last read on the next (a feature memory)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = h + (self.cache[-1] if self.cache else 0.0)
        self.cache.append(h.detach().mean(0))
        return out


class _TensorDict(nn.Module):
    """A running centre kept in a dict, set from the input's values after each call."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.d = {"m": torch.zeros(d, dtype=torch.float64)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = h - self.d["m"]
        self.d["m"] = h.detach().mean(0)
        return out


class _TensorDeque(nn.Module):
    """A feature memory of the last two batch means in a deque (maxlen=2), added to the output."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.mem: collections.deque[torch.Tensor] = collections.deque(maxlen=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        out = y + (torch.stack(list(self.mem)).mean(0) if self.mem else 0.0)
        self.mem.append(y.detach().mean(0))
        return out


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize(("cls", "attribute"), [(_TensorList, "cache"), (_TensorDict, "d"), (_HiddenTuple, "hidden"),
                                                (_TensorDeque, "mem")])
def test_tensors_kept_in_a_list_dict_or_tuple_are_state_too(cls: type[nn.Module], attribute: str, cut: str) -> None:
    """The review (layers F1, F3, F4): tensors inside a container were left out of the watch (for nn.LSTM's
    _flat_weights), and each of these trained silently wrong where the batch is cut (4.6e-4, 1.5e-2, 3.5e-3 in
    the loss at step 2); the same state in a plain tensor attribute was refused. A deque's failed with torch's raw
    DataDependentOutputException (a fake tensor of the Plan's prediction left in it)."""
    with pytest.raises((ValueError, sw.collectives.RankFailed)) as caught:
        _equivalent(_model(cls), cut)
    message = _message(caught.value)
    assert f"layer '0' set its module's attributes ['{attribute}'] on its first call from its input's values" \
        in message, message


@pytest.mark.parametrize("cls", [_TensorList, _TensorDict, _HiddenTuple])
def test_state_in_containers_on_one_device_equals_torch_loop(cls: type[nn.Module]) -> None:
    _torch_loop.assert_one_device_equals_torch_sgd(_model(cls), _batches())


@pytest.mark.parametrize("cut", list(CUTS))
def test_an_lstm_whose_weights_sit_in_a_list_still_trains_as_one_device(cut: str) -> None:
    """nn.LSTM lists its weights in _flat_weights (the step's own on each call): weights are not state."""

    class Recurrent(nn.Module):
        def __init__(self, d: int = 4) -> None:
            super().__init__()
            self.rnn = nn.LSTM(d, d, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x.unsqueeze(1))[0].squeeze(1)

    _equivalent(_model(Recurrent), cut)


class _CentreInObject(nn.Module):
    """DINO-style running centre kept in a plain object (``self.stats.centre``), read by the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.stats = types.SimpleNamespace(centre=torch.zeros(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        out = y - self.stats.centre
        self.stats.centre = 0.9 * self.stats.centre + 0.1 * y.detach().mean(0)
        return out


def test_state_kept_in_an_object_attribute_is_refused_naming_it() -> None:
    """The review (s38 review2 F3): a running centre kept in a SimpleNamespace escaped the state watch; the shape
    prediction's fake tensor left in it failed the step with torch's raw DataDependentOutputException."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(_CentreInObject().double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, generator=gen, dtype=torch.float64)) for _ in range(2)]
    with pytest.raises(sw.collectives.RankFailed, match=r"set its module's attributes \['stats'\] on its first call "
                                                         r"from its input's values"):
        sw.testing.assert_equivalent(sw.shard_params(step, "dp", 1), step, sw.Mesh(dp=2), batches, params)


class _FlagThenCentre(nn.Module):
    """A centre read from the second call on, behind a flag the first call sets (a warm-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.started, self.centre = nn.Linear(6, 4), False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        out = y - self.centre if self.started else y
        self.centre, self.started = y.detach().mean(0), True
        return out


class _ReadInBackward(nn.Module):
    """A scale set in forward from the values, read by a gradient hook in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gscale = nn.Linear(6, 4), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(lambda g: g * self.gscale)
        self.gscale = y.detach().abs().mean()
        return y


class _RunningMax(nn.Module):
    """A running max (delayed scaling's amax) updated and then read in the same call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.amax = nn.Linear(6, 4), torch.tensor(1.0, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.amax = torch.maximum(self.amax, x.detach().abs().max())
        return self.lin(x / self.amax)


@pytest.mark.parametrize("module", [_FlagThenCentre, _ReadInBackward, _RunningMax])
def test_state_the_step_reads_later_in_backward_or_after_writing_it_is_still_refused(module: type) -> None:
    """The review (s39 review3 H1, H1c): the first version of the written-only judgement compared the call's output
    from the module as it was and holding other values: a value read only from the second call on, by a gradient hook
    in backward, or written and then read (a running max) computed alike, and trained silently (2e-2 to 6e-2 off)."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(module().double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64) * 10,
                torch.randn(8, 4, generator=gen, dtype=torch.float64)) for _ in range(3)]
    with pytest.raises(sw.collectives.RankFailed, match=r"set its module's attributes \['(centre|gscale|amax)'\] on "
                                                         r"its first call from its input's values"):
        sw.testing.assert_equivalent(sw.shard_params(step, "dp", 1), step, sw.Mesh(dp=2), batches, params)


@dataclasses.dataclass(slots=True)
class _ModelArgs:
    """torchtitan-style model arguments, a slots dataclass every block holds and only reads."""

    dim: int = 6
    norm_eps: float = 1e-5


class _ArgsBlock(nn.Module):
    def __init__(self, args: _ModelArgs) -> None:
        super().__init__()
        self.args, self.lin = args, nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(self.lin(x), (self.args.dim,), eps=self.args.norm_eps)


def test_blocks_holding_a_slots_dataclass_of_arguments_train() -> None:
    """The review (s39 review3 F2): a slots dataclass (no __dict__) held by the blocks failed every distributed step
    with a raw "vars() argument must have __dict__ attribute" once dataclasses of one's own were watched."""
    args = _ModelArgs()
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_ArgsBlock(args), _ArgsBlock(args)).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 6, generator=gen, dtype=torch.float64)) for _ in range(2)]
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
