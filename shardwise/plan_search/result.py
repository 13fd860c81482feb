"""What a search returns: the ranked layouts that fit, every refusal with its reason, the
time-memory frontier, and a table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .rank import Priced, Refused
from .units import format_bytes, format_seconds


def frontier(ranked: Sequence[Priced]) -> list[Priced]:
    """The layouts no other beats on both time and memory (the Pareto frontier), fastest first."""
    best: list[Priced] = []
    for priced in sorted(ranked, key=lambda p: (p.time, p.memory)):
        if not best or priced.memory < best[-1].memory:
            best.append(priced)
    return best


@dataclass(frozen=True)
class SearchResult:
    """``ranked``: the layouts that fit (and passed certification when asked), fastest first by
    simulated step time, the first ``top`` of the ``fitting`` ones (``others``: the rest that fit,
    not certified); ``refused``: every candidate left out, with the stage and the reason;
    ``skipped``: whole parts of the space not tried, and why (tensor parallel without a plan);
    ``bounded``: how many candidates that passed the memory bound were never planned, because a
    lower bound on their step time was above ``bounded_above`` (the time of the last layout that
    could be returned), so none of them could be among the returned ones. ``others`` and the
    frontier hold only the layouts planned."""

    ranked: tuple[Priced, ...]
    refused: tuple[Refused, ...]
    fitting: int
    others: tuple[Priced, ...]
    skipped: tuple[str, ...]
    world: int
    budget: int
    compute_source: str
    comm_priced: bool
    bounded: int = 0
    bounded_above: float | None = None

    @property
    def best(self) -> Priced:
        if not self.ranked:
            raise ValueError(self._nothing_fits())
        return self.ranked[0]

    def _nothing_fits(self) -> str:
        reasons = "; ".join(f"{n} x {stage}: {why}" for (stage, why), n in self.refusals_by_reason().most_common(3))
        return f"{self.why_none()}: {reasons}"

    def why_none(self) -> str:
        """Why no layout was returned, in one line: over the memory only if one was refused for it.

        >>> SearchResult((), (), 0, (), (), 2, 2**20, "measured", comm_priced=False).why_none()
        'no layout of 2 ranks was tried (none refused)'
        """
        by_stage = Counter(r.stage for r in self.refused)
        stages = ", ".join(f"{n} by {stage}" for stage, n in by_stage.most_common()) or "none refused"
        if by_stage.get("memory"):
            return f"no layout of {self.world} ranks fits {format_bytes(self.budget)} per rank ({stages})"
        if not self.refused:
            return f"no layout of {self.world} ranks was tried ({stages})"
        return f"no layout of {self.world} ranks could be priced, none for want of memory ({stages})"

    def refusals_by_reason(self) -> Counter[tuple[str, str]]:
        """How many candidates each (stage, reason) left out."""
        return Counter((r.stage, r.reason) for r in self.refused)

    def frontier(self) -> list[Priced]:
        """The time-memory frontier of every layout that fits (``ranked`` and ``others``)."""
        return frontier([*self.ranked, *self.others])

    def table(self, top: int | None = None) -> str:
        """The ranked layouts as text: rank, stack, predicted time, peak memory, bytes per axis."""
        rows = self.ranked if top is None else self.ranked[:top]
        on_frontier = {id(p) for p in self.frontier()}
        header = f"{'#':>3}  {'stack':<44} {'time/step':>11} {'peak/rank':>11}  bytes per axis"
        lines = [header, "-" * len(header)]
        unknown = False
        for i, p in enumerate(rows, 1):
            partly = p.unknown_bytes_on
            unknown |= bool(partly)
            axes = ", ".join(f"{axis} {format_bytes(n)}{'+?' if axis in partly else ''}"
                             for axis, n in p.bytes_per_axis.items()) or "-"
            mark = "*" if id(p) in on_frontier else " "
            lines.append(f"{i:>3}{mark} {p.candidate!s:<44} {format_seconds(p.time):>11} {format_bytes(p.memory):>11}  "
                         + axes + ("" if p.certified is None else f"  [{p.certified}]"))
        lines.append(f"(* on the time-memory frontier of all {self.fitting} layouts that fit; "
                     f"{len(self.refused)} were refused; compute costs {self.compute_source})")
        if not self.comm_priced:
            lines.append("communication is not priced: pass comm=CommModel (e.g. CommModel.from_benchmark)")
        if unknown:
            lines.append("+?: and transfers whose payload the plan does not know (a pipeline's stage boundary after "
                         "a layer that ran on stand-ins), counted 0 and priced at their latency alone")
        if self.bounded:
            lines.append(f"not planned ({self.bounded}): a lower bound on their step time is above "
                         f"{format_seconds(self.bounded_above or 0.0)}, the slowest that could be returned")
        for (stage, why), n in self.refusals_by_reason().most_common():
            lines.append(f"refused by {stage} ({n}): {why}")
        lines += [f"skipped: {s}" for s in self.skipped]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "world": self.world, "memory_per_rank": self.budget, "compute": self.compute_source,
            "comm_priced": self.comm_priced, "fitting": self.fitting, "ranked": [p.as_dict() for p in self.ranked],
            "others": [p.as_dict() for p in self.others],
            "frontier": [str(p.candidate) for p in self.frontier()],
            "refused": [{"stack": str(r.candidate), "stage": r.stage, "reason": r.reason, "detail": r.detail}
                        for r in self.refused],
            "skipped": list(self.skipped), "bounded": self.bounded, "bounded_above_s": self.bounded_above,
        }
