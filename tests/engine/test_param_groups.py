"""Parameter groups: per-parameter weight decay, learning-rate scale and frozen parameters.

On one device the grouped optimizers must equal torch.optim.AdamW / SGD with the same param
groups bitwise (CPU kernels, the same scalar per element). Sharded steps must equal the
one-device step to 1e-12 in float64 (the distributed gradients are reduced in another order,
which is the only difference; the grouped update itself is elementwise on every layout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.optim.groups import Options, ParamGroups, ParamInfo, Pieces, Runs
from shardwise.testing.models import Block, TinyGPT

F64_RTOL = 1e-12
VOCAB, SEQ = 32, 8

# nanoGPT's configure_optimizers: decay on tensors of 2 or more dims (matmuls, embeddings) only.
NANOGPT = [sw.optim.group(where=lambda name, p: p.dim() < 2, weight_decay=0.0)]
# Hugging Face Trainer's no-decay list: biases and norm weights.
HF_NO_DECAY = [sw.optim.group("*.bias", "*ln*.weight", "*norm*.weight", weight_decay=0.0)]


def _gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(
        vocab=VOCAB, d_model=16, n_heads=2, n_layers=2, seq_len=SEQ, tie_weights=False
    ).double()


def _grads(model: torch.nn.Module, steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        {n: torch.randn(p.shape, dtype=p.dtype, generator=gen) for n, p in model.named_parameters()}
        for _ in range(steps)
    ]


def _torch_groups(model: torch.nn.Module, lr: float) -> list[dict[str, Any]]:
    """HF no-decay, the attention at half the learning rate, the embeddings frozen (left out)."""
    decay, no_decay, half = [], [], []
    for name, p in model.named_parameters():
        if "emb" in name:
            continue
        if ".attn." in name:
            half.append(p)
        elif name.endswith(".bias") or "ln" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": half, "lr": lr * 0.5},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay},
    ]


OUR_GROUPS = [
    sw.optim.group("*emb*", frozen=True),
    sw.optim.group("*.attn.*", lr_scale=0.5),
    sw.optim.group("*.bias", "*ln*", weight_decay=0.0),
]


def _compare_with_torch(
    ours: sw.optim.Optimizer, theirs: Callable[[list], torch.optim.Optimizer]
) -> None:
    model = _gpt()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = {n: t.clone() for n, t in params.items()}
    torch_opt = theirs(_torch_groups(model, 0.05))
    state = ours.init(params)
    for grads in _grads(model, 4):
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        torch_opt.step()
        params, state = ours.update(grads, state, params)
    for n, p in model.named_parameters():
        assert torch.equal(params[n], p.detach()), n
        if "emb" in n:
            assert torch.equal(params[n], start[n]), f"{n} is frozen but changed"
        else:
            assert not torch.equal(params[n], start[n]), n


@pytest.mark.parametrize("inplace", [False, True])
def test_adamw_with_groups_equals_torch_bitwise(inplace: bool) -> None:
    _compare_with_torch(
        sw.optim.adamw(0.05, weight_decay=0.1, groups=OUR_GROUPS, inplace=inplace),
        lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1, foreach=False),
    )


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_with_groups_equals_torch_bitwise(inplace: bool, nesterov: bool) -> None:
    _compare_with_torch(
        sw.optim.sgd(
            0.05,
            momentum=0.9,
            weight_decay=0.1,
            nesterov=nesterov,
            groups=OUR_GROUPS,
            inplace=inplace,
        ),
        lambda groups: torch.optim.SGD(
            groups, lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=nesterov, foreach=False
        ),
    )


def test_runs_inside_one_tensor_equal_whole_tensors() -> None:
    """The ZeRO path: one flat buffer cut into runs gives bitwise the per-tensor update."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, generator=gen, dtype=torch.float32) for n in (5, 7))
    ga, gb = (torch.randn(n, generator=gen, dtype=torch.float32) for n in (5, 7))
    decay, none = Options(0.1), Options(0.0, lr_scale=2.0)
    opt = sw.optim.adamw(
        0.1, weight_decay=0.1, groups=[sw.optim.group("b", weight_decay=0.0, lr_scale=2.0)]
    )
    whole, _ = opt.update({"a": ga, "b": gb}, opt.init({"a": a, "b": b}), {"a": a, "b": b})
    flat = torch.cat([a, b])
    runs = {"x": Runs(((0, 5, decay), (5, 12, none)))}
    cut, _ = opt.update({"x": torch.cat([ga, gb])}, opt.init({"x": flat}), {"x": flat}, runs=runs)
    assert torch.equal(cut["x"], torch.cat([whole["a"], whole["b"]]))


