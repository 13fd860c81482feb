"""Tensor parallel's in-layer collectives predicted layer by layer give the Plan predicted stage by stage.

``predict`` composes a stage's forward, ``B``, ``I`` and ``W`` lists from each layer's, run once per
distinct layer; ``by_layer=False`` runs every stage whole (the reference). The Plans of both must be
equal, action by action (every collective, its bytes, its place) and figure by figure, for tensor
parallel alone, with data parallel, with pipelines (1F1B, interleaved, zero-bubble), with and without
sequence parallel, under mixed precision and remat; and the layer-by-layer way must run a block's
forward a number of times that does not grow with the blocks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.layout.state_layout import Placement
from shardwise.engine.model import reuse
from shardwise.engine.model.split_backward import input_part, weight_part
from shardwise.engine.stack.in_layer import Issued
from shardwise.transforms.tensor_parallel import LLAMA_BLOCKS
from shardwise.transforms.tensor_parallel import predict as tp_predict
from shardwise.transforms.tensor_parallel import spec as tp_spec

from .conftest import Problem, build_llama, build_tiny_gpt


def _tp(problem: Problem, sp: bool) -> sw.Step:
    return sw.tensor_parallel(problem.step, "tp", problem.plan, sequence_parallel=problem.blocks if sp else None)


STACKS: dict[str, Callable[[Problem], tuple[sw.Step, sw.Mesh]]] = {
    "tp2": lambda p: (_tp(p, False), sw.Mesh(tp=2)),
    "tp2-sp": lambda p: (_tp(p, True), sw.Mesh(tp=2)),
    "dp2xtp2-zero3-sp": lambda p: (sw.shard_params(_tp(p, True), "dp", 3), sw.Mesh(dp=2, tp=2)),
    "pp2xtp2-1f1b": lambda p: (sw.pipeline(_tp(p, False), "pp", "1f1b", 2), sw.Mesh(pp=2, tp=2)),
    "pp2xtp2-1f1b-sp": lambda p: (sw.pipeline(_tp(p, True), "pp", "1f1b", 2), sw.Mesh(pp=2, tp=2)),
    "pp2xtp2-interleaved-sp": lambda p: (
        sw.pipeline(_tp(p, True), "pp", "interleaved_1f1b", 2, stages=4), sw.Mesh(pp=2, tp=2)
    ),
    "pp2xtp2-zb_h1": lambda p: (sw.pipeline(_tp(p, False), "pp", "zb_h1", 2), sw.Mesh(pp=2, tp=2)),
    "pp2xtp2-zb_h1-sp": lambda p: (sw.pipeline(_tp(p, True), "pp", "zb_h1", 2), sw.Mesh(pp=2, tp=2)),
    "dp2xpp2xtp2-zero3-sp-bf16": lambda p: (
        sw.mixed_precision(sw.shard_params(sw.pipeline(_tp(p, True), "pp", "1f1b", 2), "dp", 3),
                           "params=f64,compute=bf16,output=f64,reduce=f32"),
        sw.Mesh(dp=2, pp=2, tp=2),
    ),
    "tp2-sp-remat": lambda p: (sw.remat(_tp(p, True)), sw.Mesh(tp=2)),
    "pp2xtp2-zb_h1-sp-remat": lambda p: (sw.pipeline(sw.remat(_tp(p, True)), "pp", "zb_h1", 2), sw.Mesh(pp=2, tp=2)),
}

PROBLEMS: dict[str, Callable[[], Problem]] = {
    "tiny_gpt": lambda: build_tiny_gpt(steps=1, n_layers=6, tie=False),
    "tiny_gpt-tied": lambda: build_tiny_gpt(steps=1, n_layers=4),  # ties: predicted stage by stage either way
    "llama": lambda: build_llama(steps=1),
}

# What the module builds once and every test reads (a problem, a meta-built step): planning only reads
# the step, its chain and the parameters (tensor parallel plans a copy of each block's module).
_BUILT: dict[Hashable, Any] = {}
_AS_BUILT: dict[Hashable, dict[tuple[str, str], Any]] = {}


def _once(key: Hashable, build: Callable[[], Any]) -> Any:
    if key not in _BUILT:
        _BUILT[key] = build()
        _AS_BUILT[key] = _snapshot(_params_of(_BUILT[key]))
    return _BUILT[key]


def _params_of(built: Any) -> dict[str, dict[str, torch.Tensor]]:
    return built.params if isinstance(built, Problem) else built[1]


def _snapshot(params: dict[str, dict[str, torch.Tensor]]) -> dict[tuple[str, str], Any]:
    """Each tensor: the object itself, and off meta its values."""
    return {(layer, name): (t, None if t.is_meta else t.clone())
            for layer, tensors in params.items() for name, t in tensors.items()}


@pytest.fixture(autouse=True)
def _untouched() -> Iterator[None]:
    """After each test, what ``_once`` built is as it was built: a test that wrote to a shared parameter
    fails here, instead of changing what a later test plans."""
    yield
    for key, built in _BUILT.items():
        now, then = _snapshot(_params_of(built)), _AS_BUILT[key]
        assert now.keys() == then.keys(), key
        for name, (t, values) in now.items():
            assert t is then[name][0], (key, name)
            assert values is None or torch.equal(values, then[name][1]), (key, name)


def _problem(family: str) -> Problem:
    return _once(family, PROBLEMS[family])


@functools.cache
def _plan_by_layer(family: str, stack: str) -> Any:
    """The layer-by-layer Plan of ``family`` under ``stack``, made once: two tests read it."""
    problem = _problem(family)
    step, mesh = STACKS[stack](problem)
    return step.plan(mesh, problem.params, problem.batches[0])


CASES = [("tiny_gpt", s) for s in STACKS] + [
    ("llama", "tp2-sp"), ("llama", "pp2xtp2-zb_h1-sp"), ("llama", "dp2xpp2xtp2-zero3-sp-bf16"),
    ("tiny_gpt-tied", "pp2xtp2-1f1b-sp"),
]


@pytest.mark.parametrize("family,stack", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_the_plan_predicted_layer_by_layer_equals_the_plan_predicted_stage_by_stage(
    family: str, stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = _problem(family)
    step, mesh = STACKS[stack](problem)
    batch = problem.batches[0]
    by_layer = _plan_by_layer(family, stack)
    with monkeypatch.context() as m:
        m.setattr(tp_spec, "predict", functools.partial(tp_predict.predict, by_layer=False))
        by_stage = step.plan(mesh, problem.params, batch)
    assert any(a.kind == "inside" for r in range(mesh.size) for a in by_layer.for_rank(r))
    for r in range(mesh.size):
        assert by_layer.for_rank(r) == by_stage.for_rank(r), f"rank {r}"
        assert list(by_layer.collectives(r)) == list(by_stage.collectives(r)), f"rank {r}"
    assert by_layer.actions == by_stage.actions
    assert dict(by_layer.memory) == dict(by_stage.memory)
    assert by_layer.layers == by_stage.layers


def test_a_stage_backward_lists_its_layers_in_reverse() -> None:
    """The composition is not symmetric: a stage's B is not its layers' lists in forward order
    (so the equality above would catch a composition in the wrong order)."""
    plan = _plan_by_layer("tiny_gpt", "pp2xtp2-1f1b-sp")  # PROBLEMS["tiny_gpt"]'s
    labels = [a for a in plan.for_rank(0) if a.kind == "inside"]
    assert labels  # the stage issues in-layer collectives at all
    order = [str(a) for a in labels]
    assert order != list(reversed(order))


_ISSUED: list[Issued] = []


class _OnThePath(torch.autograd.Function):
    """Stands for a collective on the input's path (a psum's backward): its backward records itself."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, label: str) -> torch.Tensor:
        ctx.label = label
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _ISSUED.append(Issued("psum", "tp", tuple(grad.shape), grad.dtype, "backward", ctx.label))
        return grad, None


