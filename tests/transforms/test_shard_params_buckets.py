"""ZeRO-1/2 gradients in buckets: the same step as on one device, one collective per bucket.

float64 on the threads backend, 1e-12 relative, as tests/transforms/test_shard_params.py explains:
bucketing changes where values travel, not which sums are made (each element's reduction is the
same sum over ranks), so any error in the rank-major layout (a shard of the wrong unit, padding
leaking in, a row misplaced) shows as an error of order 1.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.engine.run import stage_backward
from shardwise.testing.models import mlp

F64_RTOL = 1e-12
KIB = 1 / 1024  # bucket_mb of one KiB


def _problem() -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    # Units (float64, padded to a multiple of 4 ranks): 6*8+8 = 56 values (448 B), 8*8+8 = 72
    # (576 B), twice, and 8*5+5 = 45 (48: 384 B).
    chain, params = sw.functionalize(mlp([6, 8, 8, 8, 5]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(lr=0.1, momentum=0.9), clip_norm=1.0)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 5, generator=gen, dtype=torch.float64)) for _ in range(3)]
    return step, params, batches


# Buckets smaller than every unit (each alone), of about two units, and one for all.
BUCKETS = {"split": 0.3 * KIB, "pairs": 1.1 * KIB, "all": 1.0}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("size", list(BUCKETS))
def test_buckets_are_the_single_device_step(n: int, stage: int, size: str) -> None:
    base, params, batches = _problem()
    step = sw.shard_params(base, "dp", stage, bucket_mb=BUCKETS[size])
    sw.testing.assert_equivalent(step, base, sw.Mesh(dp=n), batches, params, rtol=F64_RTOL)


@pytest.mark.parametrize("size,expected", [
    ("split", ["6", "4", "2", "0"]), ("pairs", ["6+4", "2+0"]), ("all", ["6+4+2+0"]),
])
def test_each_bucket_is_one_action_with_its_bytes(size: str, expected: list[str]) -> None:
    base, params, _ = _problem()
    plan = sw.shard_params(base, "dp", 2, bucket_mb=BUCKETS[size]).plan(sw.Mesh(dp=4), params)
    actions = plan.for_rank(0)
    reduces = [a for a in actions if a.kind == "reduce_scatter"]
    assert [a.label or a.layer for a in reduces] == expected
    padded = {"0": 56, "2": 72, "4": 72, "6": 48}
    for a in reduces:  # the bucket's units' padded gradients, float64
        assert a.nbytes == 8 * sum(padded[u] for u in (a.units or (a.layer,)))
    gathers = [a for a in actions if a.kind == "gather_params"]
    assert [a.label or a.layer for a in gathers] == expected  # the updated shards in the same buckets
    # Overlapped with the next forward: in the order that forward waits for them.
    overlapped = sw.shard_params(base, "dp", 2, bucket_mb=BUCKETS[size], overlap_gather=True).plan(
        sw.Mesh(dp=4), params).for_rank(0)
    assert [a.label or a.layer for a in overlapped if a.kind == "gather_params"] == expected[::-1]
    for a in gathers:
        assert a.nbytes == 8 * sum(padded[u] // 4 for u in (a.units or (a.layer,)))
    # Each bucket is issued right after the backward that completes its last unit.
    text = " ".join(map(str, actions))
    first = expected[0]
    assert f"B({first.split('+')[-1]}, mb=0) reduce_scatter({first})" in text
    # Stage 1 holds the full gradients: as many buckets (of the units in their order), all after the backward.
    held = sw.shard_params(base, "dp", 1, bucket_mb=BUCKETS[size]).plan(sw.Mesh(dp=4), params).for_rank(0)
    kinds = [a.kind for a in held]
    late = [a for a in held if a.kind == "reduce_scatter"]
    assert len(late) == len(expected)
    assert sorted(u for a in late for u in (a.units or (a.layer,))) == ["0", "2", "4", "6"]
    assert kinds.index("reduce_scatter") > max(i for i, k in enumerate(kinds) if k == "backward")


@pytest.mark.parametrize("in_buckets", [None, True])
@pytest.mark.parametrize("size", list(BUCKETS))
def test_the_run_issues_the_buckets_the_plan_lists(size: str, in_buckets: bool | None) -> None:
    base, params, batches = _problem()
    step = sw.shard_params(base, "dp", 2, bucket_mb=BUCKETS[size], update_in_buckets=in_buckets)
    mesh = sw.Mesh(dp=2)
    plan = step.plan(mesh, params, batches[0])

    def run() -> list:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            step(state, batches[0])
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    for rank, got in enumerate(sw.launch(run, 2)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)]


def test_bad_bucket_sizes_are_refused() -> None:
    base, _, _ = _problem()
    for bad in (0, -1.0, True, "4"):
        with pytest.raises(ValueError, match=r"bucket_mb=.*number > 0"):
            sw.shard_params(base, "dp", 2, bucket_mb=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buckets are for stages 1 and 2"):
        sw.shard_params(base, "dp", 3, bucket_mb=4)


@pytest.mark.parametrize(("stage", "size", "calls"), [(1, "split", 1), (2, "all", 1), (2, "pairs", 2), (2, "split", 4)])
def test_a_buckets_backwards_run_as_one_autograd_call(
    stage: int, size: str, calls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor joins the backwards the Plan lists side by side (a ZeRO-1 backward whole, a ZeRO-2
    one per bucket: its reduce-scatter and wait lie between buckets), and the step stays the single
    device's (the test above runs the same cases)."""
    step, params, batches = _problem()
    sharded = sw.shard_params(step, "dp", stage, bucket_mb=BUCKETS[size])
    counted: list[int] = []
    backward = stage_backward.accumulate_backward  # every autograd call of a step's backwards

    def counting(*args: object, **kwargs: object) -> None:
        counted.append(1)
        backward(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stage_backward, "accumulate_backward", counting)
    state = sharded.init(params, sw.Mesh(dp=1))
    state, _ = sharded(state, batches[0])
    assert len(counted) == calls
    reference = step.init(params)
    reference, _ = step(reference, batches[0])
    got, want = sharded.full_params(state), reference.params
    for layer, tensors in want.items():
        for name, value in tensors.items():
            torch.testing.assert_close(got[layer][name], value, rtol=F64_RTOL, atol=0)


