"""DeepSeek-V3 and GLM-4-MoE under sw.expert_parallel with sw.tensor_parallel's sequence parallel (TP + SP + EP).

Their MoE blocks route with a router of their own (sigmoid scores plus a correction bias, the top k within
the best groups of experts, renormalized and scaled), which expert_parallel calls as it is on each (tp, ep)
rank's slice of the sequence of its batch share; their shared experts run on the slice, replicated;
DeepSeek-V3's attention is MLA (low-rank queries and keys/values) split by heads. Both orders of the two
transforms, at tp2 x ep2 and dp2 x tp2 x ep2 ZeRO-3, each family in each order and on each mesh once; and
DeepSeek-V3 as HF writes it.

float64 on thread ranks at rtol=1e-9: HF's routers (and DeepSeek-V3's RMSNorms) compute in float32 whatever
the model's dtype, so those run in the model's dtype, the same code otherwise (test_sequence_parallel_moe.py
says why: tensor parallel's sums in another order, rounded to float32 by the norm's backward); as HF writes
them, within float32's precision. Every rank's first step issues exactly the collectives its Plan lists.
(expert_parallel alone on these blocks, ep2 and dp2 x ep2 ZeRO-3: test_ep_own_router.py.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import pytest

import shardwise as sw
from shardwise.collectives.ledger import Ledger, comm_ledger
from shardwise.testing.equivalence import COMPARED_METRICS
from shardwise.testing.plan_check import ranks_off_plan

transformers = pytest.importorskip("transformers")

# The models, batches and plans of tensor parallel's own MoE-on-slices tests (DeepSeek-V3's MLA split by heads).
from ..tensor_parallel.test_sequence_parallel_moe import (  # noqa: E402
    BLOCKS,
    _grouped_plan,
    _problem,
    _rms_norm_in_the_models_dtype,
)
from .test_ep_own_router import _router_in_the_models_dtype  # noqa: E402

_HOME = {"deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3",
         "glm4_moe": "transformers.models.glm4_moe.modeling_glm4_moe.Glm4Moe"}


def assert_equivalent_and_plan_is_run(step: sw.Step, reference: sw.Step, mesh: sw.Mesh, batches: Sequence[Any],
                                      params: Any, rtol: float) -> Any:
    """sw.testing.assert_equivalent and assert_plan_is_run in one launch of the ranks (the suite's time): each
    rank's first step runs under the communication ledger, which must list what the Plan lists for it."""
    plan = step.plan(mesh, params, batches[0])
    expected = sw.testing.record_history(reference, reference.init(params), batches)

    def program() -> tuple[list[Any], Any]:
        state = step.init(params, mesh)
        with comm_ledger() as mine:
            state, metrics = step(state, batches[0])
        first = ({k: metrics[k].detach().clone() for k in COMPARED_METRICS if k in metrics},
                 optree.tree_map(lambda t: t.detach().clone(), step.full_params(state)))
        return [first, *sw.testing.record_history(step, state, batches[1:])], mine.records

    ran = sw.launch(program, mesh.size, timeout=120)
    sw.testing.compare_histories([history for history, _ in ran], expected, rtol=rtol)
    ledger = Ledger()
    for _, records in ran:
        for record in records:
            ledger.add(record)
    assert not ranks_off_plan(plan, ledger), f"ranks {ranks_off_plan(plan, ledger)} issued other collectives"
    return plan


@pytest.mark.parametrize(("family", "ep_first", "zero3", "as_hf_writes_it"), [
    ("deepseek_v3", False, False, False), ("glm4_moe", True, False, False), ("deepseek_v3", True, True, False),
    ("glm4_moe", False, True, False), ("deepseek_v3", False, False, True),
])
def test_grouped_routing_under_tp_sp_ep_equals_the_single_device_step(
        family: str, ep_first: bool, zero3: bool, as_hf_writes_it: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """As HF writes it (its router and norms in float32: HF's own code runs on the slices), within float32's
    precision, the bound of test_sequence_parallel_moe.py's test of it: 2.9e-8 relative measured, 1.7e-8 at the
    first step."""
    if not as_hf_writes_it:
        monkeypatch.setattr(f"{_HOME[family]}TopkRouter.forward", _router_in_the_models_dtype)
        if family == "deepseek_v3":
            monkeypatch.setattr(f"{_HOME[family]}RMSNorm.forward", _rms_norm_in_the_models_dtype)
    step, params, batches = _problem(family)
    plan = _grouped_plan(family)
    if ep_first:
        composed = sw.tensor_parallel(sw.expert_parallel(step, "ep"), "tp", plan, sequence_parallel=BLOCKS)
    else:
        composed = sw.expert_parallel(sw.tensor_parallel(step, "tp", plan, sequence_parallel=BLOCKS), "ep")
    mesh = sw.Mesh(ep=2, tp=2)
    if zero3:
        composed, mesh = sw.shard_params(composed, "dp", 3), sw.Mesh(dp=2, ep=2, tp=2)
    cut = {name: c.axis for (_layer, name), c in composed.split.tensor_splits(composed.base_chain, mesh).items()
           if ".mlp." in name and c.axis != "dp"}
    # The first layer is dense; the MoE layers' routed experts over ep, their shared experts and routers whole.
    assert cut == {f"model.layers.{i}.mlp.experts.{w}": "ep" for i in (1, 2) for w in ("gate_up_proj", "down_proj")}
    planned = assert_equivalent_and_plan_is_run(composed, step, mesh, batches, params,
                                               rtol=1e-6 if as_hf_writes_it else 1e-9)
    ops = {(c.axis, c.op) for c in planned.collectives(0)}
    assert {("ep", "all_to_all"), ("tp", "all_gather"), ("tp", "psum_scatter")} <= ops, ops
    assert ("dp", "all_gather") in ops if zero3 else not any(axis == "dp" for axis, _ in ops)
