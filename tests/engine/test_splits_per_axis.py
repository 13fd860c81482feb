"""Splits per axis: a stack's SPLIT specs, one per mesh axis, are one split to the engine (stack/splits.py).

tensor_parallel composes with context_parallel and expert_parallel (their own tests:
tests/transforms/context_parallel/test_cp_tensor_parallel.py, tests/transforms/expert_parallel/
test_ep_tensor_parallel.py); the composition is shown here with a split written for it, the smallest there is:
:class:`DataSplit` replicates every parameter, cuts the batch over its axis and sums every gradient
over it inside the layers, recording the sums through the engine's ``in_layer``. Beside
tensor_parallel it exercises every combined answer: the rewrites in order, the batch cut, the
metrics counted once, the replicas checked per axis, the in-layer collectives of both axes predicted
in one block by tensor parallel's own predictor, the random streams. The composed step must equal
the single-device step (float64, thread ranks) and issue exactly its Plan's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.engine.layout.state_layout import TensorSplit
from shardwise.engine.model.chain import Chain, Layer
from shardwise.engine.stack import compose, in_layer
from shardwise.engine.stack.compose import SPLIT, add, check_stack
from shardwise.engine.stack.roles import NO_CUT, BatchCut, check_role
from shardwise.engine.stack.splits import Splits
from shardwise.testing.models import Block, TinyGPT, mlp
from shardwise.transforms.context_parallel import CPSpec
from shardwise.transforms.expert_parallel import EPSpec

from .test_plan_contract import _check_contract


class _Summed:
    """A layer fn whose parameters' gradients are summed over ``axis`` in backward."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor], Any], Any], axis: str, names: frozenset[str]) -> None:
        self.fn, self.axis, self.names = fn, axis, names

    def __call__(self, tensors: dict[str, torch.Tensor], x: Any) -> Any:
        return self.fn({k: in_layer.grad_summed(t, self.axis, k) if k in self.names else t
                        for k, t in tensors.items()}, x)


@dataclass(frozen=True)
class DataSplit:
    """Data parallel written as a SPLIT over ``axis``: every parameter replicated, the batch cut."""

    axis: str
    name: ClassVar[str] = "data_split"
    role: ClassVar[str] = SPLIT
    replica_fix: ClassVar[str] = "data_split sums every gradient over its axis inside the layers"

    def __str__(self) -> str:
        return f"data_split(axis={self.axis!r})"

    def rewrite(self, chain: Chain, stack: tuple[Any, ...] = ()) -> Chain:
        return Chain([Layer(layer.name, _Summed(layer.fn, self.axis, frozenset(layer.param_names)), layer.param_names,
                            layer.buffers, layer.ties) for layer in chain])

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        return {layer.name: f"data split: gradients summed over {self.axis!r}" for layer in chain if layer.param_names}

    def tensor_splits(self, chain: Chain, mesh: sw.Mesh | None) -> dict[tuple[str, str], TensorSplit]:
        return {}

    def local_view(self, chain: Chain, params: Any, mesh: sw.Mesh | None, rank: int | None) -> Any:
        return params

    def replicated(self, chain: Chain) -> frozenset[tuple[str, str]]:
        return frozenset((layer.name, n) for layer in chain for n in layer.owned_param_names)

    def batch_cut(self, mesh: sw.Mesh | None) -> BatchCut:
        return BatchCut(axes=(self.axis,))

    def counts_replicated(self, mesh: sw.Mesh | None) -> bool:
        assert mesh is not None
        return mesh.axis_index(self.axis) == 0

    def rng_rank(self, mesh: sw.Mesh | None) -> None:
        return None


def data_split(step: sw.Step, axis: str) -> sw.Step:
    return add(step, DataSplit(axis))


def vocab_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return sw.tp.vocab_parallel_cross_entropy(logits, targets)


def gpt() -> tuple[sw.Step, Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8).double()
    chain, params = sw.functionalize(model, units=Block)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 32, (8, 9), generator=gen)
        batches.append((ids[:, :-1], ids[:, 1:]))
    return sw.train_step(chain, vocab_loss, sw.optim.sgd(0.1, momentum=0.9)), params, batches


def _tp(step: sw.Step, sp: bool) -> sw.Step:
    blocks = sw.tp.TINY_GPT_BLOCKS if sp else None
    return sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(), sequence_parallel=blocks)


STACKS = {
    "tp-then-ds": lambda s: data_split(_tp(s, False), "ds"),
    "ds-then-tp-sp": lambda s: _tp(data_split(s, "ds"), True),
}


@pytest.mark.parametrize("stack", list(STACKS))
def test_tensor_parallel_beside_another_split_equals_the_single_device_step(stack: str) -> None:
    step, params, batches = gpt()
    composed = STACKS[stack](step)
    assert composed.split.axes in (("tp", "ds"), ("ds", "tp")) and len(composed.split.parts) == 2
    sw.testing.assert_equivalent(composed, step, sw.Mesh(tp=2, ds=2), batches, params)


