"""The public strategies' problems run on the processes backend: steps, optimizers and batches pickle."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.testing import strategies as sst


@pytest.mark.gloo
@settings(max_examples=1, suppress_health_check=[HealthCheck.too_slow])  # one launch of processes: ~3 s
@given(problem=sst.problems(max_depth=3, max_steps=2), data=st.data())
def test_a_drawn_stack_is_equivalent_on_gloo_processes(problem: sst.Problem, data: st.DataObject) -> None:
    stack = data.draw(sst.transform_stacks("dp"))
    mesh = sw.Mesh(dp=2)
    step = stack.apply(problem.step)
    batches = problem.batches_for(mesh, multiple=stack.microbatches)
    sw.testing.assert_equivalent(step, problem.step, mesh, batches, problem.params, backend="processes")
