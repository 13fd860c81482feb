"""ZeRO-1/2 with an in-place optimizer writes the updated parameters into the ones the step was
given, one bucket at a time (plan/lower.py: ``gathers_into_params``): each bucket's all-gather
writes its rows into the parameters (through shared memory, straight from the peers' slots;
elsewhere copied in at its wait) before the next is issued, so the step's end holds the parameters
once, not twice (as FairScale's OSS does). The arithmetic is the same as handing the gathered
buffers on (a functional optimizer's step): the results are bitwise those, over several steps."""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.engine.plan.lower import gathers_into_params
from shardwise.engine.torch_api import view_base
from shardwise.testing.models import mlp

KIB = 1 / 1024


def _problem(inplace: bool, world: int) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 8, 8, 8, 5]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2, inplace=inplace), clip_norm=1.0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4 * world, 6, generator=gen, dtype=torch.float64),
                torch.randn(4 * world, 5, generator=gen, dtype=torch.float64)) for _ in range(4)]
    return step, params, batches


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [t.clone() for t in optree.tree_leaves(tree)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("options", [{"bucket_mb": 0.3 * KIB}, {"bucket_mb": 1.1 * KIB}, {"accumulation": 2}],
                         ids=["each-unit", "pairs", "accumulation"])
def test_the_in_place_step_writes_its_parameters_and_equals_the_functional_one(
        world: int, stage: int, options: dict) -> None:
    in_place = sw.shard_params(_problem(True, world)[0], "dp", stage, **options)
    base, params, batches = _problem(False, world)
    functional = sw.shard_params(base, "dp", stage, **options)
    assert gathers_into_params(in_place, "cpu") and not gathers_into_params(functional, "cpu")

    def program(step: sw.Step) -> tuple[list, list, list, bool]:
        state = step.init(params, sw.Mesh(dp=world))
        first = {(k, n): t for k, v in state.params.items() for n, t in v.items()}
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        now = state.params.settle()  # the step's view (a read would make the next step cut again)
        same = all(now[k][n] is t for (k, n), t in first.items())  # written where they were
        return losses, _leaves(dict(now)), _leaves(state.opt_state), same

    got = sw.launch(lambda: program(in_place), world)
    want = sw.launch(lambda: program(functional), world)
    for (losses, final, opt, same), (w_losses, w_final, w_opt, w_same) in zip(got, want, strict=True):
        assert same and not w_same
        assert all(torch.equal(a, b) for a, b in zip(losses, w_losses, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(final, w_final, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(opt, w_opt, strict=True))


def test_the_plan_gathers_one_bucket_at_a_time_and_counts_one_bucket() -> None:
    step, params, batches = _problem(True, 2)
    into = sw.shard_params(step, "dp", 2, bucket_mb=1.1 * KIB)
    beside = sw.shard_params(_problem(False, 2)[0], "dp", 2, bucket_mb=1.1 * KIB)
    mesh = sw.Mesh(dp=2)
    plan, other = into.plan(mesh, params, batches[0]), beside.plan(mesh, params, batches[0])
    assert " ".join(map(str, plan.for_rank(0))).endswith(
        "gather_params(6+4) wait_params(6+4) gather_params(2+0) wait_params(2+0)")
    assert " ".join(map(str, other.for_rank(0))).endswith(
        "gather_params(6+4) gather_params(2+0) wait_params(6+4) wait_params(2+0)")
    # float64 buckets padded at dp 2: 6+4 is 72 + 46 (45 -> 46) elements, 2+0 is 72 + 56.
    assert plan.memory["params_in_flight"] == ((72 + 56) * 8,) * 2
    assert other.memory["params_in_flight"] == ((72 + 46 + 72 + 56) * 8,) * 2
    assert plan.memory["peak"][0] < other.memory["peak"][0]


def test_an_overlapped_or_bucketed_update_keeps_handing_the_buffers_on() -> None:
    step = _problem(True, 2)[0]
    assert not gathers_into_params(sw.shard_params(step, "dp", 2, gather_into_params=False), "cpu")
    assert not gathers_into_params(sw.shard_params(step, "dp", 2, overlap_gather=True), "cpu")
    assert not gathers_into_params(sw.shard_params(step, "dp", 2, update_in_buckets=True), "cpu")
    assert not gathers_into_params(sw.shard_params(step, "dp", 3), "cpu")
    assert not gathers_into_params(sw.shard_params(step, "dp", 2), "cuda")  # overlaps there by default
    assert not gathers_into_params(step, "cpu")


def test_asked_for_it_gathers_into_the_parameters_on_every_device_and_refuses_what_cannot() -> None:
    step = _problem(True, 2)[0]
    asked = sw.shard_params(step, "dp", 2, gather_into_params=True)
    assert gathers_into_params(asked, "cuda") and gathers_into_params(asked, "cpu")  # waits and updates at once
    assert "gather_into_params=True" in str(asked.transforms[-1])
    with pytest.raises(ValueError, match=r"gather_into_params=True, overlap_gather=True\): .* drop one"):
        sw.shard_params(step, "dp", 2, gather_into_params=True, overlap_gather=True)
    with pytest.raises(ValueError, match=r"gather_into_params=True, update_in_buckets=True\)"):
        sw.shard_params(step, "dp", 1, gather_into_params=True, update_in_buckets=True)
    with pytest.raises(ValueError, match=r"does not update in place.*inplace=True"):
        sw.shard_params(_problem(False, 2)[0], "dp", 2, gather_into_params=True)
    with pytest.raises(ValueError, match="stage 3 holds shards"):
        sw.shard_params(step, "dp", 3, gather_into_params=False)
    with pytest.raises(TypeError, match=r"gather_into_params='no'"):
        sw.shard_params(step, "dp", 2, gather_into_params="no")  # type: ignore[arg-type]


def test_handed_on_instead_the_in_place_step_is_the_same_arithmetic() -> None:
    """``gather_into_params=False`` with the in-place optimizer: bitwise the default's steps."""
    step, params, batches = _problem(True, 2)
    into, beside = (sw.shard_params(step, "dp", 2, gather_into_params=g) for g in (None, False))

    def program(s: sw.Step) -> list[torch.Tensor]:
        state = s.init(params, sw.Mesh(dp=2))
        for batch in batches:
            state, _ = s(state, batch)
        return _leaves(dict(state.params.settle())) + _leaves(state.opt_state)

    for got, want in zip(sw.launch(lambda: program(into), 2), sw.launch(lambda: program(beside), 2), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _gloo_steps(gather_into_params: bool | None, bucket_mb: float) -> tuple[list, list, bool, int]:
    """Four ZeRO-2 steps of in-place AdamW on two gloo ranks: the losses, the final parameters and
    optimizer state, whether the parameters stayed the tensors init made, and how many all-gathers
    wrote into them through shared memory."""
    from shardwise.collectives.backends import shared_memory_exchange

    torch.manual_seed(0)
    # Two units of 65,792 float32 (131,584 B per member, past the exchanges' 64 KiB) and one of
    # 2,056, too small: gloo's own all-gather.
    chain, params = sw.functionalize(mlp([256, 256, 256, 8]))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2, inplace=True))
    step = sw.shard_params(base, "dp", 2, bucket_mb=bucket_mb, gather_into_params=gather_into_params)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 256, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(4)]
    calls = []
    original = shared_memory_exchange.SharedMemoryExchange.all_gather_into

    def counted(self: Any, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    shared_memory_exchange.SharedMemoryExchange.all_gather_into = counted  # type: ignore[method-assign]
    try:
        state = step.init(params, sw.Mesh(dp=2))
        first = [t for v in state.params.values() for t in v.values()]
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        now = state.params.settle()
        same = all(a is b for a, b in zip(first, [t for v in now.values() for t in v.values()], strict=True))
        return losses, _leaves(dict(now)) + _leaves(state.opt_state), same, len(calls)
    finally:
        shared_memory_exchange.SharedMemoryExchange.all_gather_into = original  # type: ignore[method-assign]


@pytest.mark.gloo
@pytest.mark.parametrize("bucket_mb", [0.1, 25.0], ids=["each-unit", "one-bucket"])
def test_on_gloo_the_peers_rows_land_in_the_parameters_from_shared_memory(gloo2: Any, bucket_mb: float) -> None:
    """On two gloo ranks of one host, each bucket's gather big enough for the exchanges goes
    through shared memory straight into the parameters (once per step and such bucket), bitwise
    the steps that hand the gathered buffers on."""
    got = gloo2.run(_gloo_steps, None, bucket_mb)
    want = gloo2.run(_gloo_steps, False, bucket_mb)
    for (losses, final, same, into), (w_losses, w_final, w_same, w_into) in zip(got, want, strict=True):
        assert same and not w_same
        assert into == 4 * (2 if bucket_mb < 1 else 1) and w_into == 0, (into, w_into)
        assert all(torch.equal(a, b) for a, b in zip(losses, w_losses, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(final, w_final, strict=True))


def test_the_plan_holds_no_buffer_for_a_bucket_the_exchanges_write_into_the_parameters() -> None:
    """On a CPU a bucket big enough for the exchanges is sent from this rank's shards where they lie and
    written from the peers' shared-memory slots straight into the parameters: the Plan holds nothing
    in flight for it, of one unit or several (its shards are not joined); a smaller one (gloo's own
    all-gather) holds its buffer to its wait, as everywhere on other devices."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([256, 256, 256, 8]))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2, inplace=True))
    mesh = sw.Mesh(dp=2)
    small = (256 * 8 + 8) * 4  # the last unit, 8,224 B (even: no padding at dp 2)

    def in_flight(**options: Any) -> int:
        return sw.shard_params(base, "dp", 2, **options).plan(mesh, params).memory["params_in_flight"][0]

    assert in_flight() == 0  # one bucket of the three units
    assert in_flight(bucket_mb=0.1) == small  # each unit alone
    assert in_flight(gather_into_params=False) == 2 * (256 * 256 + 256) * 4 + small


def _laid_out(params: Any, sharding: Any) -> bool:
    return all(sharding.units[u].laid_out(params[u]) is not None for u in sharding.units)


@pytest.mark.parametrize("into", [None, False], ids=["into", "beside"])
def test_the_shards_updated_are_the_parameters_own_values_only_when_gathered_into_them(into: bool | None,
                                                                                         tmp_path: Any) -> None:
    """init lays each unit's full parameters out in one flat buffer (and a checkpoint's load does):
    gathered into them, the shards the optimizer updates in place are views of their values, so no
    copy of them is held beside the parameters (the Plan's ``master_shards``: 0). Handed on, the
    next state's parameters are other tensors: the shards are cut (views would keep the old ones)."""
    step, params, batches = _problem(True, 2)
    step = sw.shard_params(step, "dp", 2, bucket_mb=0.3 * KIB, gather_into_params=into)
    mesh = sw.Mesh(dp=2)
    master_shards = step.plan(mesh, params, batches[0]).memory["master_shards"][0]
    assert (master_shards == 0) == (into is None)

    def program() -> list[bool]:
        state = step.init(params, mesh)
        sharding = state.layout.sharding
        seen = [_laid_out(state.params, sharding)]
        for batch in batches[:2]:
            state, _ = step(state, batch)
            now = state.params.settle()
            bases = {u: sharding.units[u].laid_out(now[u]) for u in sharding.units}
            shards_are_views = all(
                view_base(state.params.shards[u]) is not None and view_base(state.params.shards[u]) is bases[u]
                for u in sharding.units)
            seen += [_laid_out(now, sharding), shards_are_views,
                     all(view_base(t) is None for t in state.params.shards.values())]
        path = tmp_path / "ckpt"
        sw.checkpoint.save(path, state, step)
        seen.append(_laid_out(sw.checkpoint.load(path, step, mesh).params, sharding))
        return seen

    for seen in sw.launch(program, 2):
        if into is None:  # laid out throughout; the carried shards are views of the parameters
            assert seen == [True, True, True, False, True, True, False, True], seen
        else:  # the parameters are the gathered buffers' views; the shards cut, their own
            assert seen[0] and seen[3] and seen[6] and seen[-1] and not seen[2] and not seen[5], seen


def test_the_plan_counts_the_slots_and_no_row_of_a_bucket_of_small_units() -> None:
    """Eleven units of 64 x 64 + 64 float32 (16,640 B each), each too small for the exchanges, in one
    bucket that is not: the bucket's messages go through the shared-memory slots (counted at every
    action), and gathered into the parameters it holds nothing else: its row is sent from the
    shards where they lie, not joined first."""
    from shardwise.collectives.backends.shared_memory_exchange import transport_bytes

    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([64] * 12))
    base = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2, inplace=True))
    memory = sw.shard_params(base, "dp", 2).plan(sw.Mesh(dp=2), params).memory
    assert memory["comm_buffers"][0] == transport_bytes(2)
    assert memory["params_in_flight"][0] == 0
    beside = sw.shard_params(base, "dp", 2, gather_into_params=False).plan(sw.Mesh(dp=2), params).memory
    assert beside["params_in_flight"][0] == 11 * (64 * 64 + 64) * 4  # the whole bucket, gathered beside