class _Scale(torch.nn.Module):  # the first stage: the second's input then needs a gradient
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class _HandsOn(torch.nn.Module):  # uses its weight on the input's path, and hands twice it on
    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _OnThePath.apply(x * self.p, "1.c"), self.p * 2.0


class _Takes(torch.nn.Module):  # uses what it was handed on the input's path
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, q = pair
        return _OnThePath.apply(h, "2.c") * q


@contextlib.contextmanager
def _recording() -> Iterator[list[Issued]]:
    _ISSUED.clear()
    yield _ISSUED


def test_a_layer_that_hands_the_next_one_a_parameter_is_predicted_as_its_stage_runs() -> None:
    """A weight used on the input's path and handed on (as ``2 p``) to the next layer of the stage,
    which uses it on the input's path too: the stage's W reaches it from that layer's nodes and runs
    the input's path between again (engine/model/split_backward.py). Cut layer by layer, W would
    stop at the layer's edge and list one collective fewer than the run issues; such a stage is
    predicted whole. The reference: the split of the stage's real run."""
    model = torch.nn.Sequential(_Scale(), _HandsOn(), _Takes())
    chain, params = sw.functionalize(model)
    shapes = {layer: {k: (t.shape, t.dtype) for k, t in tensors.items()} for layer, tensors in params.items()}
    placement = Placement("pp", (("0",), ("1", "2")), (0, 1))
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    loss_fn = lambda y, t: (y * t).sum()  # noqa: E731
    by_layer = tp_predict.predict(chain, placement, shapes, loss_fn, x, target, _recording)
    whole = tp_predict.predict(chain, placement, shapes, loss_fn, x, target, _recording, by_layer=False)
    assert by_layer == whole
    # The stage run for real, split as the executor splits it: W re-runs both collectives.
    h = model[0](x).detach().requires_grad_()
    loss = loss_fn(model[2](model[1](h)), target)
    _ISSUED.clear()
    _, part = input_part([loss], [torch.ones_like(loss)], [h], [model[1].p])
    assert part is not None and [e.label for e in _ISSUED] == ["2.c", "1.c"]  # I
    _ISSUED.clear()
    weight_part(part)
    assert [e.label for e in _ISSUED] == ["2.c", "1.c"]  # W
    assert [e.label for e in whole[("backward_weight", 1)]] == ["2.c", "1.c"]
    assert [e.label for e in whole[("backward_input", 1)]] == ["2.c", "1.c"]


