"""expert_parallel on PhiMoE: ``PhimoeSparseMoeBlock``'s router (``sparsemixer``) called as it is.

In training sparsemixer samples each token's experts (Gumbel draws among the candidates within
``router_jitter_noise`` of the best) and draws again for its gradient estimate; each rank would draw for
its own tokens, not as one device does, so that is refused, naming the setting (``phimoe.py``). Two ways
train exactly as one device: ``router_jitter_noise=0`` in training (the best experts the only candidates:
the draws change nothing; weights 1, no router gradient), and the model in eval mode (no draws: the best
two, each weighted by its softmax over the candidates within the margin; with a margin wide enough, here
``router_jitter_noise=0.5``, that softmax weighs several and the router learns through it).

float64 on thread ranks; the distributed block sums a token's two expert outputs in another order than
HF's loop over experts: equal to float64 rounding (assert_equivalent's default).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.collectives.errors import RankFailed

transformers = pytest.importorskip("transformers")

from transformers.models.phimoe import modeling_phimoe  # noqa: E402

from ._hf_family import (  # noqa: E402
    VOCAB,
    all_to_alls_of_a_plan_run,
    assert_equal_under_both_stacks,
    assert_router_aux_loss_is_hfs,
    token_batches,
)
from ._hf_family import changed as _changed  # noqa: E402
from ._hf_family import lm_loss as _loss  # noqa: E402
from ._hf_family import under_ep as _ep  # noqa: E402

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _model(mode: str, config: dict[str, float] | None = None) -> tuple[Any, sw.Step, Any, Batches]:
    """``mode``: "eval" (sparsemixer draws nothing) or "train" (it draws; give router_jitter_noise=0)."""
    torch.manual_seed(0)
    cfg = transformers.PhimoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        attn_implementation="eager", experts_implementation="eager", bos_token_id=0, eos_token_id=0,
        pad_token_id=1, **(config or {}),
    )
    model = transformers.PhimoeForCausalLM(cfg).double()
    model.train(mode == "train")
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():  # HF's init (std 0.02) routes near uniformly: make the choice matter
        if isinstance(module, modeling_phimoe.PhimoeTopKRouter):
            module.weight.data.normal_(0.0, 1.0, generator=gen)
    data = token_batches(gen)
    chain, params = sw.functionalize(model, units=modeling_phimoe.PhimoeDecoderLayer, example_input=data[0][0])
    return model, sw.train_step(chain, _loss, sw.optim.sgd(0.1, momentum=0.9)), params, data


MODES: dict[str, tuple[str, dict[str, float]]] = {
    "eval": ("eval", {"router_jitter_noise": 0.5}), "train without jitter": ("train", {"router_jitter_noise": 0.0})}


def _router_grads(step: sw.Step, params: Any, batch: Any) -> list[torch.Tensor]:
    state = step.init(params)
    new, _ = step(state, batch)
    return [new.params[layer][name] - state.params[layer][name] for layer in state.params
            for name in state.params[layer] if name.endswith("router.weight")]


@pytest.mark.parametrize("stack", ["ep", "dp x ep zero3"])
@pytest.mark.parametrize("mode", ["eval", "train without jitter"])
def test_phimoe_under_ep_equals_the_single_device_step(mode: str, stack: str) -> None:
    _, step, params, data = _model(*MODES[mode])
    ep, mesh = _ep(step, stack)
    split = sorted(name for (_layer, name) in ep.split.tensor_splits(ep.chain, mesh))
    assert split == [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj", "gate_up_proj")]
    sw.testing.assert_equivalent(ep, step, mesh, data, params)


def test_the_two_modes_train_the_router_as_said() -> None:
    """In eval mode with a wide margin the router learns through its masked softmax; in training without jitter
    its weights are 1 and its gradient zero (HF's sparsemixer, one device): the docstrings' claims, measured."""
    _, step, params, data = _model(*MODES["eval"])
    assert all(float(d.abs().max()) > 0.0 for d in _router_grads(step, params, data[0]))
    _, step, params, data = _model(*MODES["train without jitter"])
    assert all(float(d.abs().max()) == 0.0 for d in _router_grads(step, params, data[0]))


def test_the_routers_draws_in_training_are_refused_naming_the_setting() -> None:
    _, step, _, _ = _model("train")  # HF's default router_jitter_noise=0.01
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.01: in training its router \(sparsemixer\) samples"
                                         r".*Set config.router_jitter_noise = 0.*or train the model in eval mode"):
        sw.expert_parallel(step, "ep")
    _, step, _, _ = _model("train", {"router_jitter_noise": 0.0, "input_jitter_noise": 0.1})
    with pytest.raises(ValueError, match=r"input_jitter_noise=0.1: in training its block scales each token.*set "
                                         r"config.input_jitter_noise = 0"):
        sw.expert_parallel(step, "ep")


def test_the_refusal_is_not_vacuous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let through, HF's default jitter in training trains another model than one device (the loss 1e-5
    relative apart at the first step): each rank drew its own samples for its tokens."""
    from shardwise.transforms.expert_parallel import phimoe

    monkeypatch.setattr(phimoe, "refuse_draws", lambda *args: None)
    _, step, params, data = _model("train")
    with pytest.raises(AssertionError, match="first divergence at step 1"):
        sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), data, params)


