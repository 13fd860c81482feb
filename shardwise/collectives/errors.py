"""The errors of the collectives, in one module that imports nothing of ours.

Inside a rank: a collective that cannot complete raises :class:`CollectiveError`
(:class:`CollectiveTimeout` when a peer never arrived, :class:`RankAborted`
when another rank failed first). In the launcher: the run raises
:class:`RankFailed` naming the rank at the root of the failure, or
:class:`RankHung` when that rank is still running, stuck outside any
collective, after the others gave up waiting for it.
"""

from __future__ import annotations

# Why ranks most often issue different collectives, said wherever a mismatch is seen.
DIFFERENT_COLLECTIVES = (
    "Every rank of a group must issue the same collectives in the same order: call the same step on "
    "every rank (a step that reports metrics on rank 0 and a quiet one, with_metrics(()), on the "
    "others issue different ones; so does a step or a save called on some ranks only)."
)


class CollectiveError(RuntimeError):
    """A collective could not complete (timeout, a peer failed, backend error)."""


class CollectiveTimeout(CollectiveError):
    """A collective waited longer than the timeout; the message names the op, axis and missing ranks."""


class RankAborted(CollectiveError):
    """Another rank failed, so this rank stopped waiting in a collective."""


class RankFailed(RuntimeError):
    """A rank raised; ``rank`` names it and ``__cause__`` is its exception (when it could be carried)."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


class RankHung(RankFailed):
    """A rank never finished: it is stuck outside any collective (or after its last one).

    ``rank`` is the first hung rank and ``ranks`` all of them; the message says
    where the others waited for it.
    """

    def __init__(self, ranks: tuple[int, ...], message: str) -> None:
        RuntimeError.__init__(self, f"{_ranks(ranks)} hung: {message}")
        self.rank = ranks[0]
        self.ranks = tuple(ranks)


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"