class _Makes(torch.nn.Module):  # makes a value of its weight alone, beside the input's path, and hands it on
    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _OnThePath.apply(x * 3.0, "1.c"), self.p * 2.0


class _UsesAndPasses(torch.nn.Module):  # uses the handed value on the input's path, and passes it on
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, q = pair
        return _OnThePath.apply(h * q, "2.c"), q


@pytest.mark.parametrize("blocks,whole", [(0, False), (1, True)], ids=["used-once", "used-twice"])
def test_a_value_of_parameters_alone_handed_on_is_predicted_whole_only_where_the_path_reaches_back(
        blocks: int, whole: bool) -> None:
    """A layer makes a value of its weight alone (as T5's relative position bias) and hands it on.
    Used once on the input's path, the weight pass from there goes back through that value alone:
    layer by layer is exact, and kept. Handed on to a second layer that uses it again (the first
    use's nodes lie on the input's path between), the stage's W re-runs them: predicted whole."""
    model = torch.nn.Sequential(_Scale(), _Makes(), *[_UsesAndPasses() for _ in range(blocks)], _Takes())
    chain, params = sw.functionalize(model)
    shapes = {layer: {k: (t.shape, t.dtype) for k, t in tensors.items()} for layer, tensors in params.items()}
    placement = Placement("pp", (("0",), tuple(chain.names[1:])), (0, 1))
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    loss_fn = lambda y, t: (y * t).sum()  # noqa: E731
    composed = tp_predict._predict_by_layer(chain, placement, shapes, loss_fn, x, target, _recording)
    assert (composed is None) == whole
    by_layer = tp_predict.predict(chain, placement, shapes, loss_fn, x, target, _recording)
    assert by_layer == tp_predict.predict(chain, placement, shapes, loss_fn, x, target, _recording, by_layer=False)
    # The real run's W, split as the executor splits it, issues what the prediction lists.
    h = model[0](x).detach().requires_grad_()
    y = h
    for layer in model[1:]:
        y = layer(y)
    loss = loss_fn(y, target)
    _, part = input_part([loss], [torch.ones_like(loss)], [h], [model[1].p])
    _ISSUED.clear()
    weight_part(part)
    assert [e.label for e in _ISSUED] == [e.label for e in by_layer[("backward_weight", 1)]]


T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")
DecoderLayer = T.models.llama.modeling_llama.LlamaDecoderLayer


def meta_llama_step(layers: int) -> tuple[sw.Step, Any]:
    """A Llama of ``layers`` identical blocks built on meta (its blocks say what they compute), built once
    for the module (``_once``)."""
    return _once(("meta_llama", layers), functools.partial(_build_meta_llama_step, layers))


def _build_meta_llama_step(layers: int) -> tuple[sw.Step, Any]:
    cfg = T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    example = torch.zeros((1, 8), dtype=torch.long)
    chain, params = sw.functionalize(model, units=DecoderLayer, example_input=example)
    loss = lambda out, t: sw.tp.vocab_parallel_cross_entropy(out.logits, t)  # noqa: E731
    return sw.train_step(chain, loss, sw.optim.adamw(1e-3)), params