def test_the_composed_step_issues_exactly_its_plan_over_both_axes() -> None:
    step, params, batches = gpt()
    composed = STACKS["tp-then-ds"](step)
    mesh = sw.Mesh(tp=2, ds=2)
    plan = _check_contract(composed, mesh, params, batches[0])
    actions = plan.for_rank(3)
    inside = {(a.op, a.axis) for a in actions if a.kind == "inside"}
    assert {("psum", "tp"), ("psum", "ds")} <= inside  # both splits' collectives, predicted in one block
    assert [a.axis for a in actions if a.kind == "check_replicas"] == ["tp", "ds"]
    assert [a.axis for a in actions if a.kind == "wait_check"] == ["tp", "ds"]
    assert {a.axis for a in actions if a.kind == "reduce_metrics"} == {"tp", "ds"}
    text = str(plan)  # the four ranks issue alike: they print once
    assert f"ranks 0-3: {len(actions)} actions" in text and "data split: gradients summed over 'ds'" in text


def test_a_step_with_zero_beside_two_splits_equals_the_single_device_step() -> None:
    step, params, batches = gpt()
    composed = sw.shard_params(STACKS["tp-then-ds"](step), "dp", 3)
    sw.testing.assert_equivalent(composed, step, sw.Mesh(dp=2, tp=2, ds=2), batches[:1], params)


def test_the_composite_counts_each_gradient_and_loss_once_and_draws_as_tensor_parallel_asks() -> None:
    step, _, _ = gpt()
    composed = STACKS["tp-then-ds"](step)
    chain, split = composed.base_chain, composed.split
    tp_cut = frozenset(composed.split.parts[0].tensor_splits(chain, sw.Mesh(tp=2, ds=2)) or ())
    every = split.parts[1].replicated(chain)
    assert split.replicated(chain) == every - tp_cut and tp_cut

    def ask() -> tuple[Any, bool, int | None, tuple[int, int]]:
        with sw.Mesh(tp=2, ds=2) as mesh:
            return split.counted(chain, mesh), split.counts_losses(mesh), split.rng_rank(mesh), (
                mesh.axis_index("tp"), mesh.axis_index("ds"))

    for counted, losses, rng, (tp, ds) in sw.launch(ask, 4):
        if tp == 0 and ds == 0:
            assert counted is None and losses  # counts everything
        elif ds == 0:
            assert counted == tp_cut and not losses  # its tp slices; the loss is tp index 0's
        else:  # its own share of the batch (counted by tp index 0), no gradient (ds index 0 counts them)
            assert counted == frozenset() and losses == (tp == 0)
        assert rng == sw.Mesh(tp=2, ds=2).rank_of({"tp": 0, "ds": ds})  # tp draws at index 0, ds its own


def test_two_splits_cutting_one_parameter_are_refused_naming_both() -> None:
    @dataclass(frozen=True)
    class Cuts(DataSplit):
        name: ClassVar[str] = "cuts"

        def tensor_splits(self, chain: Chain, mesh: sw.Mesh | None) -> dict[tuple[str, str], TensorSplit]:
            return {("0", "weight"): TensorSplit(self.axis, 0, 2)}

    chain, _ = sw.functionalize(mlp([4, 8, 3]))
    step = sw.tensor_parallel(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "tp", {"0": sw.tp.Colwise()})
    both = add(step, Cuts("ds"))
    with pytest.raises(ValueError, match=r"tensor_parallel and cuts both cut parameter 'weight' of layer '0'"):
        both.split.tensor_splits(both.base_chain, sw.Mesh(tp=2, ds=2))


def test_two_splits_cutting_the_sequence_are_refused() -> None:
    def sequence(axis: str) -> Any:
        @dataclass(frozen=True)
        class Sequence(DataSplit):
            def batch_cut(self, mesh: sw.Mesh | None) -> BatchCut:
                return BatchCut(sequence_parts=2, cut_sequence=lambda pair, rank: pair)

        return Sequence(axis)

    with pytest.raises(ValueError, match="two splits cut each sequence"):
        Splits((sequence("a"), sequence("b"))).batch_cut(None)
    assert Splits((sequence("a"), DataSplit("b"))).batch_cut(None).axes == ("b",)
    assert Splits(()).batch_cut(None) is NO_CUT


def test_one_split_per_axis_and_the_pairs_not_yet_composed_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    step, _, _ = gpt()
    check_role(DataSplit("ds"))
    with pytest.raises(ValueError, match=r"tensor_parallel and data_split both use axis 'tp'.*one split per axis"):
        data_split(_tp(step, False), "tp")
    a, b = CPSpec("cp"), EPSpec("ep")
    check_stack((a, b))  # they compose (tests/transforms/expert_parallel/test_ep_context_parallel.py)
    monkeypatch.setitem(compose.NOT_YET_TOGETHER, frozenset({a.name, b.name}), "{a} and {b} cannot share a stack yet")
    for pair in ((a, b), (b, a)):  # named in one order, whichever came first
        with pytest.raises(ValueError, match="context_parallel and expert_parallel cannot share a stack yet"):
            check_stack(pair)

    @dataclass(frozen=True)
    class Predicts(DataSplit):
        name: ClassVar[str] = "predicts"

        def inner_collectives(self, *args: Any) -> dict[tuple[str, int], list[in_layer.Issued]]:
            return {}

    with pytest.raises(ValueError, match="tensor_parallel and predicts each bring their own prediction"):
        check_stack((*_tp(step, False).transforms, Predicts("ds")))
