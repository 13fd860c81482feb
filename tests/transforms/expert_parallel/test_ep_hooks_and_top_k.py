"""What a Hugging Face MoE block's parts do that expert_parallel's reproduction of the block must not lose.

* A hook on the router (``mlp.gate``) or the experts runs in the single-device step (the block calls those
  modules); expert_parallel computes the router's logits and the experts' rows itself, so the hook's effect was
  left out without an error (a pre-hook tripling the router's input: 6.7e-5 relative loss error at ep 2). Refused
  now, naming the module and the hook; a hook on the block itself runs, as on one device.
* Mixtral's router computes the top k with its own ``MixtralTopKRouter.top_k``; the reproduction read the block's
  ``top_k`` beside it, which HF's forward never reads: a router set to top 1 trained top 2 under ep (8.1e-5).

Unmodified transformers Mixtral from a tiny config, random init, float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")


def _mixtral() -> Any:
    torch.manual_seed(0)
    config = T.MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             max_position_embeddings=32, router_jitter_noise=0.0, attn_implementation="eager",
                             experts_implementation="eager", bos_token_id=0, eos_token_id=0)
    model = T.MixtralForCausalLM(config).double()
    with torch.no_grad():  # routers far from uniform: a changed routing shows in the loss
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def _step(model: Any) -> tuple[sw.Step, Any, list[Any]]:
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(32, (4, 8), generator=gen), torch.randint(32, (4, 8), generator=gen)) for _ in range(2)]
    chain, params = sw.functionalize(model, units=type(model.model.layers[0]), example_input=data[0][0])
    loss = lambda out, t: F.cross_entropy(out.logits.reshape(-1, 32), t.reshape(-1))  # noqa: E731
    return sw.train_step(chain, loss, sw.optim.sgd(0.1)), params, data


@pytest.mark.parametrize(("part", "kind"), [("gate", "pre"), ("gate", "forward"), ("experts", "forward")])
def test_a_hook_on_the_router_or_the_experts_is_refused(part: str, kind: str) -> None:
    model = _mixtral()
    for layer in model.model.layers:
        module = layer.mlp.get_submodule(part)
        if kind == "pre":
            module.register_forward_pre_hook(lambda m, args: (args[0] * 3.0,))
        else:
            module.register_forward_hook(lambda m, args, out: out)
    step, _, _ = _step(model)
    refusal = rf"expert_parallel: model\.layers\.0\.mlp\.{part} \(\w+\) has a forward (pre-)?hook, which the single"
    with pytest.raises(ValueError, match=refusal):  # at the transform
        sw.expert_parallel(step, "ep")


def test_a_hook_on_the_block_itself_runs_as_on_one_device() -> None:
    model = _mixtral()
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda m, args, out: out * 0.5)
    step, params, data = _step(model)
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), data, params)


def test_the_routers_own_top_k_is_the_one_routed_with() -> None:
    model = _mixtral()
    for layer in model.model.layers:
        layer.mlp.gate.top_k = 1  # what HF's router reads; the block's top_k (2) stays, unread
    step, params, data = _step(model)
    sw.testing.assert_equivalent(sw.expert_parallel(step, "ep"), step, sw.Mesh(ep=2), data, params)
    aux = sw.router_aux_loss(step, 0.02)
    sw.testing.assert_equivalent(sw.expert_parallel(aux, "ep"), aux, sw.Mesh(ep=2), data, params)
