"""shard_params' spec: frozen data in the step's stack, and its lowering pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ...engine.plan.actions import Action
from ...engine.stack.compose import SHARDING
from .lowering import insert_gathers, insert_reduces


@dataclass(frozen=True)
class ShardSpec:
    """Data parallel over ``axis`` with ZeRO ``stage`` sharding (see :func:`shard_params`).

    ``reshard_after_forward`` None means the default of ``engine/stack/compose.py``: reshard
    alone, keep the units under a pipeline.
    """

    axis: str
    stage: int
    reshard_after_forward: bool | None = None
    prefetch: int = 1
    accumulation: int = 1

    name: ClassVar[str] = "shard_params"
    role: ClassVar[str] = SHARDING

    def __str__(self) -> str:
        reshard = "" if self.reshard_after_forward is None else f", reshard_after_forward={self.reshard_after_forward}"
        return (
            f"shard_params(axis={self.axis!r}, stage={self.stage}{reshard}, prefetch={self.prefetch}, "
            f"accumulation={self.accumulation})"
        )

    def insert(
        self,
        actions: Sequence[Action],
        stage_needs: Mapping[int, tuple[str, ...]],
        *,
        reshard: bool,
        pipelined: bool,
        deferred: set[str],
    ) -> list[Action]:
        """The rank's computes with ZeRO's gathers, frees and (not deferred) reduce-scatters."""
        out = insert_gathers(
            actions, stage_needs, stage=self.stage, reshard=reshard, prefetch=self.prefetch,
            pipelined=pipelined, axis=self.axis,
        )
        return insert_reduces(out, stage_needs, deferred, self.axis)
