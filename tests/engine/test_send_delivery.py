"""Which gradient sends a pipeline rank's receives prove delivered (engine/run/send_delivery.py): only
those the peer took before it sent what this rank receives, each once, never before it was sent."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shardwise.engine.run.send_delivery import grad_sends_delivered
from shardwise.transforms.pipeline.builtins import gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_v
from shardwise.transforms.pipeline.schedule import Schedule


def test_a_1f1b_rank_hears_its_gradient_delivered_two_activations_later() -> None:
    # rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3; rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    schedule = one_f_one_b(2, 2, 4)
    assert grad_sends_delivered(schedule, 1) == {
        ("activation", 1, 2): (("grad", 1, 0),),  # rank 0 took gradient 0 (0B0) before it sent activation 2 (0F2)
        ("activation", 1, 3): (("grad", 1, 1),),
    }  # gradients 2 and 3: no later message from rank 0 says so (held to wait_sends)
    assert grad_sends_delivered(schedule, 0) == {}  # the first stage sends no gradient


def test_gpipe_proves_nothing_before_the_steps_end() -> None:
    schedule = gpipe(4, 4, 8)
    assert all(grad_sends_delivered(schedule, r) == {} for r in range(4))


@pytest.mark.parametrize("make, ranks, stages", [(one_f_one_b, 4, 4), (zb_h1, 4, 4), (interleaved_1f1b, 2, 4),
                                                 (zb_v, 2, 4)])
def test_every_proof_follows_the_peer_taking_the_gradient_and_this_rank_sending_it(
    make: Callable[[int, int, int], Schedule], ranks: int, stages: int,
) -> None:
    schedule = make(ranks, stages, 8)
    proven_somewhere = 0
    for r in range(ranks):
        ops = schedule.ranks[r]
        where = {(op.stage, op.microbatch, op.kind): i for i, op in enumerate(ops)}
        seen: set[tuple[str, int, int]] = set()
        for (kind, stage, mb), sends in grad_sends_delivered(schedule, r).items():
            # where this rank waits for that receive: before its forward, or its backward (input pass)
            received = where[(stage, mb, "F")] if kind == "activation" else where.get(
                (stage, mb, "I"), where.get((stage, mb, "B")))
            peer = schedule.placement[stage - 1] if kind == "activation" else schedule.placement[stage + 1]
            peer_at = {(op.stage, op.microbatch, op.kind): i for i, op in enumerate(schedule.ranks[peer])}
            sent_at = peer_at[(stage - 1, mb, "F")] if kind == "activation" else peer_at.get(
                (stage + 1, mb, "I"), peer_at.get((stage + 1, mb, "B")))
            for send in sends:
                _, s, m = send
                assert send not in seen  # each once
                seen.add(send)
                assert schedule.placement[s - 1] == peer  # a gradient to the rank this receive came from
                made = where.get((s, m, "I"), where.get((s, m, "B")))
                assert made is not None and made < received  # sent before
                taken = peer_at.get((s - 1, m, "I"), peer_at.get((s - 1, m, "B")))
                assert taken is not None and taken < sent_at  # taken by the peer before it sent this
                proven_somewhere += 1
    assert proven_somewhere > 0


@pytest.mark.parametrize("make", [interleaved_1f1b, zb_v])
def test_a_frozen_front_neither_receives_nor_sends_gradients_so_proves_nothing_there(
    make: Callable[[int, int, int], Schedule],
) -> None:
    """Stages before ``backward_from`` run no backward: a proof pinned to their gradient receive, which the run
    never makes, held its sends to wait_sends (review of 52e9636: zb_v's rank 0, all 8 of stage 3's); a stage at
    ``backward_from`` sends no gradient down. Those of stage 3 are proven by other receives (6 of 8 on zb_v)."""
    schedule = make(2, 4, 8)
    for r in range(2):
        delivered = grad_sends_delivered(schedule, r, backward_from=1)
        assert all(kind == "activation" or stage >= 1 for kind, stage, _ in delivered)
        assert all(stage - 1 >= 1 for sends in delivered.values() for _, stage, _ in sends)
    if make is zb_v:
        proven = {send for sends in grad_sends_delivered(schedule, 0, backward_from=1).values() for send in sends}
        assert len({m for _, stage, m in proven if stage == 3}) == 6