def test_runs_merge_neighbours_and_must_cover_the_leaf() -> None:
    o = Options(0.0)
    assert Runs.merged([(0, 2, o), (2, 5, o), (5, 5, Options(1.0))]).runs == ((0, 5, o),)
    with pytest.raises(ValueError, match="runs must cover every element"):
        Pieces([Runs(((0, 3, o),))], [torch.zeros(4)])


# -- refusals --------------------------------------------------------------------------------


def test_a_group_that_matches_nothing_is_refused() -> None:
    opt = sw.optim.adamw(1e-3, groups=[sw.optim.group("*.bais", weight_decay=0.0)])
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    with pytest.raises(
        ValueError,
        match=r"groups\[0\] group\('\*\.bais', weight_decay=0\.0\): matches no "
        r"parameter.*named 'b', 'w'",
    ):
        opt.update(params, opt.init(params), params)


def test_a_where_predicate_reading_values_is_refused_naming_the_group_and_what_it_may_read() -> None:
    opt = sw.optim.adamw(1e-3, groups=[sw.optim.group(where=lambda n, p: bool(p.abs().max() > 0.05), lr_scale=0.5)])
    params = {"w": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"group\(where=.*lambda.*lr_scale=0.5\): where\('w', p\) read the parameter's "
                       r"values, but p is a meta tensor.*decide by name, shape or dtype"):
        opt.update(params, opt.init(params), params)


def test_step_init_refuses_an_unmatched_group_and_a_shadowed_one() -> None:
    chain, params = sw.functionalize(_gpt(), units=Block)
    step = sw.train_step(
        chain, _lm_loss, sw.optim.sgd(0.1, groups=[sw.optim.group("*.Bias", weight_decay=0.0)])
    )
    with pytest.raises(
        ValueError, match=r"groups\[0\].*'\*\.Bias'.*matches no parameter.*case-sensitive"
    ):
        step.init(params)
    shadowed = [
        sw.optim.group("*.bias", weight_decay=0.0),
        sw.optim.group("*ln1.bias", lr_scale=2.0),
    ]
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(0.1, groups=shadowed))
    with pytest.raises(ValueError, match=r"groups\[1\].*an earlier group has not taken"):
        step.init(params)