def _meta_tp(step: sw.Step, sp: bool = True) -> sw.Step:
    return sw.tensor_parallel(step, "tp", sw.tp.llama_plan(), sequence_parallel=LLAMA_BLOCKS if sp else None)


META: dict[str, tuple[Callable[[sw.Step], sw.Step], sw.Mesh]] = {
    "tp2-sp": (_meta_tp, sw.Mesh(tp=2)),
    "pp2xtp2-zb_h1": (lambda s: sw.pipeline(_meta_tp(s, False), "pp", "zb_h1", 2), sw.Mesh(pp=2, tp=2)),
    "pp2xtp2-zb_h1-sp": (lambda s: sw.pipeline(_meta_tp(s), "pp", "zb_h1", 2), sw.Mesh(pp=2, tp=2)),
    "pp2xtp2-interleaved-sp": (
        lambda s: sw.pipeline(_meta_tp(s), "pp", "interleaved_1f1b", 2, stages=4), sw.Mesh(pp=2, tp=2)
    ),
    "dp2xpp2xtp2-zero3-sp-bf16-remat": (
        lambda s: sw.mixed_precision(sw.shard_params(sw.pipeline(sw.remat(_meta_tp(s)), "pp", "1f1b", 2), "dp", 3),
                                     "compute=bf16"),
        sw.Mesh(dp=2, pp=2, tp=2),
    ),
    "dp2xpp2xtp2-zero3-sp-bf16": (
        lambda s: sw.mixed_precision(sw.shard_params(sw.pipeline(_meta_tp(s), "pp", "1f1b", 2), "dp", 3),
                                     "compute=bf16"),
        sw.Mesh(dp=2, pp=2, tp=2),
    ),
}