def _as_users(optimizer: sw.optim.Optimizer) -> sw.optim.Optimizer:
    """The same optimizer as a user's own (not a built-in one): its update cannot be cut by bucket. It is
    elementwise (ZeRO hands it flat shards), which a user's optimizer declares."""
    return sw.optim.Optimizer(
        optimizer.init, lambda grads, state, params: optimizer.update(grads, state, params), elementwise=True
    )


@pytest.mark.parametrize("size", list(BUCKETS))
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_inplace", "sgd_users"])
def test_updating_bucket_by_bucket_is_the_single_device_step(size: str, optimizer: str) -> None:
    """ZeRO-1/2 with update_in_buckets update one bucket at a time (AdamW's step count and moments
    cut and joined per bucket, over three steps, in place too); a user's optimizer every shard at once."""
    base, params, batches = _problem()
    opt = {"adamw": sw.optim.adamw(lr=1e-2, weight_decay=0.1),
           "adamw_inplace": sw.optim.adamw(lr=1e-2, weight_decay=0.1, inplace=True),
           "sgd_users": _as_users(sw.optim.sgd(lr=0.1, momentum=0.9))}[optimizer]
    base = sw.train_step(base.chain, torch.nn.functional.mse_loss, opt)  # no clipping: no wait before the update
    for stage in (1, 2):
        step = sw.shard_params(base, "dp", stage, bucket_mb=BUCKETS[size], update_in_buckets=True)
        sw.testing.assert_equivalent(step, base, sw.Mesh(dp=2), batches, params, rtol=F64_RTOL)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_each_buckets_all_gather_is_issued_after_its_update_and_waited_for_at_the_end(clip: float | None) -> None:
    """update_in_buckets: update(b) gather_params(b) per bucket, in the reduce-scatters' order; without
    overlap_gather the waits after the metrics' (which a clipping update waits for first). A user's
    optimizer, False, and the default on a CPU: one update, then the gathers. With overlap_gather=True
    the same, in the next forward's order, and no wait at the end: the next step waits (its Plan's
    first actions)."""
    base, params, _ = _problem()
    builtin, users = sw.optim.sgd(lr=0.1, momentum=0.9), _as_users(sw.optim.sgd(lr=0.1, momentum=0.9))
    for opt, option, per_bucket in ((builtin, True, True), (users, True, False), (builtin, False, False),
                                    (builtin, None, False)):
        step = sw.train_step(base.chain, torch.nn.functional.mse_loss, opt, clip_norm=clip)
        metrics = "reduce_metrics(axis=dp)" + (" wait_metrics" if clip else "")
        after = "" if clip else " wait_metrics"
        for overlap, waits in ((False, " wait_params(6+4) wait_params(2+0)"),
                               (None, " wait_params(6+4) wait_params(2+0)"), (True, "")):
            # overlapped: in the order the next forward waits for them
            order = ["2+0", "6+4"] if overlap else ["6+4", "2+0"]
            if per_bucket:
                tail = " ".join(f"update({b}) gather_params({b})" for b in order)
            else:
                tail = "update " + " ".join(f"gather_params({b})" for b in order)
            sharded = sw.shard_params(step, "dp", 2, bucket_mb=BUCKETS["pairs"], update_in_buckets=option,
                                      overlap_gather=overlap)
            actions = sharded.plan(sw.Mesh(dp=4), params).for_rank(0)
            text = " ".join(map(str, actions[[a.kind for a in actions].index("finish_grads"):]))
            assert text == f"finish_grads {metrics} {tail}{after}{waits}"


