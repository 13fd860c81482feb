"""A Region whose first call the probe (region_probe.py) cannot judge by its values says so: one
sw.tp.RegionNotJudged warning per Region class and cause in the process (the threads backend runs both ranks of tp2 in
it), naming the Region, the cause and what to do; the step goes on and equals one device. A judged Region, and tp
size 1, say nothing. The probe's copies set no count on an object another rank thread reads (probe_counts.py)."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.collectives.launch import launch
from shardwise.engine.stack import in_layer
from shardwise.transforms.context_parallel import context_parallel
from shardwise.transforms.tensor_parallel import not_judged, region_probe
from shardwise.transforms.tensor_parallel.rank_flow import flow

from ..context_parallel.test_cp_step import batches as cp_batches
from ..context_parallel.test_cp_step import gpt
from .test_tp_region_probe import BATCH, PLAN, SEQ, Attn, D


class KVCache:
    """A stand-in for a key/value cache: an object the attention updates in place."""

    def __init__(self) -> None:
        self.calls = 0


class CachedAttn(Attn):
    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:  # type: ignore[override]
        if cache is not None:
            cache.calls += 1
        return super().forward(x)


class NoisyAttn(Attn):
    """Draws a random number in eval mode too (model code calling torch.rand itself), which adds nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.0 * torch.rand(1, dtype=x.dtype)


class GatedAttn(Attn):
    """A gate whose Linear is a Colwise with its output gathered: no rank computes it alone."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.gate = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.sigmoid(self.gate(x))


class Float32Attn(Attn):
    """Code that refuses float64 (the probe's copies run in it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise TypeError("this attention runs in float32 only")
        return super().forward(x)


class MeshAttn(Attn):
    """Reads the mesh (as context parallel's attention does through the AttentionInterface): its copies run
    under no_mesh(), so that nothing is sent."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (sw.collectives.axis_size("tp") // sw.collectives.axis_size("tp"))


class Block(nn.Module):
    def __init__(self, attn: nn.Module, cache: bool = False) -> None:
        super().__init__()
        self.norm, self.attn, self.cache = nn.LayerNorm(D), attn, KVCache() if cache else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.attn(h) if self.cache is None else self.attn(h, cache=self.cache))


def _check(
    block: Callable[[], nn.Module], plan: dict[str, Any] | None = None, dtype: torch.dtype = torch.float64,
    mesh: sw.Mesh | None = None, rtol: float = 1e-9,
) -> list[str]:
    """The RegionNotJudged messages of two steps of a two-block model at tp2 (threads), which must equal one
    device (float64 at 1e-9: tensor parallel only reorders sums)."""
    torch.manual_seed(0)
    model = nn.Sequential(block(), block()).to(dtype).train()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(BATCH, SEQ, D, dtype=dtype, generator=gen) for _ in range(2)) for _ in range(2)]
    tp = sw.tensor_parallel(step, "tp", plan or PLAN)
    with _said() as said:
        sw.testing.assert_equivalent(tp, step, mesh or sw.Mesh(tp=2), batches, params, rtol=rtol)
    return said


class _said:
    """The RegionNotJudged messages warned in the block, from every rank thread (others shown as usual)."""

    def __enter__(self) -> list[str]:
        self.catch = warnings.catch_warnings(record=True)
        self.caught = self.catch.__enter__()
        warnings.simplefilter("always")
        self.messages: list[str] = []
        return self.messages

    def __exit__(self, *exc: Any) -> None:
        self.catch.__exit__(*exc)
        for w in self.caught:
            if issubclass(w.category, sw.tp.RegionNotJudged):
                self.messages.append(str(w.message))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _one_each(said: list[str], labels: list[str], cls: str, reason: str, advice: str) -> None:
    """Exactly one warning for the Regions of one class (not one per rank, nor one per layer), naming the first
    that met the cause, the reason, what is unchecked, the advice."""
    assert len(said) == 1, said
    for label, message in zip(labels[:1], said, strict=True):
        assert message.startswith(f"tensor_parallel: Region {label!r} (a {cls}; said once in this process for every "
                                  f"{cls} Region with this cause) was not judged by its values on its first call: "
                                  ), message
        assert reason in message and advice in message, message
        assert "go unchecked for it" in message, message


LABELS = ["0.attn", "1.attn"]


def test_a_judged_region_says_nothing() -> None:
    assert _check(lambda: Block(Attn("plain"))) == []


def test_a_call_given_a_cache_is_not_judged_and_says_so_once_per_region() -> None:
    said = _check(lambda: Block(CachedAttn("plain"), cache=True))
    _one_each(said, LABELS, "CachedAttn", "it was called with KVCache (an object that may hold state: a key/value "
              "cache, which its copies would change)", "Make the first call without it (a step without a cache")


def test_tp_size_1_judges_nothing_and_says_nothing() -> None:
    assert _check(lambda: Block(CachedAttn("plain"), cache=True), mesh=sw.Mesh(tp=1)) == []


def test_copies_drawing_random_numbers_in_eval_mode_say_so() -> None:
    said = _check(lambda: Block(NoisyAttn("plain")))
    _one_each(said, LABELS, "NoisyAttn", "its copies drew random numbers in eval mode",
              "Draw only in training mode (dropout modules, F.dropout(..., training=self.training))")


def test_a_gathered_colwise_inside_says_so_naming_it() -> None:
    said = _check(lambda: Block(GatedAttn("plain")), {**PLAN, "*.attn.gate": sw.tp.Colwise(output="replicated")})
    _one_each(said, LABELS, "GatedAttn", "it holds a Colwise whose output is gathered ", "sw.tp.PerHead()")
    assert "'0.attn.gate', whose values no rank computes alone" in sorted(said)[0]


def test_copies_that_refuse_float64_say_so() -> None:
    said = _check(lambda: Block(Float32Attn("plain")), dtype=torch.float32, rtol=1e-5)
    _one_each(said, LABELS, "Float32Attn",
              "its copies could not run (TypeError: this attention runs in float32 only)",
              "code that refuses float64")


def test_copies_reaching_a_collective_say_so() -> None:
    """(Run at tp2 alone: the single-device step has no mesh to read.)"""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(Block(MeshAttn("plain")), Block(MeshAttn("plain"))).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    tp = sw.tensor_parallel(step, "tp", PLAN)
    batch = (torch.randn(BATCH, SEQ, D, dtype=torch.float64), torch.randn(BATCH, SEQ, D, dtype=torch.float64))
    with _said() as said:
        launch(lambda: tp(tp.init(params, sw.Mesh(tp=2)), batch), 2)
    _one_each(said, LABELS, "MeshAttn", "its copies reached a collective (axis_size(axis='tp') needs a mesh",
              "It is judged under tensor_parallel alone")


def test_copies_out_of_memory_give_it_back_say_so_and_the_step_equals_one_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first product in the copies raises torch.OutOfMemoryError: not retried on the whole input (it needs
    more), the copies' tensors freed before the step goes on, the device's cache left alone without CUDA."""
    held: list[weakref.ref[torch.Tensor]] = []
    freed: list[bool] = []
    give_back = not_judged.give_back_memory

    def out_of_memory(m: nn.Module, kind: str | None, x: torch.Tensor) -> torch.Tensor:
        held.append(weakref.ref(m._parameters["weight"]))  # a float64 copy of the rank's weight (tiled)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore lines")

    def checked_give_back() -> None:
        give_back()
        freed.append(all(ref() is None for ref in held))

    monkeypatch.setattr(region_probe, "_product", out_of_memory)
    monkeypatch.setattr(not_judged, "give_back_memory", checked_give_back)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("no CUDA here: its cache is not touched"))
    said = _check(lambda: Block(Attn("plain")))
    _one_each(said, LABELS, "Attn", "its float64 copies did not fit in memory (CUDA out of memory. Tried to allocate "
              "2.00 GiB.); the call's input tensors hold 0.00", "Free memory before the first step")
    assert len(held) == 4 and freed == [True] * 4  # each rank's two Regions: one try each, freed


