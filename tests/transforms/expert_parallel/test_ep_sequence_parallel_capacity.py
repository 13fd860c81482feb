"""expert_parallel's capacity under tensor_parallel's sequence parallel (TP + SP + EP): a rank's tokens are its
slice of the sequence of its batch share.

Inside a sequence-parallel block each (tp, ep) rank routes the tokens of its slice, so its capacity is
``ceil(f * slice tokens * top_k / E)`` and, with ``drop_per_rank=True``, it drops its slice's assignments over it
(Megatron counts its capacity over a rank's local tokens under SP too). Pinned against a one-device reference
written here from the documented rule alone (``_DropsAsEachRank``: HF's own router and experts, each rank's
slice cut from the whole batch, the drop rule in plain loops), not from expert_parallel's code. Without
``drop_per_rank`` a capacity that drops nothing is the single-device step, and a drop in one tp slice only is
refused on the ranks of that slice (the others do not hang). Qwen3-MoE, float64 on thread ranks, tp2 x ep2.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

import shardwise as sw

transformers = pytest.importorskip("transformers")

from ..tensor_parallel.test_sequence_parallel_moe import ATTENTION_ONLY, BLOCKS, _batches, _model  # noqa: E402
from .test_ep_sequence_parallel_grouped import assert_equivalent_and_plan_is_run  # noqa: E402

EP, TP = 2, 2
MESH = sw.Mesh(ep=EP, tp=TP)


class _DropsAsEachRank:
    """A Qwen3-MoE block's forward on one device that drops what each rank of an ``ep`` x ``tp`` mesh drops under
    TP + SP + EP: the rank (e, t) holds batch rows ``e``'s share and sequence positions ``t``'s slice; it takes its
    tokens batch-major, gives each expert its first ``ceil(f * tokens * top_k / E)`` assignments (every token's
    first choice in token order, then every second choice) and drops the rest (not renormalized). A dropped
    assignment gets expert index E, which HF's experts skip. ``dropped`` logs (e, t, count) per call."""

    dropped: ClassVar[list[tuple[int, int, int]]] = []  # on the class: functionalize copies the instances

    def __init__(self, block: Any, ep: int, tp: int, capacity_factor: float) -> None:
        self.block, self.ep, self.tp, self.factor = block, ep, tp, capacity_factor

    def __call__(self, hidden: Tensor) -> Tensor:
        batch, sequence, width = hidden.shape
        rows, positions = batch // self.ep, sequence // self.tp
        num_experts = self.block.experts.num_experts
        parts = []
        for e in range(self.ep):
            line = []
            for t in range(self.tp):
                tokens = hidden[e * rows:(e + 1) * rows, t * positions:(t + 1) * positions].reshape(-1, width)
                _, weights, experts = self.block.gate(tokens)
                n, top_k = experts.shape
                capacity = math.ceil(self.factor * n * top_k / num_experts)
                given, kept = [0] * num_experts, experts.clone()
                for choice in range(top_k):
                    for token in range(n):
                        expert = int(experts[token, choice])
                        given[expert] += 1
                        if given[expert] > capacity:
                            kept[token, choice] = num_experts
                self.dropped.append((e, t, int((kept == num_experts).sum())))
                line.append(self.block.experts(tokens, kept, weights).view(rows, positions, width))
            parts.append(torch.cat(line, dim=1))
        return torch.cat(parts, dim=0)


def _problem(reference: tuple[int, int, float] | None = None) -> tuple[sw.Step, Any, list[Any]]:
    """Qwen3-MoE (two layers, four experts, two a token), its blocks dropping as ``reference`` = (ep, tp, f) says."""
    model, block = _model("qwen3_moe")
    if reference is not None:
        for layer in model.model.layers:
            layer.mlp.forward = _DropsAsEachRank(layer.mlp, *reference)
    batches = _batches()
    chain, params = sw.functionalize(model, units=block, example_input=batches[0][0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y),
                         sw.optim.sgd(0.1, momentum=0.9))
    return step, params, batches


def _tp_sp_ep(step: sw.Step, capacity_factor: float, drop_per_rank: bool = False) -> sw.Step:
    split = sw.tensor_parallel(step, "tp", ATTENTION_ONLY, sequence_parallel=BLOCKS)
    return sw.expert_parallel(split, "ep", capacity_factor, drop_per_rank=drop_per_rank)


def _loss(step: sw.Step, params: Any, batch: Any) -> float:
    return float(step(step.init(params), batch)[1]["loss"])


def test_drop_per_rank_drops_each_slices_overflow_as_documented() -> None:
    """capacity_factor=1.0: 8 tokens a rank (2 rows x 4 positions), capacity ceil(8 x 2 / 4) = 4 per expert."""
    step, params, batches = _problem()
    reference, _, _ = _problem((EP, TP, 1.0))
    composed = _tp_sp_ep(step, 1.0, drop_per_rank=True)
    _DropsAsEachRank.dropped.clear()
    assert_equivalent_and_plan_is_run(composed, reference, MESH, batches, params, rtol=1e-9)
    assert sum(count for _, _, count in _DropsAsEachRank.dropped) > 0  # the reference dropped: the check has teeth
    # Not the batch share's capacity: dropping over each ep rank's whole share (16 tokens, capacity 8), as
    # expert_parallel without sequence parallel does, is another model.
    share, _, _ = _problem((EP, 1, 1.0))
    assert abs(_loss(share, params, batches[0]) - _loss(reference, params, batches[0])) > 1e-6


def test_a_capacity_that_drops_nothing_needs_no_opt_in_and_bounds_the_all_to_alls() -> None:
    """capacity_factor=1.75: ceil(1.75 x 8 x 2 / 4) = 7 slots a (rank, expert), one fewer than the slice's 8
    tokens: nothing drops on these batches, so the step is the single-device one, and each all-to-all carries
    4 experts x 7 slots x 16 hidden float64s (8 without a capacity)."""
    step, params, batches = _problem()
    plan = assert_equivalent_and_plan_is_run(_tp_sp_ep(step, 1.75), step, MESH, batches, params, rtol=1e-9)
    sizes = {c.nbytes for c in plan.collectives(0) if c.op == "all_to_all"}
    assert sizes == {4 * 7 * 16 * 8}, sizes


def test_a_drop_in_one_slice_only_is_refused_and_no_rank_hangs() -> None:
    """The second half of every sequence one token repeated: its tp slice routes them alike and drops, the first
    slice (causal attention: its hidden states do not see the second half) drops nothing at the same factor.
    The ranks of the second slice refuse, naming drop_per_rank; those of the first, waiting for them in a
    collective over tp, are stopped."""
    step, params, batches = _problem()
    batches = [(x.clone().index_fill_(1, torch.arange(4, 8), 7), y) for x, y in batches]
    reference, _, _ = _problem((EP, TP, 1.75))
    _DropsAsEachRank.dropped.clear()
    _loss(reference, params, batches[0])
    by_slice = [sum(n for _, t, n in _DropsAsEachRank.dropped if t == slice_) for slice_ in range(TP)]
    assert by_slice[0] == 0 and by_slice[1] > 0, by_slice
    second = "|".join(str(r) for r in range(MESH.size) if MESH.coords_of(r)["tp"] == 1)
    with pytest.raises(sw.collectives.RankFailed, match=rf"rank ({second}) failed(.|\n)*model\.layers\.\d\.mlp would "
                                                        r"drop \d+ token assignments(.|\n)*its slice of the sequence"
                                                        r"(.|\n)*drop_per_rank=True"):
        sw.testing.assert_equivalent(_tp_sp_ep(step, 1.75), step, MESH, batches[:1], params)
