"""Hypothesis strategies for property tests of parallel training steps.

Draw a whole problem (model, parameters, batches, loss) and a transform stack,
then check the transformed step against the single-device one:

>>> from hypothesis import given, settings
>>> import shardwise as sw
>>> from shardwise.testing import strategies as sst
>>> @settings(max_examples=2, deadline=None, derandomize=True)
... @given(problem=sst.problems(), mesh=sst.meshes(sizes=[1, 2]), stack=sst.transform_stacks())
... def test_sharded_step_is_exact(problem, mesh, stack):
...     step = stack.apply(problem.step)
...     batches = problem.batches_for(mesh, multiple=stack.microbatches)
...     sw.testing.assert_equivalent(step, problem.step, mesh, batches, problem.params)
>>> test_sharded_step_is_exact()
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

from ..collectives.mesh import Mesh
from ..engine.model.chain import Chain
from ..engine.model.functionalize import functionalize
from ..engine.optim.optimizers import Optimizer, adamw, sgd
from ..engine.step.step import Step, train_step
from ..transforms.mixed_precision import mixed_precision
from ..transforms.pipeline import pipeline
from ..transforms.remat import remat
from ..transforms.shard_params import shard_params
from ..transforms.tensor_parallel import Colwise, Rowwise, tensor_parallel
from .models import mlp

__all__ = [
    "ChainCase",
    "Problem",
    "TransformStack",
    "batches",
    "chains",
    "meshes",
    "optimizers",
    "pipeline_options",
    "problems",
    "shard_params_options",
    "tensor_parallel_options",
    "transform_stacks",
]

ACTIVATIONS = ("gelu", "relu", "silu", "tanh")


@st.composite
def meshes(draw: st.DrawFn, sizes: Sequence[int] = (1, 2, 3, 4, 8), axis: str = "dp") -> Mesh:
    """A one-axis mesh of a drawn size."""
    return Mesh({axis: draw(st.sampled_from(list(sizes)))})


@dataclass(frozen=True)
class ChainCase:
    """A drawn MLP: its widths, activation, and the functionalized chain with its params."""

    widths: tuple[int, ...]
    activation: str
    chain: Chain
    params: Any
    dtype: torch.dtype


@st.composite
def chains(
    draw: st.DrawFn,
    min_depth: int = 1,
    max_depth: int = 4,
    max_width: int = 9,
    dtype: torch.dtype = torch.float64,
) -> ChainCase:
    """An MLP chain of drawn depth and (uneven) widths, so flat buffers need padding."""
    depth = draw(st.integers(min_depth, max_depth))
    dims = tuple(draw(st.integers(1, max_width)) for _ in range(depth + 1))
    activation = draw(st.sampled_from(ACTIVATIONS))
    seed = draw(st.integers(0, 2**16))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = mlp(dims, activation).to(dtype)
    chain, params = functionalize(module)
    return ChainCase(dims, activation, chain, params, dtype)


def batches(
    in_features: int, out_features: int, batch_size: int, steps: int, dtype: torch.dtype, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` regression batches ``(inputs, targets)``, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, in_features, generator=gen, dtype=dtype),
            torch.randn(batch_size, out_features, generator=gen, dtype=dtype),
        )
        for _ in range(steps)
    ]


@st.composite
def optimizers(draw: st.DrawFn) -> Optimizer:
    """SGD with momentum (exposes gradient-scale bugs) or AdamW."""
    if draw(st.booleans()):
        return sgd(lr=draw(st.sampled_from([0.05, 0.1])), momentum=0.9, weight_decay=draw(st.sampled_from([0.0, 0.01])))
    return adamw(lr=draw(st.sampled_from([1e-3, 1e-2])), weight_decay=draw(st.sampled_from([0.0, 0.1])))


@dataclass(frozen=True)
class Problem:
    """A single-device training problem: the reference step, its params, and a batch recipe."""

    case: ChainCase
    step: Step
    steps: int
    per_rank_batch: int
    seed: int

    @property
    def params(self) -> Any:
        return self.case.params

    def batches_for(self, mesh: Mesh, multiple: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Global batches that divide over every mesh axis and into ``multiple`` micro-batches."""
        size = self.per_rank_batch * mesh.size * multiple
        widths = self.case.widths
        return batches(widths[0], widths[-1], size, self.steps, self.case.dtype, self.seed)