def test_context_parallel_under_tensor_parallel_says_so_and_equals_one_device() -> None:
    step, params = gpt()
    composed = sw.tensor_parallel(context_parallel(step, "cp"), "tp", sw.tp.tiny_gpt_plan(vocab_parallel=False))
    with _said() as said:
        sw.testing.assert_equivalent(composed, step, sw.Mesh(cp=2, tp=2), cp_batches(), params)
    _one_each(said, ["blocks.0.attn", "blocks.1.attn"], "CausalSelfAttention", "through another transform's rewrite "
              "(context_parallel's attention under tensor_parallel)", "It is judged under tensor_parallel alone: run "
              "the same model and plan once without context_parallel")


def test_the_warning_is_silenced_by_its_class_and_said_once_per_module_class_and_cause() -> None:
    with _said() as said:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", category=sw.tp.RegionNotJudged)
            not_judged.say_not_judged("0.attn", "Attn", "state", "a reason", "advice")
        not_judged.say_not_judged("0.attn", "Attn", "state", "a reason", "advice")  # said (silenced): not again
        not_judged.say_not_judged("0.attn", "Attn", "random", "another reason", "advice")
        not_judged.say_not_judged("1.attn", "Attn", "random", "another reason", "advice")  # its class said it
        not_judged.say_not_judged("1.mlp", "MLP", "random", "another reason", "advice")
    assert len(said) == 2 and all("another reason" in m for m in said), said
    assert "Region '0.attn' (a Attn;" in said[0] and "Region '1.mlp' (a MLP;" in said[1], said


# -- a count held by an object every rank thread shares -------------------------------------------------------
class SharedConfig(SimpleNamespace):
    """A config that deep-copies as itself (a singleton, as some libraries make them): every rank thread's replica
    of the module, and its Region's forward, hold this one object."""

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedConfig:
        return self


