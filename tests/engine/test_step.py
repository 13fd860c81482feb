"""The single-device Step computes exactly what eager torch computes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import shardwise as sw
from shardwise.engine.layout.state import tree_nbytes
from shardwise.testing.models import TinyGPT, mlp


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _eager_steps(model, loss_fn, opt, batches, clip=None):  # type: ignore[no-untyped-def]
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.detach())
    return losses


@given(widths=st.lists(st.integers(1, 8), min_size=2, max_size=5), clip=st.sampled_from([None, 0.3, 100.0]),
       seed=st.integers(0, 1000))
# Found on another machine: the clip norm summed per-tensor norms bias first (optree's sorted keys).
@example(widths=[4, 4], clip=0.3, seed=1)
def test_mlp_steps_match_eager_torch_bitwise(widths: list[int], clip: float | None, seed: int) -> None:
    torch.manual_seed(seed)
    model = mlp(widths, "tanh")
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=clip)
    batches = [(torch.randn(6, widths[0]), torch.randn(6, widths[-1])) for _ in range(3)]
    state = step.init(params)
    ours = []
    for b in batches:
        state, metrics = step(state, b)
        ours.append(metrics["loss"])
    eager = _eager_steps(
        model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), 0.1, 0.9), batches, clip
    )
    assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True))
    for name, p in model.named_parameters():
        layer, local = name.split(".", 1)
        assert torch.equal(state.params[layer][local], p.detach()), name


def test_tied_gpt_matches_eager_torch_bitwise() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=40, d_model=16, n_heads=2, n_layers=2, seq_len=8)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _lm_loss, sw.optim.adamw(1e-2))
    batches = [(torch.randint(40, (3, 8)), torch.randint(40, (3, 8))) for _ in range(3)]
    state = step.init(params)
    for b in batches:
        state, metrics = step(state, b)
    eager = _eager_steps(model, _lm_loss, torch.optim.AdamW(model.parameters(), 1e-2), batches)
    assert torch.equal(metrics["loss"], eager[-1])
    assert torch.equal(state.params["tok_emb"]["tok_emb.weight"], model.tok_emb.weight.detach())
    assert torch.equal(state.params["blocks.1"]["blocks.1.attn.qkv.weight"], model.blocks[1].attn.qkv.weight.detach())


def test_grad_norm_metric_is_the_norm_before_clipping() -> None:
    torch.manual_seed(0)
    model = mlp([3, 4, 2])
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1), clip_norm=1e-3)
    batch = (torch.randn(5, 3), torch.randn(5, 2))
    _, metrics = step(step.init(params), batch)
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert torch.equal(metrics["grad_norm"], expected)


@pytest.mark.parametrize("clip", [1e-3, 1e3], ids=["clips", "within"])
def test_a_norm_within_the_clip_leaves_the_gradients_unscaled_and_matches_torch_bitwise(
        clip: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clipping multiplies the gradients only where the factor is below 1: a multiply by exactly 1.0
    changes no bit, so its pass over every gradient is skipped (the factor is read on the host)."""
    import shardwise.engine.step.step as step_module

    calls = []
    scale = step_module.fe.mul_tensor
    monkeypatch.setattr(step_module.fe, "mul_tensor", lambda *a, **k: calls.append(a[1]) or scale(*a, **k))
    torch.manual_seed(0)
    model = mlp([3, 4, 2])
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=clip)
    batches = [(torch.randn(5, 3), torch.randn(5, 2)) for _ in range(3)]
    state = step.init(params)
    norms = []
    for b in batches:
        state, metrics = step(state, b)
        norms.append(float(metrics["grad_norm"]))
    eager = _eager_steps(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), 0.1, 0.9), batches,
                         clip)
    assert torch.equal(metrics["loss"], eager[-1])
    for name, p in model.named_parameters():
        layer, local = name.split(".", 1)
        assert torch.equal(state.params[layer][local], p.detach()), name
    if clip < min(norms):
        assert len(calls) == 3 and all(float(f) < 1 for f in calls), calls
    else:
        assert clip > max(norms) and calls == [], (norms, calls)


def test_plan_lists_forward_backward_update_and_prints() -> None:
    chain, params = sw.functionalize(mlp([3, 4, 2]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-3))
    plan = step.plan(sw.Mesh(dp=2), params)
    expected = ["F(0)", "F(1)", "F(2)", "loss", "B(2)", "B(1)", "B(0)", "finish_grads", "update"]
    assert [str(a) for a in plan.for_rank(1)] == expected
    text = str(plan)
    assert "ranks 0, 1: 9 actions" in text and " ".join(expected) in text
    assert plan.memory["params"] == (tree_nbytes(params),) * 2
    assert plan.memory["opt_state"][0] == tree_nbytes(step.optimizer.init(params))


def test_bad_inputs_are_refused_with_the_fix() -> None:
    chain, params = sw.functionalize(mlp([3, 4, 2]))
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"\(chain, params\) tuple"):
        sw.train_step((chain, params), torch.nn.functional.mse_loss, sw.optim.sgd(0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"params\['0'\] does not match the chain: missing \['weight'\]"):
        step.init({**params, "0": {"bias": params["0"]["bias"]}})
    with pytest.raises(ValueError, match="a batch must be a pair"):
        step(step.init(params), torch.randn(4, 3))
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        bad = sw.train_step(chain, lambda o, t: (o - t) ** 2, sw.optim.sgd(0.1))
        bad(bad.init(params), (torch.randn(4, 3), torch.randn(4, 2)))
    with pytest.raises(ValueError, match="clip_norm"):
        sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1), clip_norm=0.0)


@pytest.mark.parametrize(("made", "words"), [
    (torch.optim.AdamW, ["got torch.optim.AdamW", "use shardwise.optim.adamw(lr, betas, eps, weight_decay)",
                         "shardwise.optim.group("]),
    (lambda: torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
     ["got torch.optim.SGD (an instance)", "use shardwise.optim.sgd(lr, momentum)"]),
    (torch.optim.Adagrad, ["got torch.optim.Adagrad", "shardwise.optim has adamw and sgd", "'Your own optimizer'"]),
])
def test_a_torch_optimizer_is_refused_naming_its_functional_twin(made: Any, words: list[str]) -> None:
    """nanoGPT's configure_optimizers hands torch.optim.AdamW with param groups: the error says which
    shardwise optimizer computes the same update, and how its groups are written."""
    chain, _ = sw.functionalize(torch.nn.Linear(2, 2))
    optimizer = made if isinstance(made, type) else made()
    with pytest.raises(TypeError) as caught:
        sw.train_step(chain, torch.nn.functional.mse_loss, optimizer)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