def test_a_group_naming_a_tied_weight_by_its_other_name_is_refused_naming_the_tie() -> None:
    """The finetune review: group("lm_head.*", frozen=True) on tied GPT-2 matched nothing (torch's
    named_parameters() names the tied tensor transformer.wte.weight alone), and the refusal did not say why."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1,
                                                                 n_head=2))
    chain, params = sw.functionalize(model, example_input=torch.zeros(1, 4, dtype=torch.long))
    frozen = sw.optim.sgd(0.1, groups=[sw.optim.group("lm_head.*", frozen=True)])
    step = sw.train_step(chain, lambda out, y: out.logits.mean(), frozen)
    with pytest.raises(ValueError, match=r"'lm_head.weight' is 'transformer.wte.weight' \(tied\): name it by that"):
        step.init(params)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "selects nothing"),
        ({"patterns": ("*",), "weight_decay": -1.0}, "weight_decay must be finite and >= 0"),
        ({"patterns": ("*",), "lr_scale": float("inf")}, "lr_scale must be finite"),
        ({"patterns": ("*",), "frozen": True, "weight_decay": 0.0}, "would be ignored"),
    ],
)
def test_bad_groups_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sw.optim.Group(**kwargs)


def test_clipping_with_frozen_parameters_is_refused() -> None:
    chain, params = sw.functionalize(_gpt(), units=Block)
    opt = sw.optim.sgd(0.1, groups=[sw.optim.group("*emb*", frozen=True)])
    with pytest.raises(ValueError, match=r"clip_norm=1.0.*frozen.*torch's clip_grad_norm_ skips"):
        sw.train_step(chain, _lm_loss, opt, clip_norm=1.0).init(params)


def test_summary_counts_frozen_parameters() -> None:
    groups = ParamGroups.of([sw.optim.group("e*", frozen=True)], 0.1)
    assert groups is not None
    infos = {
        k: ParamInfo((k,), s, torch.float32)
        for k, s in {"emb": (4, 3), "w": (3, 3), "b": (3,)}.items()
    }
    assert groups.summary(infos) == [("group('e*', frozen=True)", 1, 12), ("defaults", 2, 12)]


def test_ranks_with_other_groups_are_refused() -> None:
    chain, params = sw.functionalize(_gpt(), units=Block)

    def build() -> None:
        mesh = sw.Mesh(dp=2)
        wd = 0.0 if mesh.axis_index("dp") == 0 else 0.01
        opt = sw.optim.adamw(1e-3, groups=[sw.optim.group("*.bias", weight_decay=wd)])
        sw.shard_params(sw.train_step(chain, _lm_loss, opt), "dp", 1).init(params, mesh)

    with pytest.raises(sw.collectives.RankFailed, match=r"rank 1 differs from rank 0 in its optimizer"):
        sw.launch(build, 2)


# -- sharded steps equal the one-device step -------------------------------------------------


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Works on whole logits and, inside a tensor-parallel step, on vocabulary-split ones.
    return sw.tp.vocab_parallel_cross_entropy(logits, targets)


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(VOCAB, (4, SEQ), generator=gen),
            torch.randint(VOCAB, (4, SEQ), generator=gen),
        )
        for _ in range(n)
    ]


# eps=1e-6, not torch's 1e-8: a key bias's true gradient is zero (softmax ignores a shift of
# every score of a query), so its gradient is rounding noise, which Adam's normalisation with
# eps=1e-8 magnifies to ~1e-12 relative (8.7e-13 here without any groups); 1e-6 keeps the
# update's sensitivity at the gradients' (worst seen 8e-15), so 1e-12 still holds.
OPTIMIZERS = {
    "adamw": lambda groups: sw.optim.adamw(1e-2, eps=1e-6, weight_decay=0.5, groups=groups),
    "sgd": lambda groups: sw.optim.sgd(0.2, momentum=0.9, weight_decay=0.5, groups=groups),
}
RULES = {
    "nanogpt": NANOGPT,
    "hf": HF_NO_DECAY,
    "frozen": [*HF_NO_DECAY, sw.optim.group("*emb*", frozen=True)],
}


def _problem(opt: str, rule: str, rules: dict[str, list] = RULES) -> tuple[sw.Step, dict]:
    chain, params = sw.functionalize(_gpt(), units=Block)
    # GPT-2's init makes biases zero, where decay does nothing: move every tensor off its init.
    gen = torch.Generator().manual_seed(3)
    params = {
        k: {n: t + 0.1 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in v.items()}
        for k, v in params.items()
    }
    return sw.train_step(chain, _lm_loss, OPTIMIZERS[opt](rules[rule])), params


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_dp2_equals_one_device(opt: str, rule: str, stage: int) -> None:
    """Each unit (a Block) is one flat shard holding weights and biases of both groups."""
    step, params = _problem(opt, rule)
    sharded = sw.shard_params(step, "dp", stage)
    sw.testing.assert_equivalent(sharded, step, sw.Mesh(dp=2), _batches(), params, rtol=F64_RTOL)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("rule", ["nanogpt", "frozen"])
def test_pipeline_and_zero_equal_one_device(opt: str, rule: str) -> None:
    """Two stages: the groups are resolved over every stage's parameters, so a pattern matching
    only the other stage's (the embeddings on stage 0) is not refused on stage 1."""
    step, params = _problem(opt, rule)
    piped = sw.shard_params(sw.pipeline(step, "pp", "1f1b", 2), "dp", 3)
    sw.testing.assert_equivalent(
        piped, step, sw.Mesh(dp=2, pp=2), _batches(), params, rtol=F64_RTOL
    )


