"""Drawn stacks of all four transforms, in drawn orders, on dp x pp meshes: float64, exact to 1e-12.

The precision policy is all-f64 so that the comparison stays exact (casts are
no-ops and the loss scale, a power of two, divides out exactly); bf16
compositions are covered with an explained tolerance in test_composition.py.
"""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.testing import strategies as sst

F64 = "params=f64,compute=f64,output=f64,reduce=f64"


@given(
    problem=sst.problems(max_depth=4),
    dp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    stack=sst.transform_stacks("dp", pp="pp", precision=F64),
)
def test_drawn_compositions_equal_the_single_device_step(
    problem: sst.Problem, dp: int, pp: int, stack: sst.TransformStack
) -> None:
    assume(len(problem.case.chain) >= pp)  # fewer layers than stages is refused by design (tested elsewhere)
    mesh = sw.Mesh(dp=dp, pp=pp)
    reference = sw.mixed_precision(problem.step, F64)
    step = stack.apply(problem.step)
    batches = problem.batches_for(mesh, multiple=stack.microbatches)
    sw.testing.assert_equivalent(step, reference, mesh, batches, problem.params, rtol=1e-12)
