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
    posted = recv = transfers.recv
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
    assert recv is posted and len(set(losses)) == 1
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
