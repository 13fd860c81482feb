"""Point-to-point send / recv on every backend: the same rank programs on threads and gloo.

The rank programs are module-level functions (spawned processes import them).
Failure tests use short timeouts; the processes one uses its own launch, not the
shared pools, so the broken process group it leaves behind poisons nothing.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import pytest
import torch

from shardwise.collectives import (
    CollectiveError,
    CollectiveTimeout,
    Mesh,
    RankAborted,
    RankFailed,
    axis_index,
    comm_ledger,
    launch,
    ppermute,
    recv,
    send,
)
from shardwise.collectives.backends.base import MAX_TAG
from shardwise.collectives.backends.current import current_backend, use_backend
from shardwise.collectives.backends.single import SingleRankBackend


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a, b)


def _payloads() -> list[torch.Tensor]:
    """Tensors whose shape and dtype the receiver does not know."""
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randn(3, 4, generator=gen).to(torch.float16),
        torch.randn(5, generator=gen).to(torch.bfloat16),
        torch.randn(1, 2, 3, generator=gen),
        torch.tensor(2.5, dtype=torch.float64),  # 0-d
        torch.arange(6, dtype=torch.int64).reshape(2, 3) - 3,
        torch.empty(0, 5, dtype=torch.int64),  # empty
        torch.empty(0, dtype=torch.float32),
        torch.tensor([True, False, True]),
        torch.randn(2, 3, generator=gen).t(),  # non-contiguous
        torch.randn(*([1] * 9), 2, generator=gen, dtype=torch.float64),  # more dims than the header holds
        torch.complex(torch.ones(2), torch.arange(2.0)),
    ]


# -- rank programs (threads and gloo alike) ----------------------------------------
def ring_shift() -> dict[str, Any]:
    """Over the pp axis of a 2x2 mesh: send to the next stage, then receive from the previous one."""
    mesh = Mesh(dp=2, pp=2)
    rank = mesh.rank
    with mesh, comm_ledger() as ledger:
        i, n = axis_index("pp"), 2
        x = torch.full((3,), float(rank), dtype=torch.float64)
        sent = send(x, "pp", (i + 1) % n, tag=1).wait()  # never waits for the receiver
        assert sent is x
        x.fill_(-1.0)  # the message is a snapshot: changing x now changes nothing
        got = recv("pp", (i - 1) % n, tag=1).wait()
    return {"rank": rank, "got": got, "records": ledger.records}


def unknown_shapes(default_device: str | None = None) -> list[torch.Tensor] | None:
    """``default_device``: torch's default device while sending and receiving (the payloads
    stay on the CPU); the headers and receive buffers gloo needs must still be made there."""
    mesh, payloads = Mesh(pp=2), _payloads()
    with mesh, torch.device(default_device) if default_device else contextlib.nullcontext():
        if mesh.rank == 0:
            for k, t in enumerate(payloads):
                send(t, "pp", 1, tag=k)
            return None
        # Receives issued in reverse tag order, before any wait.
        handles = {k: recv("pp", 0, tag=k) for k in reversed(range(len(payloads)))}
        return [handles[k].wait() for k in range(len(payloads))]


def tags_are_independent() -> list[float] | None:
    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 0:
            send(torch.tensor([3.0]), "pp", 1, tag=3)
            send(torch.tensor([7.0]), "pp", 1, tag=7)
            return None
        seven = recv("pp", 0, tag=7).wait()
        three = recv("pp", 0, tag=3).wait()
        return [seven.item(), three.item()]


def many_in_order(count: int) -> list[torch.Tensor] | None:
    """``count`` messages of varying shape on tag 0, and a ppermute over the world in between.

    The receiver issues every receive first and waits on them in reverse: the
    k-th receive issued still gets the k-th message sent.
    """
    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 0:
            for k in range(count):
                send(torch.full((k % 4 + 1, 2), float(k)), "pp", 1)  # tag 0, as ppermute uses
                if k == count // 2:  # a collective on the same (world) process group in between
                    ppermute(torch.ones(1), "pp", [(0, 1)])
            return None
        # The ppermute comes before every receive here, mid-way on the sender.
        _same(ppermute(torch.ones(1), "pp", [(0, 1)]), torch.ones(1))
        handles = [recv("pp", 0) for _ in range(count)]
        if mesh.backend.name == "threads":  # gloo tells a recv is done only through wait()
            deadline = time.monotonic() + 10
            while not handles[count // 3].is_completed():
                assert time.monotonic() < deadline, "is_completed() never became true"
                time.sleep(0.001)
        return [h.wait() for h in reversed(handles)][::-1]


def to_self() -> dict[str, Any]:
    mesh = Mesh(pp=_world())  # 2 ranks, or a world of one outside any launch
    with mesh, comm_ledger() as ledger:
        me = axis_index("pp")
        early = recv("pp", me, tag=4)  # issued before the send it takes
        x = torch.arange(3.0) + mesh.rank
        send(x, "pp", me, tag=4).wait()
        x.zero_()
        first = early.wait()
        send(torch.tensor([1, 2]), "pp", me, tag=4)
        second = recv("pp", me, tag=4).wait()
    return {"first": first, "second": second, "records": ledger.records}


def _world() -> int:
    from shardwise.collectives.backends.current import current_backend

    return current_backend().world_size


def never_sent() -> None:
    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 1:
            recv("pp", 0, tag=9).wait()
        else:
            time.sleep(1.5)  # busy past the timeout (a sender that returned is named at once: test_faults.py)


_ABORT_SEEN: list[BaseException] = []


def peer_raises() -> None:
    # Rank 0 waits first (thread ranks start one at a time: rank 1 starts once rank 0 waits).
    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 1:
            time.sleep(0.2)
            raise ValueError("stage 1 broke")
        try:
            recv("pp", 1, tag=2).wait()
        except RankAborted as exc:
            _ABORT_SEEN.append(exc)
            raise


# -- threads --------------------------------------------------------------------------
def _check_ring(results: list[dict[str, Any]]) -> None:
    for r in results:
        rank = r["rank"]
        peer = rank ^ 1  # the other pp index of the same dp row (rank = 2 * dp + pp)
        _same(r["got"], torch.full((3,), float(peer), dtype=torch.float64))
        ops = {rec.op: rec for rec in r["records"]}
        assert set(ops) == {"send", "recv"}
        assert ops["send"].sent_bytes == 24 and ops["send"].nbytes == 24 and ops["send"].axis == "pp"
        assert ops["recv"].sent_bytes == 0 and ops["recv"].nbytes == 24
        assert ops["recv"].dtype == "float64" and ops["recv"].shape == (3,)
        assert all(rec.rank == rank and rec.group_size == 2 for rec in r["records"])


def test_ring_shift_over_the_pp_axis_with_threads() -> None:
    _check_ring(launch(ring_shift, 4))


def test_unknown_shape_and_dtype_with_threads() -> None:
    got = launch(unknown_shapes, 2)[1]
    assert got is not None
    for a, b in zip(got, _payloads(), strict=True):
        _same(a, b)


def test_tags_are_independent_with_threads() -> None:
    assert launch(tags_are_independent, 2)[1] == [7.0, 3.0]


def test_many_messages_arrive_in_order_with_threads() -> None:
    got = launch(many_in_order, 2, args=(60,))[1]
    assert got is not None
    for k, t in enumerate(got):
        _same(t, torch.full((k % 4 + 1, 2), float(k)))


def test_send_to_self_with_threads_and_a_world_of_one() -> None:
    for results in (launch(to_self, 2), [to_self()]):
        for rank, r in enumerate(results):
            _same(r["first"], torch.arange(3.0) + rank)
            _same(r["second"], torch.tensor([1, 2]))
            assert [rec.op for rec in r["records"]] == ["send", "recv", "send", "recv"]
            assert all(rec.sent_bytes == 0 for rec in r["records"])  # nothing leaves the rank


def test_a_recv_whose_sender_never_sends_times_out_naming_peer_and_tag() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(never_sent, 2, timeout=0.5)
    assert time.monotonic() - start < 5
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, CollectiveTimeout)
    message = str(info.value)
    assert "recv from rank 0 (tag 9)" in message and "0.5 s" in message and "on rank 1" in message


def test_a_peer_that_raises_stops_the_waiting_recv_quickly() -> None:
    _ABORT_SEEN.clear()
    start = time.monotonic()
    with pytest.raises(RankFailed, match="stage 1 broke") as info:
        launch(peer_raises, 2, timeout=30.0)
    assert time.monotonic() - start < 5
    assert info.value.rank == 1
    assert len(_ABORT_SEEN) == 1 and "recv from rank 1 (tag 2)" in str(_ABORT_SEEN[0])


def test_send_refuses_grad_and_checks_its_arguments() -> None:
    def body() -> None:
        mesh = Mesh(pp=2)
        with mesh:
            w = torch.ones(2, requires_grad=True)
            with pytest.raises(RuntimeError, match=r"send is not differentiable.*detach"):
                send(w * 2, "pp", 0)
            with torch.no_grad():
                send(w, "pp", axis_index("pp"), tag=1)  # allowed: no graph is recorded
            recv("pp", axis_index("pp"), tag=1).wait()
            with pytest.raises(ValueError, match="dst=2 is outside the axis 'pp' of size 2"):
                send(torch.ones(1), "pp", 2)
            with pytest.raises(ValueError, match="tag=-1 must be in"):
                recv("pp", 0, tag=-1)
            with pytest.raises(ValueError, match=f"tag={MAX_TAG + 1} must be in"):
                send(torch.ones(1), "pp", 0, tag=MAX_TAG + 1)
            with pytest.raises(TypeError, match="src must be an int"):
                recv("pp", True)  # type: ignore[arg-type]

    launch(body, 2)


def test_a_world_of_one_refuses_a_recv_nothing_was_sent_for() -> None:
    with (
        use_backend(SingleRankBackend()),
        pytest.raises(CollectiveError, match="has not sent itself message #0 with tag 3"),
    ):
        recv("pp", 0, tag=3, mesh=Mesh(pp=1)).wait()


# -- gloo processes ----------------------------------------------------------------------
@pytest.mark.gloo
def test_ring_shift_over_the_pp_axis_on_gloo(gloo4: Any) -> None:
    _check_ring(gloo4.run(ring_shift))


@pytest.mark.gloo
@pytest.mark.parametrize("default_device", [None, "meta"])
def test_unknown_shape_and_dtype_on_gloo(gloo2: Any, default_device: str | None) -> None:
    got = gloo2.run(unknown_shapes, default_device)[1]
    for a, b in zip(got, _payloads(), strict=True):
        _same(a, b)


@pytest.mark.gloo
def test_tags_are_independent_on_gloo(gloo2: Any) -> None:
    assert gloo2.run(tags_are_independent)[1] == [7.0, 3.0]


@pytest.mark.gloo
def test_many_messages_arrive_in_order_on_gloo(gloo2: Any) -> None:
    got = gloo2.run(many_in_order, 60)[1]
    for k, t in enumerate(got):
        _same(t, torch.full((k % 4 + 1, 2), float(k)))


@pytest.mark.gloo
def test_send_to_self_on_gloo(gloo2: Any) -> None:
    for rank, r in enumerate(gloo2.run(to_self)):
        _same(r["first"], torch.arange(3.0) + rank)
        _same(r["second"], torch.tensor([1, 2]))
        assert all(rec.sent_bytes == 0 for rec in r["records"])


@pytest.mark.gloo
def test_a_recv_whose_sender_never_sends_times_out_on_gloo() -> None:
    with pytest.raises(RankFailed) as info:
        launch(never_sent, 2, backend="processes", timeout=2)
    assert info.value.rank == 1
    message = str(info.value)
    assert "CollectiveTimeout" in message
    assert "recv from rank 0 (tag 9) on rank 1" in message and "timed out after 2 s" in message


def _unannounced_ring(shape: tuple[int, ...]) -> list:
    mesh = Mesh(pp=2)
    me, n = mesh.axis_index("pp"), mesh.axis_size("pp")
    x = torch.full(shape, float(me), dtype=torch.float32)
    with mesh:
        handle = recv("pp", (me - 1) % n, tag=5, like=(torch.Size(shape), torch.float32))
        send(x, "pp", (me + 1) % n, tag=5, announce=False).wait()
        got = handle.wait()
    return [got.shape == torch.Size(shape), float(got.flatten()[0]) if got.numel() else None]


@pytest.mark.parametrize("shape", [(3, 4), (0,), ()])
def test_unannounced_messages_with_a_known_layout_on_threads(shape: tuple[int, ...]) -> None:
    results = launch(functools.partial(_unannounced_ring, shape), 2)
    assert all(ok for ok, _ in results)
    if shape != (0,):
        assert [v for _, v in results] == [1.0, 0.0]


@pytest.mark.gloo
def test_unannounced_messages_with_a_known_layout_on_gloo(gloo2: Any) -> None:
    results = gloo2.run(_unannounced_ring, (5, 2))
    assert results == [[True, 1.0], [True, 0.0]]


def test_a_known_layout_that_does_not_match_is_refused() -> None:
    def main() -> None:
        mesh = Mesh(pp=2)
        with mesh:
            other = 1 - mesh.axis_index("pp")
            handle = recv("pp", other, tag=2, like=(torch.Size([3]), torch.float32))
            send(torch.zeros(4), "pp", other, tag=2, announce=False)
            handle.wait()

    with pytest.raises(RankFailed, match=r"expected \(3,\) torch.float32, got \(4,\) torch.float32"):
        launch(main, 2, timeout=5)


def _without_snapshot() -> list[float] | bool:
    """snapshot=False: the values still arrive (contiguous or not, announced or not), and the
    receiver's tensor is its own: writing to it leaves the sender's tensor alone."""
    from shardwise.collectives import psum

    mesh = Mesh(pp=2)
    with mesh:
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        if mesh.rank == 0:
            sent = [
                send(x, "pp", 1, tag=1, snapshot=False),
                send(x.t(), "pp", 1, tag=2, snapshot=False, announce=False),  # not contiguous: copied anyway
            ]
            psum(torch.zeros(1), "pp")  # the receiver has written to what it got
            waited = [handle.wait() for handle in sent]  # the promise: wait before x may change
            return waited[0] is x and torch.equal(x, torch.arange(6, dtype=torch.float32).reshape(2, 3))
        got = recv("pp", 0, tag=1).wait()
        got_t = recv("pp", 0, tag=2, like=(torch.Size([3, 2]), torch.float32)).wait()
        values = got.flatten().tolist() + got_t.flatten().tolist()
        got.fill_(-1.0)
        got_t.fill_(-1.0)
        psum(torch.zeros(1), "pp")
        return values


_SENT_WITHOUT_SNAPSHOT = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 3.0, 1.0, 4.0, 2.0, 5.0]


def test_send_without_snapshot_on_threads() -> None:
    assert launch(_without_snapshot, 2) == [True, _SENT_WITHOUT_SNAPSHOT]


@pytest.mark.gloo
def test_send_without_snapshot_on_gloo(gloo2: Any) -> None:
    assert gloo2.run(_without_snapshot) == [True, _SENT_WITHOUT_SNAPSHOT]


def _unsnapshotted_send_waits_for_its_receiver(delay: float) -> float | None:
    """snapshot=False on torch.distributed: gloo reads x itself, so wait() returns once the receiver
    has the message (here posted ``delay`` seconds late), like dist.isend's wait."""
    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 0:
            x = torch.arange(4.0)
            start = time.monotonic()
            handle = send(x, "pp", 1, tag=3, snapshot=False)
            handle.wait()
            return time.monotonic() - start
        time.sleep(delay)
        assert recv("pp", 0, tag=3).wait().tolist() == [0.0, 1.0, 2.0, 3.0]
        return None


