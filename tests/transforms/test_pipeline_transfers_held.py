"""What a pipeline rank's transfers hold: each receive is posted a few receives before its wait
(``RECEIVES_AHEAD``), not every receive of the step at the rank's first; a stage output's send is let go
of once its gradient came back, an input gradient's once a later message from its peer proves it
delivered (engine/run/send_delivery.py), not at the step's end. Held so, a middle rank of a 1F1B of 32
micro-batches peaked at 61.7 MiB, against 32.4 at 4 micro-batches; now at 33.1
(tests/engine/test_plan_peak_memory.py's language model; ``lm_pipeline_1f1b_x16`` there holds the Plan
to the measured peak).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.run import transfers
from shardwise.engine.run.stage_backward import StageBackward
from shardwise.testing.models import mlp

MICROBATCHES = 8


def _step(schedule: str) -> tuple[sw.Step, Any, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([4, 8, 8, 8, 3]).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(2 * MICROBATCHES, 4, generator=gen, dtype=torch.float64),
             torch.randn(2 * MICROBATCHES, 3, generator=gen, dtype=torch.float64))
    return sw.pipeline(step, "pp", schedule, MICROBATCHES), params, batch


class _Counted:
    """A posted receive whose wait is counted."""

    def __init__(self, handle: Any, on_wait: Any) -> None:
        self._handle, self._on_wait = handle, on_wait

    def wait(self) -> Any:
        self._on_wait()
        return self._handle.wait()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_each_receive_is_posted_a_few_receives_before_its_wait(monkeypatch: pytest.MonkeyPatch,
                                                              schedule: str) -> None:
    step, params, batch = _step(schedule)
    posted = transfers.recv
    lock = threading.Lock()
    outstanding: dict[int, int] = {}
    most: dict[int, int] = {}

    def counting_recv(*args: Any, **kwargs: Any) -> Any:
        key = threading.get_ident()  # one thread per rank
        with lock:
            outstanding[key] = outstanding.get(key, 0) + 1
            most[key] = max(most.get(key, 0), outstanding[key])

        def waited() -> None:
            with lock:
                outstanding[key] -= 1

        return _Counted(posted(*args, **kwargs), waited)

    monkeypatch.setattr(transfers, "recv", counting_recv)

    def main() -> float:
        state = step.init(params, sw.Mesh(pp=2))
        _, metrics = step(state, batch)
        return float(metrics["loss"])

    losses = sw.launch(main, world=2)
    assert len(set(losses)) == 1
    assert len(most) == 2, most  # both ranks received
    # (each transfer is one tensor here: a receive action posts one receive)
    assert max(most.values()) == transfers.RECEIVES_AHEAD, (
        f"{schedule}: a rank had up to {max(most.values())} receives posted at once, of "
        f"{2 * MICROBATCHES * (2 if schedule == 'interleaved_1f1b' else 1)}")


def test_sends_are_let_go_of_once_known_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    """At each of its backwards, rank 0 holds none of its earlier micro-batches' sent outputs (their gradients
    came back), and rank 1 only the input gradient it sent last: 1F1B's rank 0 takes gradient m before it sends
    activation m + 2, which rank 1 receives before its backward of m + 1. Both were held to wait_sends, at the
    step's end."""
    step, params, batch = _step("1f1b")
    sent: dict[int, list[weakref.ref[torch.Tensor]]] = {0: [], 1: []}
    alive_at_backward: dict[int, list[int]] = {0: [], 1: []}
    original_send, original_backward = transfers.send, StageBackward.backward

    def recording_send(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[sw.Mesh(pp=2).rank].append(weakref.ref(x))
        return original_send(x, *args, **kwargs)

    def counting_backward(self: Any, action: Any) -> Any:
        rank = sw.Mesh(pp=2).rank
        earlier = sent[rank][:action.mb] if rank == 0 else sent[rank]  # rank 1's: its earlier backwards'
        alive_at_backward[rank].append(sum(ref() is not None for ref in earlier))
        return original_backward(self, action)

    monkeypatch.setattr(transfers, "send", recording_send)
    monkeypatch.setattr(StageBackward, "backward", counting_backward)

    def main() -> None:
        state = step.init(params, sw.Mesh(pp=2))
        step(state, batch)

    sw.launch(main, world=2)
    assert [len(sent[0]), len(sent[1])] == [MICROBATCHES, MICROBATCHES]
    assert alive_at_backward[0] == [0] * MICROBATCHES, alive_at_backward
    assert alive_at_backward[1] == [0] + [1] * (MICROBATCHES - 1), alive_at_backward


# -- more sends in flight than a backend bounds, to a peer that posts its receives as it goes -----------------------
LEAVES = 130  # tensors a boundary carries: 8 micro-batches x 130 = 1,040 gradient sends, past gloo's bound of 1,024


class _Split(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x[:, i:i + 1] * 1.0 for i in range(LEAVES))


class _Cat(torch.nn.Module):
    def forward(self, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat(xs, dim=1)


# Rank 1 runs its backwards in reverse while rank 0 takes the gradients in order: rank 1 sends gradient 7 first.
_REVERSED = "\n".join([
    " ".join([*(f"0F{m}" for m in range(MICROBATCHES)), *(f"0B{m}" for m in range(MICROBATCHES))]),
    " ".join([*(f"1F{m}" for m in range(MICROBATCHES)), *(f"1B{m}" for m in reversed(range(MICROBATCHES)))]),
])


def _many_sends_problem() -> tuple[sw.Step, Any, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, LEAVES), _Split(), _Cat(), torch.nn.Linear(LEAVES, 3)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(2 * MICROBATCHES, 4, generator=gen, dtype=torch.float64),
             torch.randn(2 * MICROBATCHES, 3, generator=gen, dtype=torch.float64))
    return step, params, batch


def _many_sends_rank() -> list:  # type: ignore[type-arg]
    step, params, batch = _many_sends_problem()
    piped = sw.pipeline(step, "pp", _REVERSED, MICROBATCHES, partition=[2, 2])
    return sw.testing.record_history(piped, piped.init(params, sw.Mesh(pp=2)), [batch])


@pytest.mark.gloo
def test_more_sends_in_flight_than_the_backend_bounds_do_not_wait_for_a_later_receive(gloo2: Any) -> None:
    """gloo's backend waits for its oldest unwaited send once 1,024 are pending. Rank 1's oldest here is gradient 7,
    whose receive rank 0 posts only as it nears it, after gradient 0, which rank 1 could not send while it waited:
    the step hung to the timeout (review of 52e9636). A pipeline's sends are unbounded (it waits for each itself)."""
    step, params, batch = _many_sends_problem()
    expected = sw.testing.record_history(step, step.init(params), [batch])
    sw.testing.compare_histories(gloo2.run(_many_sends_rank), expected, rtol=1e-10)  # type: ignore[attr-defined]
