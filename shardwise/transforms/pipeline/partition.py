"""Which chain layers form each pipeline stage.

By default the layers are cut into contiguous stages that balance the
parameter count (the classic linear-partition problem, solved exactly by
dynamic programming: the largest stage is as small as it can be); a user can
also give the number of layers of every stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def balanced_partition(weights: Sequence[int], stages: int) -> tuple[int, ...]:
    """Layer counts per stage, contiguous, every stage non-empty, minimising the heaviest stage.

    Ties go to the earliest cut that achieves the optimum, so the result is deterministic.
    """
    n = len(weights)
    if stages <= 0:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    if stages > n:
        raise ValueError(
            f"cannot cut {n} layers into {stages} non-empty stages; use fewer stages or split the model "
            "into more layers (functionalize(model, units=...))"
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest possible heaviest stage when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts: list[int] = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def check_partition(counts: Sequence[int], layers: int, stages: int) -> tuple[int, ...]:
    """Validate a user's layer counts per stage."""
    counts = tuple(counts)
    if len(counts) != stages:
        raise ValueError(f"pipeline(partition={list(counts)}) gives {len(counts)} stages, the schedule has {stages}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c <= 0 for c in counts):
        raise ValueError(f"pipeline(partition={list(counts)}): every stage needs a positive number of layers")
    if sum(counts) != layers:
        raise ValueError(
            f"pipeline(partition={list(counts)}) covers {sum(counts)} layers but the chain has {layers}"
        )
    return counts


def stage_layers(names: Sequence[str], counts: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """The layer names of every stage, given the layer counts."""
    out, start = [], 0
    for c in counts:
        out.append(tuple(names[start : start + c]))
        start += c
    return tuple(out)


def param_counts(names: Sequence[str], params: Mapping[str, Mapping[str, torch.Tensor]]) -> list[int]:
    """Elements each layer owns (its weight in the balance)."""
    return [sum(t.numel() for t in params.get(n, {}).values()) for n in names]
