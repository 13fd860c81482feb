"""Drawn tensor-parallel plans and meshes are the single-device step (float64, threads, 1e-12).

* MLPs: drawn widths (the hidden ones multiples of 4, so tp 2 and 4 divide them), which
  Linears form Colwise / Rowwise pairs and which stand alone as a gathered Colwise, tp in
  {2, 4}, dp in {1, 2} with a drawn ZeRO stage.
* TinyGPT: drawn width, heads, depth and sequence, sequence parallel on or off, the
  vocabulary-parallel loss on or off, the same meshes.

Each example is a few milliseconds of model (batch at most 6, 2 steps); the CI profile
(tests/conftest.py: 12 derandomized examples) keeps each property to a few seconds.
The 1e-12 bound is the equivalence tests' (test_equivalence.py says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

import shardwise as sw

F64_RTOL = 1e-12


@dataclass(frozen=True)
class MlpCase:
    widths: tuple[int, ...]
    plan: dict[str, Any]


@st.composite
def mlp_cases(draw: st.DrawFn) -> MlpCase:
    linears = draw(st.integers(2, 5))
    hidden = [4 * draw(st.integers(1, 4)) for _ in range(linears - 1)]
    widths = (draw(st.integers(1, 6)), *hidden, draw(st.integers(1, 6)))
    # Walk the Linears: start a pair (Colwise, then Rowwise on the next), gather one alone
    # (only where its output is a hidden width), or leave it whole. Linear i is module "2i".
    plan: dict[str, Any] = {}
    i = 0
    while i < linears:
        choices = ["whole"] + (["pair"] if i + 1 < linears else []) + (["gathered"] if i + 1 < linears else [])
        choice = draw(st.sampled_from(choices))
        if choice == "pair":
            plan[str(2 * i)], plan[str(2 * i + 2)] = sw.tp.Colwise(), sw.tp.Rowwise()
            i += 2
            continue
        if choice == "gathered":
            plan[str(2 * i)] = sw.tp.Colwise(output="replicated")
        i += 1
    if not plan:  # a plan splits something
        plan = {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()} if linears > 1 else {}
    return MlpCase(widths, plan)


def _draw_stack(data: st.DataObject, step: sw.Step) -> tuple[sw.Step, sw.Mesh]:
    """tp in {2, 4}; dp in {1, 2}, with a drawn ZeRO stage over dp."""
    tp = data.draw(st.sampled_from([2, 4]), label="tp")
    dp = data.draw(st.sampled_from([1, 2]), label="dp")
    if dp == 1:
        return step, sw.Mesh(tp=tp)
    stage = data.draw(st.sampled_from([1, 2, 3]), label="ZeRO stage")
    return sw.shard_params(step, "dp", stage), sw.Mesh(dp=dp, tp=tp)


@given(case=mlp_cases(), rows=st.integers(1, 3), data=st.data())
def test_drawn_mlp_plans_equal_the_single_device_step(
    case: MlpCase, rows: int, data: st.DataObject, build: dict[str, Callable]
) -> None:
    problem = build["mlp"](case.widths, case.plan, steps=2, batch=2 * rows)
    step, mesh = _draw_stack(data, sw.tensor_parallel(problem.step, "tp", problem.plan))
    sw.testing.assert_equivalent(step, problem.step, mesh, problem.batches, problem.params, rtol=F64_RTOL)


@given(
    width=st.sampled_from([16, 32]),
    heads=st.sampled_from([4, 8]),
    layers=st.integers(1, 2),
    seq=st.sampled_from([4, 8]),
    sequence_parallel=st.booleans(),
    vocab_parallel=st.booleans(),
    data=st.data(),
)
def test_drawn_gpt_plans_equal_the_single_device_step(
    width: int, heads: int, layers: int, seq: int, sequence_parallel: bool, vocab_parallel: bool,
    data: st.DataObject, build: dict[str, Callable],
) -> None:
    problem = build["tiny_gpt"](d_model=width, n_heads=heads, n_layers=layers, seq=seq, steps=2,
                                vocab_parallel=vocab_parallel)
    base = sw.tensor_parallel(problem.step, "tp", problem.plan,
                              sequence_parallel=problem.blocks if sequence_parallel else None)
    step, mesh = _draw_stack(data, base)
    sw.testing.assert_equivalent(step, problem.step, mesh, problem.batches, problem.params, rtol=F64_RTOL)
