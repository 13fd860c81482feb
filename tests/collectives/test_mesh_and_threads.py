"""Mesh layout and errors; the threads launcher's failure handling."""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.collectives.backends.current import current_backend, use_backend
from shardwise.collectives.backends.threads import ThreadsBackend


@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_mesh_is_row_major_and_groups_partition_the_ranks(sizes: list[int]) -> None:
    names = ["dp", "pp", "tp"][: len(sizes)]
    mesh = sw.Mesh(dict(zip(names, sizes, strict=True)))
    assert mesh.size == torch.tensor(sizes).prod().item()
    for rank in range(mesh.size):
        assert mesh.rank_of(mesh.coords_of(rank)) == rank
    assert list(mesh) == [mesh.coords_of(r) for r in range(mesh.size)]
    if mesh.size > 1:  # the last axis of size > 1 varies fastest
        fastest = [n for n, size in zip(names, sizes, strict=True) if size > 1][-1]
        assert mesh.coords_of(1)[fastest] == 1
    for axis in names:
        groups = mesh.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        for g in groups:
            assert len(g) == mesh.axis_size(axis)
            assert [mesh.coords_of(r)[axis] for r in g] == list(range(len(g)))


def test_mesh_value_semantics() -> None:
    mesh = sw.Mesh(dp=2, pp=2)
    assert mesh == sw.Mesh({"dp": 2}, pp=2) and hash(mesh) == hash(sw.Mesh(dp=2, pp=2))
    assert mesh != sw.Mesh(pp=2, dp=2)
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert repr(mesh) == "Mesh(dp=2, pp=2)"
    with pytest.raises(AttributeError):
        mesh.x = 1  # type: ignore[attr-defined]