def test_an_exact_tie_is_refused_in_training() -> None:
    """With router_jitter_noise=0 a tie among a token's best logits is still sampled: a zero router ties all
    (each rank's 12 tokens)."""
    _, step, params, data = _model(*MODES["train without jitter"])
    zero = {layer: {n: torch.zeros_like(t) if n.endswith("router.weight") else t for n, t in tensors.items()}
            for layer, tensors in params.items()}
    ep = sw.expert_parallel(step, "ep")
    with pytest.raises(RankFailed, match=r"12 token\(s\) whose best experts' logits are exactly equal.*eval mode"):
        sw.testing.assert_equivalent(ep, step, sw.Mesh(ep=2), data[:1], zero)


def test_on_one_device_router_aux_loss_is_hf_phimoes_and_under_ep_it_equals_the_single_device_step() -> None:
    """HF PhiMoE's aux loss is of its router's logits (the softmax over all experts, the top k counted:
    Mixtral's ``load_balancing_loss_func``, summed in float32), whatever sparsemixer drew: one device in
    training with HF's jitter adds it; under ep, in eval mode, the step equals one device's."""
    model, step, params, data = _model("train")
    coef = 0.5
    assert_router_aux_loss_is_hfs(model, step, params, data[0], coef)
    _, step, params, data = _model(*MODES["eval"])
    assert_equal_under_both_stacks(sw.router_aux_loss(step, coef), params, data)


def test_router_aux_loss_refuses_input_jitter() -> None:
    _, step, params, data = _model("train", {"input_jitter_noise": 0.1})
    with_aux = sw.router_aux_loss(step, 0.02)
    with pytest.raises(ValueError, match=r"input_jitter_noise=0.1.*set config.input_jitter_noise = 0"):
        with_aux(with_aux.init(params), data[0])


@pytest.mark.parametrize("mode", list(MODES))
def test_every_rank_issues_exactly_the_collectives_its_plan_lists(mode: str) -> None:
    """In training the Plan's prediction on fake tensors runs sparsemixer's draws and its autograd Function."""
    _, step, params, data = _model(*MODES[mode])
    assert all_to_alls_of_a_plan_run(step, params, data[0]) == 2 * 2 * 2


@pytest.mark.parametrize("part", ["PhimoeSparseMoeBlock", "PhimoeExperts", "PhimoeTopKRouter", "sparsemixer"])
def test_a_block_experts_router_or_sparsemixer_whose_code_changed_is_refused(
        part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if part == "sparsemixer":
        original = modeling_phimoe.sparsemixer

        def sparsemixer(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        monkeypatch.setattr(modeling_phimoe, "sparsemixer", sparsemixer)
        what = r"transformers\.models\.phimoe\.modeling_phimoe\.sparsemixer, which is"
    else:
        cls = getattr(modeling_phimoe, part)
        monkeypatch.setattr(cls, "forward", _changed(cls.forward))
        what = f"a {part} whose forward is"
    _, step, _, _ = _model(*MODES["eval"])
    with pytest.raises(ValueError, match=rf"expert_parallel: .* is {what} not the code expert_parallel reproduces"):
        sw.expert_parallel(step, "ep")


def test_a_router_of_another_class_is_refused() -> None:
    """expert_parallel knows the draws of PhiMoE's own router only (it refuses those it cannot make as one
    device does): another router class could draw otherwise."""

    class QuietRouter(modeling_phimoe.PhimoeTopKRouter):
        pass

    model, _, _, data = _model(*MODES["eval"])
    block = model.model.layers[0].mlp
    swapped = QuietRouter(model.config).double()
    swapped.load_state_dict(block.router.state_dict())
    block.router = swapped
    chain, _ = sw.functionalize(model, units=modeling_phimoe.PhimoeDecoderLayer, example_input=data[0][0])
    step = sw.train_step(chain, _loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.router is a QuietRouter .*not PhiMoE's "
                                         r"PhimoeTopKRouter, whose draws in training expert_parallel knows"):
        sw.expert_parallel(step, "ep")