@pytest.mark.gloo
def test_a_send_without_snapshot_is_waited_until_received_on_gloo(gloo2: Any) -> None:
    waited, _ = gloo2.run(_unsnapshotted_send_waits_for_its_receiver, 0.5)
    assert waited >= 0.45  # it waited for the late receive, not just for the issue


def test_a_send_without_snapshot_returns_at_once_on_threads() -> None:
    waited, _ = launch(_unsnapshotted_send_waits_for_its_receiver, 2, args=(0.5,))
    assert waited < 0.45  # threads copy the message: nothing to wait for


def _many_unwaited_sends(count: int) -> list[float] | bool:
    """More unwaited snapshot=False sends than the backend keeps: it waits for the oldest itself,
    so the sender neither piles them up nor loses one."""
    from shardwise.collectives.backends import distributed_p2p

    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 0:
            limit = distributed_p2p._MAX_UNWAITED
            distributed_p2p._MAX_UNWAITED = 4
            try:
                handles = [send(torch.full((3,), float(i)), "pp", 1, tag=4, snapshot=False) for i in range(count)]
                pending = len(current_backend()._unwaited)  # type: ignore[attr-defined]
            finally:
                distributed_p2p._MAX_UNWAITED = limit
            for handle in handles:
                handle.wait()  # a send the backend already waited for returns at once
            return pending <= 4
        received = [recv("pp", 0, tag=4) for _ in range(count)]
        return [handle.wait()[0].item() for handle in received]


