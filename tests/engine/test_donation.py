"""An in-place optimizer consumes the TrainState it steps: stepping that state again is refused
(it would start from tensors a later update wrote), a functional one may be stepped again."""

from __future__ import annotations

import threading
from typing import Any

import optree
import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp


def _problem(optimizer: Any) -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, optimizer)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=gen, dtype=torch.float64),
                torch.randn(4, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    return step, params, batches


OPTIMIZERS = {
    "sgd": lambda inplace: sw.optim.sgd(0.1, inplace=inplace),
    "sgd_momentum": lambda inplace: sw.optim.sgd(0.1, momentum=0.9, inplace=inplace),
    "adamw": lambda inplace: sw.optim.adamw(1e-2, inplace=inplace),
}
STACKS = {
    "one_device": (lambda step: step, None),
    "zero1": (lambda step: sw.shard_params(step, "dp", stage=1), 2),
    "zero3": (lambda step: sw.shard_params(step, "dp", stage=3), 2),
}


def _run(stack: str, body: Any) -> list[Any]:
    wrap, world = STACKS[stack]
    if world is None:
        return [body(wrap, None)]
    return sw.launch(lambda: body(wrap, sw.Mesh(dp=world)), world)


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_stepping_a_consumed_state_again_is_refused_or_right(name: str, stack: str) -> None:
    def body(inplace: bool) -> Any:
        step, params, batches = _problem(OPTIMIZERS[name](inplace))

        def run(wrap: Any, mesh: Any) -> Any:
            s = wrap(step)
            first = s.init(params, mesh)
            second, _ = s(first, batches[0])
            third, _ = s(second, batches[1])  # the state the last call returned: fine
            try:
                s(second, batches[2])
            except ValueError as refused:
                assert "(step 1) was consumed by an in-place update" in str(refused), refused
                # Plain SGD holds no optimizer state: under ZeRO-1/2 the parameters witness it, which
                # the step writes where they are (gathers_into_params).
                with pytest.raises(ValueError, match=r"step 0\) was consumed"):
                    s(first, batches[2])
                s(third, batches[2])  # the live state still steps
                return "refused"
            return "stepped"

        return _run(stack, run)

    in_place, functional = body(True), body(False)
    assert in_place == ["refused"] * len(in_place), (name, stack)
    assert functional == ["stepped"] * len(functional), (name, stack)


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_functional_state_steps_again_alike(stack: str) -> None:
    step, params, batches = _problem(sw.optim.adamw(1e-2))

    def body(wrap: Any, mesh: Any) -> bool:
        s = wrap(step)
        state, _ = s(s.init(params, mesh), batches[0])
        a, _ = s(state, batches[1])
        b, _ = s(state, batches[1])  # the same state again: the same result
        return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(s.full_params(a)),
                                                     optree.tree_leaves(s.full_params(b)), strict=True))

    assert all(_run(stack, body))


def test_an_in_place_run_equals_the_functional_one() -> None:
    """The tags change nothing: in place and functional give the same parameters bitwise."""
    results = []
    for inplace in (False, True):
        step, params, batches = _problem(sw.optim.adamw(1e-2, inplace=inplace))
        state = step.init(params)
        for batch in batches:
            state, _ = step(state, batch)
        results.append(optree.tree_leaves(state.params))
    assert all(torch.equal(x, y) for x, y in zip(*results, strict=True))



