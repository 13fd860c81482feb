"""A candidate layout: one point of the search space, as plain data, and how to apply it.

A :class:`Candidate` is frozen data (mesh shape, ZeRO stage, schedule, micro-batches, remat,
precision); :meth:`Candidate.apply` turns a base step into the distributed one with the real
transforms, so the composition rules of ``engine/stack/compose.py`` judge every candidate,
and :attr:`Candidate.mesh` is the mesh to run it on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..collectives.mesh import Mesh
from ..engine.step.step import Step
from ..transforms.context_parallel import context_parallel
from ..transforms.expert_parallel import expert_parallel
from ..transforms.mixed_precision import mixed_precision
from ..transforms.pipeline import pipeline
from ..transforms.remat import remat
from ..transforms.shard_params import shard_params
from ..transforms.tensor_parallel import tensor_parallel

# Mesh axes in rank order: tensor parallel innermost (neighbouring ranks), as Megatron and
# torchtitan lay it out, because its collectives run inside every layer; context parallel next
# (a ring or all-to-alls in every attention); HSDP's replicas outermost (their all-reduce, once a
# step, is the one to put across the slowest links).
AXES = ("rep", "dp", "ep", "pp", "cp", "tp")


@dataclass(frozen=True)
class Candidate:
    """One layout: ``rep x dp x ep x pp x cp x tp`` ranks, ZeRO ``zero_stage`` over dp (0: none,
    only when dp is 1) with ``replicate`` copies of the shards (HSDP, ``shard_params(...,
    replicate="rep")``), experts split over ``ep`` (``expert_parallel``), sequences over ``cp``
    (``context_parallel``), a pipeline ``schedule`` with ``microbatches`` over pp, a ``remat``
    policy name and a ``precision`` policy (jmp's string form), ``reshard_after_forward`` for
    ZeRO-3 (None: the transform's default).

    >>> c = Candidate(dp=2, pp=2, zero_stage=3, schedule="1f1b", microbatches=2)
    >>> c.mesh, str(c)
    (Mesh(dp=2, pp=2), 'dp2 x pp2 zero3 1f1b mb2')
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    reshard_after_forward: bool | None = None
    schedule: str | None = None
    microbatches: int = 1
    remat: str | None = None
    precision: str | None = None
    cp: int = 1
    ep: int = 1
    replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "cp", "ep", "replicate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Candidate({name}={value!r}): a size is an int >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Candidate(zero_stage={self.zero_stage!r}): 0 (none), 1, 2 or 3")
        if self.dp > 1 and self.zero_stage == 0:
            raise ValueError(f"Candidate(dp={self.dp}, zero_stage=0): data parallel is shard_params, stage 1, 2 or 3")
        if self.dp == 1 and self.zero_stage:
            raise ValueError(f"Candidate(dp=1, zero_stage={self.zero_stage}): ZeRO needs dp > 1")
        if (self.pp > 1) != (self.schedule is not None):
            raise ValueError(f"Candidate(pp={self.pp}, schedule={self.schedule!r}): a schedule goes with pp > 1 only")
        if self.replicate > 1 and self.dp == 1:
            raise ValueError(f"Candidate(replicate={self.replicate}, dp=1): HSDP replicates ZeRO shards over dp > 1")
        if self.pp == 1 and self.microbatches != 1:
            raise ValueError(f"Candidate(pp=1, microbatches={self.microbatches}): micro-batches are the pipeline's")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep * self.replicate

    @property
    def batch_ways(self) -> int:
        """Into how many parts the global batch's tokens are cut (before micro-batches): by dp,
        HSDP's replicas, ep (which routes its own share of the batch) and cp (of every sequence)."""
        return self.dp * self.replicate * self.ep * self.cp

    def size(self, axis: str) -> int:
        return self.replicate if axis == "rep" else int(getattr(self, axis))

    @property
    def mesh(self) -> Mesh:
        """The mesh to run the applied step on: the axes of size > 1, tp innermost."""
        sizes = {axis: self.size(axis) for axis in AXES if self.size(axis) > 1}
        return Mesh(**sizes) if sizes else Mesh(world=1)

    @property
    def rewrites(self) -> tuple[str | None, str | None]:
        """(remat, precision): what a single-device measurement of this candidate's layers must share."""
        return self.remat, self.precision

    def apply(self, step: Step, tp_plan: Mapping[str, Any] | None = None,
              cp_options: Mapping[str, Any] | None = None) -> Step:
        """``step`` with this candidate's transforms (tensor parallel needs ``tp_plan``; context
        parallel takes ``cp_options``, e.g. ``{"attention": "ulysses"}``)."""
        if self.ep > 1:
            step = expert_parallel(step, "ep")
        if self.cp > 1:
            step = context_parallel(step, "cp", **dict(cp_options or {}))
        if self.tp > 1:
            if tp_plan is None:
                raise ValueError(f"{self}: tensor parallel needs a plan; pass tp_plan= (e.g. sw.tp.tiny_gpt_plan())")
            step = tensor_parallel(step, "tp", tp_plan)
        if self.pp > 1:
            step = pipeline(step, "pp", self.schedule, self.microbatches)
        if self.zero_stage:
            step = shard_params(step, "dp", self.zero_stage, reshard_after_forward=self.reshard_after_forward,
                                replicate="rep" if self.replicate > 1 else None)
        if self.precision is not None:
            step = mixed_precision(step, self.precision)
        if self.remat is not None:
            step = remat(step, self.remat)
        return step

    def __str__(self) -> str:
        parts = [" x ".join(f"{axis}{self.size(axis)}" for axis in AXES if self.size(axis) > 1) or "single"]
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}" + ("" if self.reshard_after_forward is None
                                                      else f" reshard={self.reshard_after_forward}"))
        if self.schedule is not None:
            parts.append(f"{self.schedule} mb{self.microbatches}")
        if self.remat is not None:
            parts.append(f"remat={self.remat}")
        if self.precision is not None:
            parts.append(f"precision={self.precision}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "zero_stage": self.zero_stage,
                "reshard_after_forward": self.reshard_after_forward, "schedule": self.schedule,
                "microbatches": self.microbatches, "remat": self.remat, "precision": self.precision,
                "cp": self.cp, "ep": self.ep, "replicate": self.replicate}