# The fused qkv projection by its global first dim (48 = 3 x 16); tensor parallel cuts it to 24.
RULES_TP = {
    **RULES,
    "global_shape": [sw.optim.group(where=lambda name, p: p.shape[0] == 48, lr_scale=0.5)],
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("rule", sorted(RULES_TP))
def test_tensor_parallel_tp2_equals_one_device(opt: str, rule: str) -> None:
    """The predicate sees each parameter's global shape, not its slice."""
    step, params = _problem(opt, rule, RULES_TP)
    split = sw.tensor_parallel(step, "tp", sw.tp.tiny_gpt_plan(vocab_parallel=True))
    sw.testing.assert_equivalent(split, step, sw.Mesh(tp=2), _batches(), params, rtol=F64_RTOL)


def test_the_groups_change_the_update() -> None:
    """The equivalence tests are not vacuous: the rule changes the step (and only where it says)."""
    step, params = _problem("adamw", "hf")
    plain = sw.train_step(step.chain, _lm_loss, sw.optim.adamw(1e-2, eps=1e-6, weight_decay=0.5))
    batch = _batches(1)[0]
    grouped, _ = step(step.init(params), batch)
    ungrouped, _ = plain(plain.init(params), batch)
    bias = ("blocks.0", "blocks.0.ln1.bias")
    assert not torch.equal(grouped.params[bias[0]][bias[1]], ungrouped.params[bias[0]][bias[1]])
    weight = ("blocks.0", "blocks.0.attn.qkv.weight")
    assert torch.equal(grouped.params[weight[0]][weight[1]], ungrouped.params[weight[0]][weight[1]])


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters_stay_bitwise_under_zero(stage: int) -> None:
    step, params = _problem("adamw", "frozen")
    sharded = sw.shard_params(step, "dp", stage)

    def run() -> dict:
        state = sharded.init(params, sw.Mesh(dp=2))
        for batch in _batches():
            state, _ = sharded(state, batch)
        return sharded.full_params(state)

    for full in sw.launch(run, 2):
        for name in ("tok_emb.weight", "pos_emb"):
            assert torch.equal(full["blocks.0"][name], params["blocks.0"][name]), name
        assert not torch.equal(
            full["blocks.0"]["blocks.0.ln1.weight"], params["blocks.0"]["blocks.0.ln1.weight"]
        )


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_plan_of_a_zero_step_with_groups_resolves_them_by_parameter_name(rule: str, stage: int) -> None:
    """The Plan ran the grouped update on the flat shards named by their unit ('blocks.0'), so every
    pattern of a parameter name was refused there as matching nothing, where the step runs (the
    step passes the groups' runs); it now passes the same runs, and plans as the ungrouped step."""
    step, params = _problem("adamw", rule)
    plain = sw.train_step(step.chain, _lm_loss, sw.optim.adamw(1e-2, eps=1e-6, weight_decay=0.5))
    batch, mesh = _batches(1)[0], sw.Mesh(dp=2)
    grouped = sw.shard_params(step, "dp", stage).plan(mesh, params, batch)
    ungrouped = sw.shard_params(plain, "dp", stage).plan(mesh, params, batch)
    assert list(grouped.collectives(0)) == list(ungrouped.collectives(0))
    assert grouped.memory["update_buffers"][0] > 0
    assert grouped.memory["opt_state"] == ungrouped.memory["opt_state"]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_plan_of_a_pipeline_with_groups_resolves_them_over_the_whole_model(rule: str) -> None:
    """A pipeline rank holds some layers: the Plan resolved the groups over that rank's parameters alone, and
    refused a group naming only another stage's ("matches no parameter"), where the step runs (and a search
    dropped every pipeline layout so)."""
    step, params = _problem("adamw", rule)
    plain = sw.train_step(step.chain, _lm_loss, sw.optim.adamw(1e-2, eps=1e-6, weight_decay=0.5))
    batch, mesh = _batches(1)[0], sw.Mesh(pp=2)
    grouped = sw.pipeline(step, "pp", "1f1b", microbatches=2).plan(mesh, params, batch)
    ungrouped = sw.pipeline(plain, "pp", "1f1b", microbatches=2).plan(mesh, params, batch)
    assert [list(grouped.for_rank(r)) for r in range(2)] == [list(ungrouped.for_rank(r)) for r in range(2)]
    assert min(grouped.memory["update_buffers"]) > 0
    assert grouped.memory["opt_state"] == ungrouped.memory["opt_state"]
