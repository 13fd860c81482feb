"""Expert capacity and the drop rule.

With a capacity factor ``f``, each rank may send each expert at most
``capacity = ceil(f * tokens * top_k / num_experts)`` of its token assignments (GShard's capacity,
counted per rank over the rank's own tokens). Which ones, stated once: a rank's assignments are
taken in order of choice first and token second (every token's first choice, in token order, then
every token's second choice, ...), and an expert keeps the first ``capacity`` it is given; the rest
are dropped. A dropped assignment adds nothing to its token's output and the kept weights are not
renormalized (a token whose every choice is dropped comes out as zeros: the residual carries it).
``capacity=None`` drops nothing.

>>> import torch
>>> slots = assign_slots(torch.tensor([[0, 1], [0, 2], [0, 1]]), num_experts=3, capacity=2)
>>> slots.position.tolist(), slots.kept.tolist()
([[0, 0], [1, 0], [2, 1]], [[True, True], [True, True], [False, True]])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """The most assignments a rank of ``tokens`` tokens may send one expert; None (no limit) for no factor."""
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not (
            0 < capacity_factor < math.inf):
        raise ValueError(
            f"capacity_factor={capacity_factor!r}: give a finite positive number (1.0: an even share per expert), "
            "or None to drop no token"
        )
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


class Slots(NamedTuple):
    """Where each assignment sits in its expert's queue, and which ones are kept."""

    position: torch.Tensor  # [tokens, top_k]: index among the assignments to the same expert
    kept: torch.Tensor  # [tokens, top_k] bool
    counts: torch.Tensor  # [num_experts] int64: assignments made
    kept_counts: torch.Tensor  # [num_experts] int64: assignments kept


def assign_slots(experts: torch.Tensor, num_experts: int, capacity: int | None) -> Slots:
    """The slots of ``experts`` [tokens, top_k] under the drop rule of the module docstring."""
    tokens, top_k = experts.shape
    choice_major = experts.t().reshape(-1)  # choice 0 of every token, then choice 1, ...
    one_hot = torch.nn.functional.one_hot(choice_major, num_experts)
    queue = one_hot.cumsum(dim=0) - 1  # running count per expert, in the rule's order
    position = queue.gather(1, choice_major.unsqueeze(1)).view(top_k, tokens).t()
    counts = one_hot.sum(dim=0)
    if capacity is None:
        return Slots(position, torch.ones_like(position, dtype=torch.bool), counts, counts)
    return Slots(position, position < capacity, counts, counts.clamp(max=capacity))