@pytest.mark.gloo
def test_unwaited_sends_without_snapshot_stay_bounded_on_gloo(gloo2: Any) -> None:
    assert gloo2.run(_many_unwaited_sends, 10) == [True, [float(i) for i in range(10)]]


def _sent_tensor_let_go(_: int) -> bool | None:
    """A snapshot=False send, received and waited for, keeps no hold of the sent tensor: the backend kept
    each such send's work, and with it the tensor, to the next send (a pipeline's last sends of a step, every
    micro-batch's output and input gradient, 4 MiB a rank in tests/engine/test_plan_peak_memory.py's
    lm_pipeline_gpipe, resident until the next step's first send)."""
    import gc
    import weakref

    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 0:
            x = torch.arange(4.0)
            handle = send(x, "pp", 1, tag=5, announce=False, snapshot=False)
            assert handle.wait() is x
            sent = weakref.ref(x)
            del x, handle
            gc.collect()
            return sent() is None
        assert recv("pp", 0, tag=5, like=(torch.Size([4]), torch.float32)).wait().tolist() == [0.0, 1.0, 2.0, 3.0]
        return None


@pytest.mark.gloo
def test_a_waited_send_without_snapshot_lets_go_of_the_sent_tensor_on_gloo(gloo2: Any) -> None:
    assert gloo2.run(_sent_tensor_let_go, 0) == [True, None]