@pytest.mark.parametrize("stack", list(META))
def test_on_a_stack_of_identical_blocks_the_reused_layers_give_the_plan_of_the_stages_run_whole(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    transform, mesh = META[stack]
    step, params = meta_llama_step(8)
    step = transform(step)
    ids = torch.zeros((8, 16), dtype=torch.long)
    by_layer = step.plan(mesh, params, (ids, ids))
    with monkeypatch.context() as m:
        m.setattr(tp_spec, "predict", functools.partial(tp_predict.predict, by_layer=False))
        by_stage = step.plan(mesh, params, (ids, ids))
    assert any(a.kind == "inside" for a in by_layer.for_rank(0))
    assert by_layer.actions == by_stage.actions
    assert dict(by_layer.memory) == dict(by_stage.memory)
    assert by_layer.layers == by_stage.layers


@pytest.fixture
def block_forwards(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times a LlamaDecoderLayer's forward really runs (a reused one does not)."""
    count = [0]
    forward = DecoderLayer.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    yield count


@pytest.mark.parametrize("by_layer", [True, False])
def test_layer_by_layer_a_block_runs_a_number_of_times_that_does_not_grow_with_the_blocks(
    by_layer: bool, block_forwards: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tp_spec, "predict", functools.partial(tp_predict.predict, by_layer=by_layer))
    transform, mesh = META["pp2xtp2-zb_h1-sp"]
    ids = torch.zeros((8, 16), dtype=torch.long)
    counts = {}
    for layers in (6, 12):
        step, params = meta_llama_step(layers)
        step = transform(step)
        block_forwards[0] = 0
        step.plan(mesh, params, (ids, ids))
        counts[layers] = block_forwards[0]
    if by_layer:
        assert counts[12] == counts[6], counts
    else:  # the reference runs each stage's blocks (its two stages differ): the counter can tell
        assert counts[12] > counts[6], counts


@pytest.mark.parametrize("stack", ["tp2-sp", "dp2xpp2xtp2-zero3-sp-bf16"])
def test_a_plan_whose_schedule_has_no_weight_pass_predicts_none_and_is_the_plan_that_does(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero-bubble's I and W take a second run of each layer in the prediction (the first run's backward
    frees its graph), and a backward split in two. Without a pipeline, or under 1F1B, nothing reads them:
    the Plan runs none, and it is the Plan made with them."""
    transform, mesh = META[stack]
    step, params = meta_llama_step(6)
    step = transform(step)
    ids = torch.zeros((8, 16), dtype=torch.long)
    split_runs = [0]
    split_backward = tp_predict._split_backward

    def counted(*args: Any, **kwargs: Any) -> Any:
        split_runs[0] += 1
        return split_backward(*args, **kwargs)

    monkeypatch.setattr(tp_predict, "_split_backward", counted)
    plan = step.plan(mesh, params, (ids, ids))
    assert split_runs[0] == 0
    def with_the_split(*args: Any, split_backward: bool | None = None, **kwargs: Any) -> Any:
        assert split_backward is False  # what the Plan asks of a schedule without W
        return tp_predict.predict(*args, split_backward=True, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(tp_spec, "predict", with_the_split)
        with_split = step.plan(mesh, params, (ids, ids))
    assert split_runs[0] > 0
    assert plan.actions == with_split.actions
    assert dict(plan.memory) == dict(with_split.memory)


def test_remat_blocks_say_what_they_compute_and_the_plan_is_the_one_without_reuse(
    block_forwards: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """remat's wrapper has a reuse key: its blocks run a number of times that does not grow with
    them, and the Plan equals the one with every reuse key switched off (every block run)."""
    transform, mesh = META["dp2xpp2xtp2-zero3-sp-bf16-remat"]
    ids = torch.zeros((8, 16), dtype=torch.long)
    counts, plans = {}, {}
    for layers in (6, 12):
        step, params = meta_llama_step(layers)
        step = transform(step)
        block_forwards[0] = 0
        plans[layers] = step.plan(mesh, params, (ids, ids))
        counts[layers] = block_forwards[0]
    assert counts[12] == counts[6], counts
    step, params = meta_llama_step(12)
    step = transform(step)
    with monkeypatch.context() as m:
        m.setattr(reuse, "reuse_key", lambda fn: None)
        m.setattr(reuse, "module_signature", lambda module: None)
        unreused = step.plan(mesh, params, (ids, ids))
    assert plans[12].actions == unreused.actions
    assert dict(plans[12].memory) == dict(unreused.memory)
    assert plans[12].layers == unreused.layers


SHARED = {  # two pairs of layouts that rewrite the blocks alike: ZeRO-1 and ZeRO-3; 1F1B and ZB-H1
    "dp2xtp2-zero1-sp": (lambda s: sw.shard_params(_meta_tp(s), "dp", 1), sw.Mesh(dp=2, tp=2)),
    "dp2xtp2-zero3-sp": (lambda s: sw.shard_params(_meta_tp(s), "dp", 3), sw.Mesh(dp=2, tp=2)),
    "pp2xtp2-1f1b-sp": (lambda s: sw.pipeline(_meta_tp(s), "pp", "1f1b", 2), sw.Mesh(pp=2, tp=2)),
    "pp2xtp2-zb_h1-sp": META["pp2xtp2-zb_h1-sp"],  # after 1f1b: what its blocks keep differs (W's gradients)
}


def test_plans_that_share_their_runs_across_layouts_are_the_plans_made_alone(block_forwards: list[int]) -> None:
    """Inside sharing_runs (what a plan search does), a block rewritten alike under two layouts, on a
    like input, is predicted once for both; each Plan is the one made alone, also for a second batch
    shape and for a layout planned again. Outside the block nothing is shared."""
    step, params = meta_llama_step(2)
    batches = [(ids, ids) for ids in (torch.zeros((8, 16), dtype=torch.long), torch.zeros((4, 16), dtype=torch.long))]
    cases = [(name, 0) for name in SHARED] + [("dp2xtp2-zero3-sp", 1)]

    def plan(name: str, b: int) -> tuple[sw.plan.Plan, int]:
        transform, mesh = SHARED[name]
        block_forwards[0] = 0
        made = transform(step).plan(mesh, params, batches[b])
        return made, block_forwards[0]

    alone = {case: plan(*case) for case in cases}
    with reuse.sharing_runs():
        shared = {case: plan(*case) for case in cases}
        again = plan(*cases[0])
    for case in cases:
        assert shared[case][0].actions == alone[case][0].actions, case
        assert dict(shared[case][0].memory) == dict(alone[case][0].memory), case
    assert again[0].actions == alone[cases[0]][0].actions
    # ZeRO-3 after ZeRO-1 (the same blocks, the same input): its tensor-parallel prediction ran none.
    zero1, zero3 = ("dp2xtp2-zero1-sp", 0), ("dp2xtp2-zero3-sp", 0)
    assert alone[zero3][1] == alone[zero1][1] and shared[zero3][1] < alone[zero3][1], (shared, alone)
    assert again[1] < alone[cases[0]][1]
    assert plan(*cases[0])[1] == alone[cases[0]][1]  # outside the block: all of it again


def _moe_problem() -> tuple[sw.Step, Any, Any]:
    """A tiny Hugging Face GPT-OSS in float64 (its MoE loops over the experts a batch hits: ``nonzero``), its
    embedding and head split over the vocabulary (the attention whole: the per-head plan is test_gpt_oss.py's)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        attn_implementation="eager", experts_implementation="eager", pad_token_id=0, eos_token_id=1, bos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = transformers.GptOssForCausalLM(config).double()
    ids = torch.randint(64, (4, 9), generator=torch.Generator().manual_seed(2))
    batch = (ids[:, :-1], ids[:, 1:])
    chain, params = sw.functionalize(model, units=GptOssDecoderLayer, example_input=batch[0])
    step = sw.train_step(chain, lambda out, y: sw.tp.vocab_parallel_cross_entropy(out.logits, y),
                         sw.optim.sgd(0.1, momentum=0.9))
    plan = {"model.embed_tokens": sw.tp.Rowwise(), "lm_head": sw.tp.Colwise()}
    return sw.tensor_parallel(step, "tp", plan), params, batch


@pytest.mark.parametrize("by_layer", [True, False], ids=["by-layer", "by-stage"])
def test_a_layer_reading_data_to_decide_a_shape_is_predicted_on_real_stand_ins(
    by_layer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An MoE block whose loop reads which experts the batch hits (``nonzero``) cannot run on fake tensors:
    the prediction failed with torch's DynamicOutputShapeException, so no tensor-parallel step of such a model
    had a Plan. It runs that layer again on zero-filled real stand-ins, forward and backward, as the engine's
    own prediction does; the ledger of the step is the Plan's."""
    step, params, batch = _moe_problem()
    mesh = sw.Mesh(tp=2)
    monkeypatch.setattr(tp_spec, "predict", functools.partial(tp_predict.predict, by_layer=by_layer))
    plan = step.plan(mesh, params, batch)

    def run() -> list[tuple[str, str, Any, int]]:
        state = step.init(params, mesh)
        with sw.collectives.comm_ledger() as ledger:
            step(state, batch)
        return [(r.op, r.axis, r.dtype, r.nbytes) for r in ledger.records if r.rank == mesh.rank]

    for rank, got in enumerate(sw.launch(run, mesh.size)):
        assert got == [(c.op, c.axis, c.dtype, c.nbytes) for c in plan.collectives(rank)], f"rank {rank}"


class _RoutedMLP(torch.nn.Module):
    """Up and down projections around a data-dependent choice of tokens (``nonzero``, as an MoE's routing
    reads its batch); ``centred``: q's split features centred over the rank's slice of them (wrong)."""

    def __init__(self, centred: bool) -> None:
        super().__init__()
        self.centred = centred
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        chosen = (x[..., 0] > 0).nonzero()  # the tokens routed on: read off the data
        h = h * (1.0 + chosen.shape[0] / x[..., 0].numel())
        if self.centred:
            h = h - h.mean(-1, keepdim=True)
        return self.down(h)


@pytest.mark.parametrize("region", [True, False], ids=["region", "no-region"])
@pytest.mark.parametrize("centred", [False, True], ids=["per-feature", "centred-over-the-slice"])
def test_a_split_layer_reading_data_to_decide_a_shape_is_predicted_and_still_watched(centred: bool, region: bool
                                                                                      ) -> None:
    """The fake run's data-dependent error was taken for the module's failure (a Region's, named by its head
    counts; or the split output's, no Rowwise taking it). It now runs again on real stand-ins, and the watch of
    its Colwise output, which the fake run left unfinished (the Region's, or the layer's first call's, without
    a Region), is done on that run: an op across the rank's features is still refused."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(_RoutedMLP(centred), _RoutedMLP(centred)).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    plan = {"[01]": sw.tp.Region(), "*.up": sw.tp.Colwise(), "*.down": sw.tp.Rowwise()}
    if not region:
        del plan["[01]"]
    tp = sw.tensor_parallel(step, "tp", plan)
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randn(4, 8, dtype=torch.float64, generator=gen) for _ in range(2)) for _ in range(2)]
    if centred:
        with pytest.raises(ValueError, match=r"Colwise\(\) on '0\.up' .* before any per-head view"):
            tp.plan(sw.Mesh(tp=2), params, batches[0])
        return
    tp.plan(sw.Mesh(tp=2), params, batches[0])
    sw.testing.assert_equivalent(tp, step, sw.Mesh(tp=2), batches, params, rtol=1e-12)