def test_mesh_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="axis 'dp' has size 0"):
        sw.Mesh(dp=0)
    with pytest.raises(TypeError, match="sizes must be ints"):
        sw.Mesh(dp=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one axis"):
        sw.Mesh()
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        sw.Mesh(dp=2).axis_size("tp")
    with pytest.raises(RuntimeError, match=r"spans 2 ranks but this program runs on a world of 1"):
        sw.Mesh(dp=2).rank  # noqa: B018

    def wrong_size() -> None:
        sw.Mesh(dp=3).rank  # noqa: B018

    with pytest.raises(sw.collectives.RankFailed, match=r"world=3"):
        sw.launch(wrong_size, 2)


def test_a_rank_that_raises_stops_the_others_at_once() -> None:
    def main() -> None:
        mesh = sw.Mesh(dp=4)
        if mesh.rank == 2:
            raise ValueError("boom on two")
        sw.collectives.psum(torch.ones(1), "dp", mesh=mesh)  # the others wait here until rank 2's failure stops them

    started = time.monotonic()
    with pytest.raises(sw.collectives.RankFailed, match="rank 2 failed: ValueError: boom on two") as info:
        sw.launch(main, 4, timeout=30)
    assert time.monotonic() - started < 5, "peers must stop on the failure, not on the timeout"
    assert info.value.rank == 2 and isinstance(info.value.__cause__, ValueError)


def test_a_rank_that_never_arrives_times_the_others_out_with_the_collective_named() -> None:
    def main() -> None:
        mesh = sw.Mesh(dp=2, pp=2)
        if mesh.coords["dp"] == 1:
            time.sleep(1.5)  # busy elsewhere past the timeout (one that returned is named at once: below)
            return
        sw.collectives.all_gather(torch.ones(2), "dp", mesh=mesh)

    started = time.monotonic()
    with pytest.raises(
        sw.collectives.RankFailed, match=r"all_gather on axis 'dp' timed out after 0.5 s on rank \d: ranks \[\d\]"
    ):
        sw.launch(main, 4, timeout=0.5)
    assert time.monotonic() - started < 5


def test_a_rank_that_returned_fails_the_others_at_once_with_the_collective_named() -> None:
    def main() -> None:
        mesh = sw.Mesh(dp=2, pp=2)
        if mesh.coords["dp"] == 1:
            return
        sw.collectives.all_gather(torch.ones(2), "dp", mesh=mesh)

    started = time.monotonic()
    with pytest.raises(sw.collectives.RankFailed, match=r"all_gather on axis 'dp' on rank \d: ranks \[\d\] returned "
                                                        r"from their function without joining it"):
        sw.launch(main, 4, timeout=60.0)
    assert time.monotonic() - started < 5


def test_a_collective_from_a_thread_python_did_not_start_is_refused_at_once() -> None:
    """Such as torch's autograd device thread, which runs every thread rank's CUDA backward: there the
    ranks would wait for each other's collectives forever, so the first one is refused, by name."""
    import _thread

    def main() -> tuple[str, bool]:
        mesh = sw.Mesh(dp=2)
        backend = current_backend()
        where: dict[str, object] = {}
        done = threading.Event()

        def on_a_foreign_thread() -> None:  # started by _thread: Python's threading did not start it
            try:
                with use_backend(backend):
                    sw.collectives.psum(torch.ones(2), "dp", mesh=mesh)
            except Exception as exc:
                where["error"] = exc
            finally:
                done.set()

        _thread.start_new_thread(on_a_foreign_thread, ())
        assert done.wait(30)
        ok = sw.collectives.psum(torch.ones(2), "dp", mesh=mesh)  # on the rank's own thread: as before
        return str(where.get("error")), bool(ok.eq(2).all())

    started = time.monotonic()
    for error, own_thread_ok in sw.launch(main, 2, timeout=30):
        assert "psum on axis 'dp': thread rank" in error and "issued it from a thread Python did not start" in error
        assert "backend='processes'" in error and own_thread_ok
    assert time.monotonic() - started < 10, "refused at once, not at the timeout"


def test_mismatched_collectives_are_reported() -> None:
    def main() -> None:
        mesh = sw.Mesh(dp=2)
        x = torch.ones(2)
        sw.collectives.psum(x, "dp", mesh=mesh) if mesh.rank == 0 else sw.collectives.all_gather(x, "dp", mesh=mesh)

    with pytest.raises(sw.collectives.RankFailed, match="collective mismatch on axis 'dp'"):
        sw.launch(main, 2, timeout=5)


def test_no_thread_is_left_behind() -> None:
    before = {t.name for t in threading.enumerate()}

    def main() -> int:
        return sw.Mesh(dp=3).rank

    assert sw.launch(main, 3) == [0, 1, 2]
    assert not {t.name for t in threading.enumerate()} - before


def test_threads_results_are_bitwise_repeatable() -> None:
    def main() -> torch.Tensor:
        mesh = sw.Mesh(dp=8)
        gen = torch.Generator().manual_seed(mesh.rank)
        return sw.collectives.psum(torch.randn(1000, generator=gen, dtype=torch.float32), "dp", mesh=mesh)

    first, second = sw.launch(main, 8), sw.launch(main, 8)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_launch_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="world must be a positive int"):
        sw.launch(lambda: None, 0)
    with pytest.raises(ValueError, match="choose 'threads' or 'processes'"):
        sw.launch(lambda: None, 1, backend="mpi")
    assert ThreadsBackend.name == "threads"


def test_only_a_rank_that_must_wait_enters_the_blocking_wait_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks around a blocking wait (the engine lends torch's shared generators there: saving and
    restoring numpy's state costs 0.1 ms) are entered by a rank whose collective or message is not there
    yet, and not by the last rank to arrive, whose result was computed as it arrived, nor by a receiver
    whose message was sent already."""
    from shardwise.collectives.backends import blocking

    entered: list[int] = []
    lock = threading.Lock()

    @contextlib.contextmanager
    def hook() -> Iterator[None]:
        with lock:
            entered.append(current_backend().rank)
        yield

    monkeypatch.setattr(blocking, "_hooks", [hook])

    def rank() -> None:
        me = current_backend().rank
        if me == 1:
            time.sleep(0.3)  # rank 0 arrives first and must wait
        mesh = sw.Mesh(dp=2)
        sw.collectives.psum(torch.ones(2), "dp", mesh=mesh)
        if me == 0:
            sw.collectives.send(torch.ones(2), "dp", 1, mesh=mesh).wait()
        else:
            time.sleep(0.3)  # the message is there before rank 1 asks for it
            assert torch.equal(sw.collectives.recv("dp", 0, like=(torch.Size([2]), torch.float32), mesh=mesh).wait(),
                               torch.ones(2))

    sw.launch(rank, 2, timeout=20)
    assert entered == [0]