def test_the_plan_counts_each_buckets_update_not_the_whole_at_each() -> None:
    """update_in_buckets: at each bucket's update the Plan counts that bucket's own allocations beside
    what the buckets updated before keep (issue 25: it counted the whole update at every bucket). In
    place, AdamW's temporaries span one bucket, fewer bytes than over every shard at once; SGD out of
    place keeps each bucket's new shards, so at the last bucket they are all there, as at once."""
    base, params, _ = _problem()
    mesh = sw.Mesh(dp=4)
    for opt, fewer in ((sw.optim.adamw(lr=1e-2, weight_decay=0.1, inplace=True), True), (sw.optim.sgd(lr=0.1), False)):
        step = sw.train_step(base.chain, torch.nn.functional.mse_loss, opt)
        figures = {
            option: sw.shard_params(step, "dp", 2, bucket_mb=BUCKETS["pairs"], update_in_buckets=option)
            .plan(mesh, params).memory
            for option in (True, False)
        }
        by_bucket, at_once = (figures[o]["update_buffers"][0] for o in (True, False))
        if fewer:
            assert 0 < by_bucket < at_once
        else:  # the new parameter shards, all of them: as many bytes as the gradient shards
            assert by_bucket == at_once == figures[False]["grads"][0] > 0


def test_bad_update_in_buckets_is_refused() -> None:
    base, _, _ = _problem()
    with pytest.raises(TypeError, match=r"update_in_buckets='yes'.*True, False or None"):
        sw.shard_params(base, "dp", 2, update_in_buckets="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="update by buckets is for stages 1 and 2"):
        sw.shard_params(base, "dp", 3, update_in_buckets=True)
    assert sw.shard_params(base, "dp", 2, update_in_buckets=False).transforms[-1].updates_in_buckets("cuda") is False
    assert sw.shard_params(base, "dp", 2).transforms[-1].updates_in_buckets("cuda") is True