class SharedWidthMLP(nn.Module):
    """An MLP Region whose inner width is a local= count held by a config every rank thread shares. Rank 1 reads
    the width at the end of its real call while rank 0's probe runs its whole copy (two Events order them)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.cfg = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), SHARED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x)).view(*x.shape[:-1], self.cfg.width)
        out = self.down(h)
        if getattr(flow, "probing", False):  # a copy (rank 1 waits below until rank 0's first one runs)
            if not PROBING.is_set():
                PROBING.set()
                assert RANK1_READ.wait(10), "rank 1 never read the width"
        elif not in_layer.predicting_now() and sw.collectives.axis_index("tp") == 1:  # rank 1's step call
            assert PROBING.wait(10), "rank 0's probe never ran its whole copy"
            READ.append(self.cfg.width)  # what rank 1's real layer reads now
            RANK1_READ.set()
        return out


SHARED = SharedConfig(width=4 * D)
PROBING, RANK1_READ = threading.Event(), threading.Event()
READ: list[int] = []


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = SharedWidthMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def test_the_probe_sets_no_count_on_an_object_another_rank_thread_reads() -> None:
    """Rank 1 reads the shared width (its rank's, 4D / 2) while rank 0's probe holds the whole copy: before, the
    probe set the whole width (4D) on the shared config for the copies' run, and rank 1 read that."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(MLPBlock()).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    plan = {"*.mlp": sw.tp.Region(local=("cfg.width",)), "*.mlp.up": sw.tp.Colwise(), "*.mlp.down": sw.tp.Rowwise()}
    tp = sw.tensor_parallel(step, "tp", plan)
    batch = (torch.randn(BATCH, SEQ, D, dtype=torch.float64), torch.randn(BATCH, SEQ, D, dtype=torch.float64))
    PROBING.clear()
    RANK1_READ.clear()
    READ.clear()
    try:
        with _said() as said:
            # rng=None: the step seeds no random streams, so the rank threads' computes do not take turns with
            # torch's shared generators (a lock each compute holds, lent only while it waits in a collective:
            # with it, no rank thread computes while another one's probe runs, which has no collective).
            # Both ranks' states made first (their parameters' initializers draw from torch's generator, which the
            # probe would see move).
            inited = threading.Barrier(2)

            def rank() -> None:
                state = tp.init(params, sw.Mesh(tp=2))._replace(rng=None)
                inited.wait(10)
                tp(state, batch)

            launch(rank, 2)
    finally:
        SHARED.width = 4 * D  # (the Region's own calls leave the rank's count on it)
    assert PROBING.is_set() and READ == [4 * D // 2], READ
    # Judged (the copies hold a config of their own), or, as the ranks here compute at once and share torch's
    # unseeded generator, left unjudged as drawing random numbers (the other rank's draws moved it): a gap said.
    assert all("its copies drew random numbers" in m for m in said), said


def test_each_copy_is_freed_as_it_ends_without_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies' float64 tensors (the whole ones tp times the rank's) go as each copy ends, by reference counts:
    no cycle (a twin and its probe forward, a recursive closure over the twins) waits for the collector."""
    held: list[weakref.ref[torch.Tensor]] = []
    product = region_probe._product

    def recorded(m: nn.Module, kind: str | None, x: torch.Tensor) -> torch.Tensor:
        held.append(weakref.ref(m._parameters["weight"]))
        return product(m, kind, x)

    monkeypatch.setattr(region_probe, "_product", recorded)
    gc.disable()
    try:
        assert _check(lambda: Block(Attn("plain"))) == []
        alive = sum(ref() is not None for ref in held)
    finally:
        gc.enable()
    assert held and alive == 0, f"{alive} of {len(held)} copied weights still held"


class SlopesCachedAttn(CachedAttn):
    """Another class (of another model) whose attention computes ALiBi's slopes from the rank's count."""


def test_another_class_with_the_same_paths_says_so_again_and_the_same_class_says_it_once() -> None:
    """Keyed by the Region's path alone, a second model in the process (a notebook, a sweep) whose Regions are
    called '0.attn' and '1.attn' too said nothing, though its unjudged attention computed a per-head value from
    the rank's count (its loss off by 1.4e-3 relative at step 1; review6). Keyed by the module class: a model of
    another class says so; one of the class already said (every such Region's case) does not again."""
    said = _check(lambda: Block(CachedAttn("plain"), cache=True))
    assert len(said) == 1, said
    assert _check(lambda: Block(CachedAttn("plain"), cache=True)) == []  # a second model of its class: said
    torch.manual_seed(0)
    wrong = nn.Sequential(*(Block(SlopesCachedAttn("get_slopes(self.n_head)"), cache=True) for _ in range(2))).double()
    chain, params = sw.functionalize(wrong)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(BATCH, SEQ, D, dtype=torch.float64, generator=gen) for _ in range(2))]
    with _said() as again, pytest.raises(sw.testing.NotEquivalentError):
        sw.testing.assert_equivalent(sw.tensor_parallel(step, "tp", PLAN), step, sw.Mesh(tp=2), batches, params,
                                     rtol=1e-9)
    _one_each(again, LABELS, "SlopesCachedAttn", "it was called with KVCache", "Make the first call without it")