def _never_received(_: int) -> None:
    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 0:
            send(torch.ones(3), "pp", 1, tag=5, snapshot=False).wait()


@pytest.mark.gloo
def test_a_send_without_snapshot_nobody_receives_times_out_on_gloo() -> None:
    with pytest.raises(RankFailed) as info:
        launch(_never_received, 2, backend="processes", timeout=2, args=(0,))
    assert info.value.rank == 0
    message = str(info.value)
    assert "CollectiveTimeout" in message
    assert "send to rank 1 (tag 5) on rank 0" in message and "never received it" in message


# -- devices: a message is staged through the transport's device, put back by the receiver ----------
def received_on(device: str) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]] | None:
    mesh = Mesh(pp=2)
    with mesh:
        if mesh.rank == 0:
            send(torch.arange(6.0).reshape(2, 3), "pp", 1, tag=1)
            send(torch.tensor([1, 2], dtype=torch.int32), "pp", 1, tag=2, announce=False)
            return None
        got = [recv("pp", 0, tag=1, device=device).wait(),
               recv("pp", 0, tag=2, like=(torch.Size([2]), torch.int32), device=device).wait()]
        return [(str(t.device), tuple(t.shape), t.dtype, t.is_meta or bool(t.sum() > 0)) for t in got]


_EXPECTED_ON_META = [("meta", (2, 3), torch.float32, True), ("meta", (2,), torch.int32, True)]