@pytest.mark.parametrize("name", ["sgd", "sgd_momentum"])
@pytest.mark.parametrize("clip_norm", [1.0, None], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("stack", ["zero1", "zero3"])
def test_a_step_refused_after_its_in_place_update_leaves_no_silent_retry(stack: str, clip_norm: float | None,
                                                                         name: str) -> None:
    """Ranks that pass different batches are refused. An in-place optimizer that had already written
    the state it was given made the retry (the same batch on every rank) train on from moments and
    parameters the refused step wrote, without an error. Where the fingerprints are in before the
    update (a clipped step waits for the norm they travel with) the refusal comes first and the
    retry is right; elsewhere the update overlaps their exchange, and the retry is refused. Plain
    SGD has no moments to tell: under ZeRO-1 its shards are views of the parameters, whose version
    counter the refused update moved by writing through them."""
    step, params, batches = _problem(OPTIMIZERS[name](True))
    step = sw.train_step(step.chain, step.loss_fn, step.optimizer, clip_norm=clip_norm)
    wrap, world = STACKS[stack]
    s = wrap(step)

    def run() -> bool:
        mesh = sw.Mesh(dp=world)
        state, _ = s(s.init(params, mesh), batches[0])
        mine = batches[1] if mesh.rank == 0 else batches[2]
        with pytest.raises(ValueError, match="different batches"):
            s(state, mine)
        if clip_norm is None:
            with pytest.raises(ValueError, match="consumed by an in-place update"):
                s(state, batches[1])
            return True
        retried, _ = s(state, batches[1])
        fresh, _ = s(s.init(params, mesh), batches[0])
        fresh, _ = s(fresh, batches[1])
        got, want = optree.tree_leaves(s.full_params(retried)), optree.tree_leaves(s.full_params(fresh))
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    assert all(sw.launch(run, world))


@pytest.mark.parametrize("options", [{"stage": 1}, {"stage": 2}, {"stage": 2, "update_in_buckets": True}],
                         ids=["zero1", "zero2", "zero2-update-in-buckets"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_an_overlapped_zero_state_consumed_in_place_is_refused(name: str, options: dict) -> None:
    """With overlap_gather the next step's update starts from the shards the last one gathered
    (state.params.shards), which an in-place optimizer writes: plain SGD stepped an older state
    again from shards a later update wrote, without an error (and without overlap it is right)."""
    step, params, batches = _problem(OPTIMIZERS[name](True))
    s = sw.shard_params(step, "dp", overlap_gather=True, bucket_mb=1 / 4096, **options)

    def run() -> None:
        first, _ = s(s.init(params, sw.Mesh(dp=2)), batches[0])
        s(first, batches[1])
        with pytest.raises(ValueError, match="consumed by an in-place update"):
            s(first, batches[1])

    sw.launch(run, 2)


def _first_by_optree(tree: Any) -> Any:
    return next((t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.ndim > 0), None)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_witness_is_the_first_array_leaf_in_optree_order(name: str) -> None:
    """The walk that finds the tensor an in-place step tags (and the next step checks) picks what
    flattening the whole tree would: the state's first array in optree's order."""
    from shardwise.engine.step.donation import _first_array

    step, params, _ = _problem(OPTIMIZERS[name](True))
    state = step.init(params)
    a, b = torch.ones(2), torch.ones(3)
    odd_keys = {1: a, "x": b}  # keys that do not sort: optree's own order
    trees = [state.opt_state, state.params, {"b": {"z": a}, "a": [torch.tensor(1.0), None, 3, (b,)]},
             odd_keys, {"k": {}}, (torch.tensor(2.0),), {"o": torch.nn.ParameterDict({"p": a})}]
    for tree in trees:
        assert _first_array(tree) is _first_by_optree(tree), tree


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_consumed_state_is_refused_by_every_reader_and_by_an_out_of_place_step(stack: str) -> None:
    """A "best" state kept while training goes on in place: stepping and saving it were refused, but
    full_params and full_state_dict returned the later weights as its own, and a step updating out of
    place (the same stack, inplace=False) stepped and saved it. Every reader refuses it now; the live
    state still exports, and a functional run's old states still read."""
    step, params, batches = _problem(OPTIMIZERS["adamw"](True))
    functional = sw.train_step(step.chain, torch.nn.functional.mse_loss, OPTIMIZERS["adamw"](False))

    def run(wrap: Any, mesh: Any) -> list[str]:
        s, other = wrap(step), wrap(functional)
        best, _ = s(s.init(params, mesh), batches[0])
        live, _ = s(best, batches[1])
        refused = []
        for name, read in (("full_params", lambda: s.full_params(best)),
                           ("full_state_dict", lambda: sw.checkpoint.full_state_dict(s, best)),
                           ("out-of-place step", lambda: other(best, batches[2])),
                           ("out-of-place full_params", lambda: other.full_params(best))):
            with pytest.raises(ValueError, match=r"\(step 1\) was consumed by an in-place update"):
                read()
            refused.append(name)
        s.full_params(live)
        sw.checkpoint.full_state_dict(s, live)
        old, _ = other(other.init(params, mesh), batches[0])
        other(old, batches[1])
        other.full_params(old)  # a functional step leaves its input as it was
        return refused

    assert all(len(r) == 4 for r in _run(stack, run))


class _FailsMidUpdate:
    """A schedule that raises at its ``at``-th call on this thread (an out-of-memory error in the middle of an update
    in buckets, which calls it once a bucket)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def arm(self, at: int | None) -> None:
        self.local.calls, self.local.at = 0, at

    def __call__(self, step: int) -> float:
        self.local.calls = getattr(self.local, "calls", 0) + 1
        if self.local.calls == getattr(self.local, "at", None):
            raise torch.OutOfMemoryError("out of memory in the middle of the update")
        return 1e-2


def test_a_state_half_updated_in_buckets_is_refused_on_retry() -> None:
    """The review (s39 fail F7): an in-place update in buckets (stage 2, update_in_buckets) that failed after its
    first bucket wrote left that bucket's moments advanced (4.7e-2) and the state unmarked: the retry of the batch
    trained from the half-updated state (7e-3 off), and a save took it too."""
    schedule = _FailsMidUpdate()
    step, params, batches = _problem(sw.optim.adamw(schedule, inplace=True))
    zero2 = sw.shard_params(step, "dp", stage=2, update_in_buckets=True, bucket_mb=1 / 4096)

    def main() -> None:
        state, _ = zero2(zero2.init(params, sw.Mesh(dp=2)), batches[0])
        schedule.arm(2)
        with pytest.raises(torch.OutOfMemoryError):
            zero2(state, batches[1])
        schedule.arm(None)
        with pytest.raises(ValueError, match=r"consumed by an in-place update"):
            zero2(state, batches[1])

    sw.launch(main, 2)
