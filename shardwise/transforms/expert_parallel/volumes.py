"""Bytes each rank sends for one :func:`moe_dispatch_combine`, by formula (tests hold it to the ledger).

The two all-to-alls (dispatch, combine) each move [experts, slots, hidden] and keep the rank's own
``1/ep``; the backward sends the same again. ``slots`` depends on the routing: the most assignments
any rank keeps for any expert, so it is at most the capacity (with a capacity factor) and at most the
largest rank's token count (a token picks an expert once); ``MoEOutput.slots`` says what it was.
The count exchange is an all-gather of ``2 * experts + 1`` int64 per rank (forward only).

>>> moe_all_to_all_bytes(num_experts=8, slots=5, hidden=16, itemsize=4, size=4)
3840
>>> moe_count_exchange_bytes(num_experts=8, size=4)
408
"""

from __future__ import annotations


def moe_all_to_all_bytes(*, num_experts: int, slots: int, hidden: int, itemsize: int, size: int) -> int:
    """Forward bytes of the dispatch and combine all-to-alls together, for one rank."""
    moved = num_experts * slots * hidden * itemsize
    return 2 * (moved * (size - 1) // size)


def moe_count_exchange_bytes(*, num_experts: int, size: int) -> int:
    """Bytes one rank sends in the count exchange: its counts, to the ``size - 1`` others (ring all-gather)."""
    return (size - 1) * (2 * num_experts + 1) * 8