def test_recv_puts_the_message_on_the_device_asked_with_threads() -> None:
    assert launch(received_on, 2, args=("meta",))[1] == _EXPECTED_ON_META
    assert launch(received_on, 2, args=("cpu",))[1] == [
        ("cpu", (2, 3), torch.float32, True), ("cpu", (2,), torch.int32, True)
    ]


@pytest.mark.gloo
def test_recv_puts_the_message_on_the_device_asked_on_gloo(gloo2: Any) -> None:
    assert gloo2.run(received_on, "meta")[1] == _EXPECTED_ON_META


def test_send_stages_a_tensor_through_the_backends_p2p_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed's messages travel on the CPU: a CUDA tensor is copied there first. CI has no
    GPU, so here the threads backend claims its messages travel on meta: the receiver then gets the
    staged (meta) copy, never the sender's CPU tensor."""
    from shardwise.collectives.backends.threads import ThreadsBackend

    monkeypatch.setattr(ThreadsBackend, "p2p_device", property(lambda self: torch.device("meta")))

    def program() -> tuple[str, tuple[int, ...]] | None:
        mesh = Mesh(pp=2)
        with mesh:
            if mesh.rank == 0:
                send(torch.ones(4, 5), "pp", 1, tag=3)
                return None
            got = recv("pp", 0, tag=3).wait()
            return str(got.device), tuple(got.shape)

    assert launch(program, 2)[1] == ("meta", (4, 5))