@st.composite
def problems(
    draw: st.DrawFn,
    dtype: torch.dtype = torch.float64,
    max_depth: int = 4,
    max_steps: int = 3,
    clip: bool = True,
) -> Problem:
    """A drawn chain, optimizer, optional gradient clipping and batch recipe (MSE loss)."""
    case = draw(chains(max_depth=max_depth, dtype=dtype))
    optimizer = draw(optimizers())
    clip_norm = draw(st.sampled_from([None, 0.5])) if clip else None
    step = train_step(case.chain, torch.nn.functional.mse_loss, optimizer, clip_norm=clip_norm)
    return Problem(case, step, draw(st.integers(1, max_steps)), draw(st.integers(1, 3)), draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class TransformStack:
    """Transforms to apply, innermost first, each a (name, kwargs) pair; ``apply`` builds the step."""

    transforms: tuple[tuple[str, dict[str, Any]], ...] = field(default=())

    def apply(self, step: Step) -> Step:
        for name, kwargs in self.transforms:
            step = _TRANSFORMS[name](step, **kwargs)
        return step

    @property
    def microbatches(self) -> int:
        """How many micro-batches a rank's batch must divide into."""
        return math.prod(kw.get("accumulation", kw.get("microbatches", 1)) for _, kw in self.transforms)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in kw.items())})" for n, kw in self.transforms)
        return f"TransformStack[{inner}]"


_TRANSFORMS: dict[str, Callable[..., Step]] = {
    "shard_params": shard_params,
    "pipeline": pipeline,
    "remat": remat,
    "mixed_precision": mixed_precision,
    "tensor_parallel": tensor_parallel,
}


@st.composite
def shard_params_options(draw: st.DrawFn, axis: str = "dp", under_pipeline: bool = False) -> dict[str, Any]:
    """shard_params' options: a ZeRO stage, resharding (stage 3: the default, True or False),
    prefetch depth and, without a pipeline (whose micro-batches are the accumulation), accumulation."""
    stage = draw(st.sampled_from([1, 2, 3]))
    options: dict[str, Any] = {"axis": axis, "stage": stage}
    if stage == 3:  # only stage 3 gathers: the other stages refuse these options
        options["reshard_after_forward"] = draw(st.sampled_from([None, True, False]))
        options["prefetch"] = draw(st.integers(0, 2))
    if not under_pipeline:
        options["accumulation"] = draw(st.integers(1, 3))
    return options


@st.composite
def pipeline_options(draw: st.DrawFn, axis: str = "pp") -> dict[str, Any]:
    """A schedule with one stage per rank (so any chain with as many layers as ranks fits)."""
    return {
        "axis": axis,
        "schedule": draw(st.sampled_from(["gpipe", "1f1b", "zb_h1"])),
        "microbatches": draw(st.integers(1, 3)),
    }


@st.composite
def tensor_parallel_options(draw: st.DrawFn, case: ChainCase, size: int, axis: str = "tp") -> dict[str, Any] | None:
    """A tensor-parallel plan for a drawn MLP: some of its Linear pairs around an activation
    (``"0"``, ``"2"``; ``"4"``, ``"6"``; ...) split Megatron's way, the first on its output features
    (which ``size`` must divide) and the second on its input features, the rest left whole; None
    when no pair's middle width divides by ``size``."""
    linears = list(range(0, 2 * (len(case.widths) - 1), 2))  # mlp(): Linear at even positions
    pairs = [(a, b) for a, b in itertools.pairwise(linears) if case.widths[a // 2 + 1] % size == 0]
    chosen, last = [], -1
    for a, b in pairs:
        if a > last and draw(st.booleans()):
            chosen.append((a, b))
            last = b
    if not chosen:
        return None
    plan: dict[str, Any] = {}
    for a, b in chosen:
        plan[str(a)], plan[str(b)] = Colwise(), Rowwise()
    return {"axis": axis, "plan": plan}


@st.composite
def transform_stacks(
    draw: st.DrawFn, axis: str = "dp", pp: str | None = None, precision: str | None = None,
    tp: dict[str, Any] | None = None,
) -> TransformStack:
    """A stack of transforms in a drawn order: shard_params over ``axis``, a pipeline over ``pp``
    when given, tensor_parallel with the options ``tp`` when given (see
    :func:`tensor_parallel_options`), remat with a drawn policy or none, and mixed_precision with
    ``precision`` when given (an all-f64 policy keeps a float64 comparison exact)."""
    parts: list[tuple[str, dict[str, Any]]] = [
        ("shard_params", draw(shard_params_options(axis, under_pipeline=pp is not None)))
    ]
    if tp is not None:
        parts.append(("tensor_parallel", tp))
    if pp is not None:
        parts.append(("pipeline", draw(pipeline_options(pp))))
    policy = draw(st.sampled_from([None, "nothing_saveable", "dots_saveable", "everything_saveable"]))
    if policy is not None:
        parts.append(("remat", {"policy": policy}))
    if precision is not None:
        parts.append(("mixed_precision", {"policy": precision}))
    return TransformStack(tuple(draw(st.permutations(parts))))
