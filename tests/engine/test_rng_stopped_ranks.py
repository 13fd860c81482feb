"""A rank stopped by the launcher never leaves torch's shared generators taken.

The threads launcher stops a rank that outlives a failure by raising RankStopped in its thread;
it lands at the rank's next bytecode, which may come right after the rank took the generators'
lock and before it recorded that it holds it (a rank blocked waiting for them gets it there as
soon as the holder lets go). The next launch in the process then waited out its whole timeout
for generators no live thread held (tests/engine/test_sequence_first.py flaked so under load).
"""

from __future__ import annotations

import threading
import time

import pytest

import shardwise as sw
from shardwise.collectives.backends.current import current_backend
from shardwise.engine.run import rng


def test_a_rank_stopped_while_waiting_for_the_generators_leaves_them_free_for_the_next_launch() -> None:
    holding = threading.Event()

    def main() -> None:
        rank, deadline = current_backend().rank, time.monotonic() + 5.0
        if rank == 0:  # computes with the generators until the launcher stops it
            with rng._holding("to compute"):
                holding.set()
                while time.monotonic() < deadline:
                    time.sleep(0.01)
        elif rank == 1:  # waits for them (one C call: it stops once it got them)
            holding.wait(5.0)
            rng._acquire("to compute")
            rng._release()
        else:
            time.sleep(0.3)  # rank 1 is waiting by now
            raise ValueError("rank 2 fails")

    with pytest.raises(sw.collectives.RankFailed, match="rank 2 fails"):
        sw.launch(main, 3, backend="threads", timeout=3.0)

    def compute() -> None:
        with rng._holding("to compute"):
            pass

    started = time.monotonic()
    sw.launch(compute, 2, backend="threads", timeout=5.0)  # waited 5 s and failed without the fix
    assert time.monotonic() - started < 2.0
