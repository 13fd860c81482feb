"""Every rank passes the same global batch, and a distributed step checks that it did.

Each rank takes its part of the global batch (its rows under shard_params, its micro-batches
under pipeline, all of it under tensor_parallel). Ranks that load their data themselves and
draw different batches would train on a mix nobody asked for, silently: the step sums a
fingerprint of the batch with its metrics (no collective of its own) and refuses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.engine.run import metrics
from shardwise.engine.run.metrics import Summed, batch_fingerprint, batch_weight
from shardwise.testing.models import mlp


def _problem(dtype: torch.dtype = torch.float64) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 8, 3]).to(dtype))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params


def _batch(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=gen, dtype=dtype), torch.randn(8, 3, generator=gen, dtype=dtype)


STACKS = {
    "zero-3": (lambda s: sw.shard_params(s, "dp", 3), {"dp": 2}),
    "pipeline": (lambda s: sw.pipeline(s, "pp", "1f1b", 2), {"pp": 2}),
    "tensor parallel": (lambda s: sw.tensor_parallel(s, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}), {"tp": 2}),
    "dp x tp": (
        lambda s: sw.shard_params(sw.tensor_parallel(s, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}), "dp"),
        {"dp": 2, "tp": 2},
    ),
}


@pytest.mark.parametrize("name", list(STACKS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_ranks_that_pass_different_batches_are_refused(name: str, dtype: torch.dtype) -> None:
    step, params = _problem(dtype)
    transform, axes = STACKS[name]
    composed, mesh = transform(step), sw.Mesh(**axes)

    def each_its_own() -> None:
        state = composed.init(params, mesh)
        composed(state, _batch(mesh.rank, dtype))  # a different batch on every rank

    with pytest.raises(
        sw.collectives.RankFailed, match=r"the ranks( of axis .tp.)? passed different batches to this step"
    ):
        sw.launch(each_its_own, mesh.size, timeout=60)

    def the_same() -> float:
        _, metrics = composed(composed.init(params, mesh), _batch(0, dtype))
        return float(metrics["loss"])

    assert len(set(sw.launch(the_same, mesh.size, timeout=60))) == 1


def test_rows_swapped_between_ranks_are_refused_too() -> None:
    step, params = _problem()
    composed, mesh = sw.shard_params(step, "dp", 3), sw.Mesh(dp=2)
    x, y = _batch(0)

    def swapped() -> None:
        order = torch.arange(8) if mesh.rank == 0 else torch.arange(8).flip(0)
        composed(composed.init(params, mesh), (x[order], y[order]))  # the same rows, in another order

    with pytest.raises(sw.collectives.RankFailed, match="different batches"):
        sw.launch(swapped, mesh.size, timeout=60)


@pytest.mark.parametrize("name", ["zero-3", "pipeline", "tensor parallel"])
def test_a_rank_that_switches_to_another_step_after_init_is_refused(name: str) -> None:
    """init compares the ranks' steps; a step swapped in later (a new learning rate on one rank, or
    clipping on one rank only) is compared at every call, its digest summed with the metrics."""
    _, params = _problem()
    chain = sw.functionalize(mlp([4, 8, 8, 3]).double())[0]
    transform, axes = STACKS[name]
    mesh = sw.Mesh(**axes)
    first = transform(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)))
    others = {
        "learning rate": lambda: transform(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.01, momentum=0.9))),
        "clipping": lambda: transform(
            sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=0.01)),
    }
    for other in others.values():

        def switch(other: Any = other) -> None:
            state, _ = first(first.init(params, mesh), _batch(0))
            # Every rank builds its next step; rank 0's is the same as before, the others' not.
            later = first if mesh.rank == 0 else other()
            later(state, _batch(1))

        with pytest.raises(sw.collectives.RankFailed, match="the ranks called steps built differently"):
            sw.launch(switch, mesh.size, timeout=60)

    def the_same_step_built_again() -> int:  # a new step object, built alike: not refused
        state, _ = first(first.init(params, mesh), _batch(0))
        again = transform(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1, momentum=0.9)))
        return again(state, _batch(1))[0].step

    assert sw.launch(the_same_step_built_again, mesh.size, timeout=60) == [2] * mesh.size


def test_a_quiet_step_exchanges_nothing_and_so_checks_nothing() -> None:
    # metrics=() and no rule that needs the sums: no exchange, so no check either (documented).
    step, params = _problem()
    composed, mesh = sw.shard_params(step.with_metrics(()), "dp", 3), sw.Mesh(dp=2)

    def each_its_own() -> int:
        state, _ = composed(composed.init(params, mesh), _batch(mesh.rank))
        return state.step

    assert sw.launch(each_its_own, mesh.size, timeout=60) == [1, 1]


@pytest.mark.parametrize("name", ["zero-3", "pipeline"])
def test_only_a_step_that_exchanges_metrics_hashes_its_batch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fingerprint rides along the metrics' exchange; hashing the batch costs a quiet pipelined
    # MLP step a few percent, so a step that exchanges nothing must not compute it at all.
    from shardwise.engine.step import run_inputs

    hashed: list[int] = []

    def counting(batch: Any) -> torch.Tensor:
        hashed.append(1)
        return batch_fingerprint(batch)

    monkeypatch.setattr(run_inputs, "batch_fingerprint", counting)
    step, params = _problem()
    transform, axes = STACKS[name]
    mesh = sw.Mesh(**axes)
    for composed, expected in ((transform(step.with_metrics(())), 0), (transform(step), mesh.size)):
        hashed.clear()

        def one_step(composed: sw.Step = composed) -> int:
            state, _ = composed(composed.init(params, mesh), _batch(0))
            return state.step

        assert sw.launch(one_step, mesh.size, timeout=60) == [1] * mesh.size
        assert len(hashed) == expected, (composed.describe(), hashed)


@pytest.mark.parametrize("ranks", [2, 8, 64])
def test_the_check_is_rounding_safe_and_sees_one_rank_with_another_batch(ranks: int) -> None:
    # Every rank's share summed in float32, one rounding per add, as an all-reduce does.
    f, other = batch_fingerprint(_batch(3)), batch_fingerprint(_batch(4))

    def summed(off: int | None, theirs: torch.Tensor) -> Summed:
        total = torch.zeros((), dtype=torch.float32)
        weighted = torch.zeros((), dtype=torch.float32)
        for r in range(ranks):
            mine = theirs if r == off else f
            total = total + mine.float()
            weighted = weighted + (mine * batch_weight(r)).float()
        return Summed(batch=(total, weighted))

    assert not summed(None, f).batches_differ(list(range(ranks)))
    assert summed(ranks // 2, other).batches_differ(list(range(ranks)))  # one rank drew its own batch
    if ranks <= 8:  # float32 at a few ranks sees a batch whose fingerprint is off by a percent
        assert summed(ranks // 2, f * 1.01).batches_differ(list(range(ranks)))


def _square_problem() -> tuple[sw.Step, Any, tuple[torch.Tensor, torch.Tensor]]:
    """A model whose inputs and targets have one shape, so that they can be swapped."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 4]).double())
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(8, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    return sw.shard_params(step, "dp", 3), params, (x, y)


def _launch_with(batch_of: Any) -> list[int]:
    step, params, (x, y) = _square_problem()
    mesh = sw.Mesh(dp=2)

    def run() -> int:
        state, _ = step(step.init(params, mesh), batch_of(mesh.rank, x, y))
        return state.step

    return sw.launch(run, mesh.size, timeout=60)


def test_inputs_and_targets_swapped_on_one_rank_are_refused() -> None:
    with pytest.raises(sw.collectives.RankFailed, match="passed different batches"):
        _launch_with(lambda rank, x, y: (y, x) if rank == 1 else (x, y))


def test_nan_on_one_rank_where_another_has_a_number_is_refused() -> None:
    def nan_or_half(rank: int, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        x = x.clone()
        x[5, 1] = float("nan") if rank == 0 else 0.5  # in rank 1's rows: rank 0 never computes it
        return x, y

    with pytest.raises(sw.collectives.RankFailed, match="passed different batches"):
        _launch_with(nan_or_half)


def test_identical_batches_pass_with_nan_infinities_and_signed_zeros() -> None:
    def marked(rank: int, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        x = x.clone()
        # NaN made by different ops on each rank (their signs and payloads may differ), and -0.0
        # where the other rank has 0.0: the same values.
        inf = torch.tensor(float("inf"))
        x[0, 0] = torch.tensor(0.0) / 0.0 if rank == 0 else inf - inf
        x[1, 1], x[2, 2] = float("inf"), -float("inf")
        x[3, 3] = -0.0 if rank == 0 else 0.0
        return x, y

    assert _launch_with(marked) == [1, 1]


def test_the_fingerprint_sees_each_leaf_at_its_place_and_non_finite_values() -> None:
    x, y = _batch(0)
    assert batch_fingerprint((x, y)) == batch_fingerprint((x.clone(), y.clone()))
    as_dict = {"inputs": x, "targets": y}
    assert batch_fingerprint(as_dict) != batch_fingerprint({"inputs": y.T, "targets": x.T})
    assert batch_fingerprint((x, y)) != batch_fingerprint((y, x))
    assert batch_fingerprint((x, y)) != batch_fingerprint([x, y])  # another container
    for value in (0.5, 0.0, float("inf"), -float("inf"), 1.5, -1.5):
        a, b = x.clone(), x.clone()
        a[2, 3], b[2, 3] = float("nan"), value
        assert batch_fingerprint((a, y)) != batch_fingerprint((b, y)), value
    assert batch_fingerprint(torch.tensor([1, 2])) != batch_fingerprint(torch.tensor([2, 1]))


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.int64, torch.int32,
          torch.uint8, torch.bool]


def _leaf(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(0, 100, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)


def _another(value: torch.Tensor) -> torch.Tensor:
    """The next representable value after ``value`` (a bool's other one): the smallest change."""
    if value.dtype == torch.bool:
        return ~value
    if not value.dtype.is_floating_point and not value.dtype.is_complex:
        return value + 1
    if value.dtype.is_complex:
        return torch.complex(value.real, torch.nextafter(value.imag, torch.tensor(float("inf"))))
    return torch.nextafter(value, torch.tensor(float("inf"), dtype=value.dtype))


@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40), cols=st.integers(1, 33), seed=st.integers(0, 2**16),
       where=st.floats(0, 1, exclude_max=True))
def test_any_one_element_changed_by_the_smallest_step_changes_the_fingerprint(
        dtype: torch.dtype, rows: int, cols: int, seed: int, where: float) -> None:
    # The hash is of each element's bits at its position: the smallest change to one element (the
    # next float, the next integer, a flipped bool), anywhere in either leaf, gives another number.
    x, y = _leaf(dtype, (rows, cols), seed), _leaf(dtype, (cols,), seed + 1)
    for leaf in (0, 1):
        changed = [x.clone(), y.clone()]
        flat = changed[leaf].view(-1)
        k = int(where * flat.numel())
        flat[k] = _another(flat[k])
        assert batch_fingerprint(tuple(changed)) != batch_fingerprint((x, y)), (leaf, k)
    assert batch_fingerprint((x.clone(), y.clone())) == batch_fingerprint((x, y))


INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_nan_is_one_value_and_signed_zeros_are_equal_in_every_float_dtype(dtype: torch.dtype) -> None:
    x = _leaf(dtype, (4, 5), 0)
    a, b = x.clone(), x.clone()
    bits = INT_OF[dtype.itemsize]
    quiet = torch.tensor(float("nan"), dtype=dtype)
    other = ((quiet.view(bits) | 1) ^ torch.iinfo(bits).min).view(dtype)  # another payload, the sign flipped
    assert not torch.equal(quiet.view(bits), other.view(bits)) and bool(other.isnan())
    a[0, 0], b[0, 0] = quiet, other
    a[1, 1], b[1, 1] = -0.0, 0.0
    a[2, 2] = b[2, 2] = float("inf")
    a[3, 3] = b[3, 3] = -float("inf")
    assert batch_fingerprint(a) == batch_fingerprint(b)
    c = b.clone()
    c[2, 2] = torch.finfo(dtype).max  # the largest finite value is not infinity
    assert batch_fingerprint(c) != batch_fingerprint(b)


def test_a_step_remade_by_with_metrics_each_call_reads_its_rules_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's loop makes ``with_metrics(...)`` steps call after call; a loss closing over a large
    tensor made each of them read it again for its digest (a 32M-element table: 0.7 s a step)."""
    from shardwise.engine.run.agreement import stable_text
    from shardwise.engine.step import step as step_module

    read: list[object] = []

    def counting(value: object) -> str:
        read.append(value)
        return stable_text(value)

    monkeypatch.setattr(step_module, "stable_text", counting)
    step, _ = _problem()
    sharded = sw.shard_params(step, "dp", 3)
    digests = {sharded.with_metrics(("loss",) if i % 2 else ()).agreement_digest for i in range(6)}
    assert len(digests) == 2  # the metrics are in the digest
    assert len(read) == 5  # optimizer, loss, precision, clipping, tokens: once


ROW = metrics._ROW  # the words hashed with one row of keys
# Past what one pass reads (metrics._DIGESTED_ROWS rows): two passes, the second's last row short.
BIG = ROW * metrics._DIGESTED_ROWS + 2 * ROW + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.int64])
def test_a_leaf_of_several_rows_sees_one_element_changed_in_any_row_and_rows_swapped(dtype: torch.dtype) -> None:
    x = _leaf(dtype, (BIG,), 0)
    fingerprint = batch_fingerprint((x,))
    words = 2 if dtype.is_complex else 1  # a complex element is two words
    # the first row, its end, the second row, the second pass's first row, the short last one
    for k in (0, ROW // words - 1, ROW // words, ROW * metrics._DIGESTED_ROWS // words, BIG - 1):
        changed = x.clone()
        changed[k] = _another(changed[k])
        assert batch_fingerprint((changed,)) != fingerprint, k
    rows = x[: 2 * ROW].view(2, -1)
    swapped = torch.cat([rows.flip(0).reshape(-1), x[2 * ROW :]])  # the same words in each row, rows moved
    assert batch_fingerprint((swapped,)) != fingerprint
    assert batch_fingerprint((x.clone(),)) == fingerprint


def test_batches_of_varying_lengths_keep_one_row_of_keys_per_leaf() -> None:
    """Each leaf takes its keys from one cached row (a prefix for a shorter leaf): batches padded to their
    longest sequence, of another length every step, kept a row of keys per length (up to 16 of 8 MiB)."""
    metrics._cached_keys.cache_clear()
    gen = torch.Generator().manual_seed(0)
    fingerprints = set()
    for length in range(100, 2100, 100):  # 20 lengths: ids (int64 words) and a float mask (int32 words)
        fingerprints.add(float(batch_fingerprint((torch.randint(0, 9, (4, length), generator=gen),
                                                  torch.randn(4, length, generator=gen)))))
    assert len(fingerprints) == 20
    assert metrics._cached_keys.cache_info().currsize == 2, metrics._cached_keys.cache_info()


def _fingerprint_peak(nbytes: int) -> tuple[int, int]:
    """(peak memory of one fingerprint of a float32 batch of ``nbytes``, above the RSS before it; the
    batch's bytes), on a rank whose glibc returns freed memory at once, after a warm-up (its keys)."""
    from shardwise.testing.memory import PeakRSS

    batch = (torch.randn(nbytes // 4 // 64, 64), torch.randn(8, 4))
    batch_fingerprint(batch)
    meter = PeakRSS()
    batch_fingerprint(batch)
    return meter.peak(), batch[0].nbytes


@pytest.mark.gloo  # on the suite's LIVE_MALLOC gloo ranks
def test_the_fingerprint_of_a_large_batch_takes_a_rows_memory_not_a_multiple_of_the_batch(
        live_malloc_gloo4: Any) -> None:
    # Made for the whole leaf at once, the keys' arithmetic (int64 positions mixed through splitmix64)
    # and the words took 9x the batch: 144 MB beside a 16 MB batch, before every step that checks it.
    # A row at a time: its words (4 MiB of int32) and their sum's int64 copy (8 MiB), whatever the batch.
    peak, nbytes = live_malloc_gloo4.run(_fingerprint_peak, 16 << 20)[0]
    assert peak < 13 << 20, f"{peak / 2**20:.1f} MiB for a {nbytes / 2**20:.0f} MiB batch"
