"""A model's own init code on a meta build: nanoGPT (its model.py, as written) built on the meta device
and made by ZeRO-3 starts from the init its eager constructor gives, with the recipe the docs give.

The values cannot equal the eager model's bitwise: eager draws every tensor from one stream in
construction order, a meta build seeds each tensor from (seed, its path) so that a rank makes only
its own. So each tensor is compared by its statistics: exactly where the eager tensor is a constant
(LayerNorm's ones, the zero biases), else its mean and standard deviation within sampling error
(the smallest drawn tensor has 1024 elements: its std is known to about 2%; 15% is 5 sigma, while
the bug this guards, an unscaled c_proj, was off by 180%).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.engine.model.functionalize import FunctionalizeError


# -- nanoGPT's model.py (karpathy/nanoGPT), as written; only what init and training need ------------
class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(self.n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 4
    n_head: int = 2
    n_embd: int = 32
    bias: bool = True


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
# ----------------------------------------------------------------------------------------------------


CONFIG = GPTConfig()


def nanogpt_init(model: GPT) -> Callable[[nn.Module, str], None]:
    """The docs' recipe: GPT.__init__ per module, as a meta build replays it."""
    def init_fn(module: nn.Module, path: str) -> None:
        model._init_weights(module)                    # self.apply(self._init_weights)
        if isinstance(module, LayerNorm):              # its constructor's ones and zeros
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        if path.endswith("c_proj"):                    # the loop after apply()
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * model.config.n_layer))
    return init_fn


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def made_by_zero3(model: nn.Module, init_fn: Any, seed: int = 0) -> dict[str, Tensor]:
    """The parameters ZeRO-3 on two ranks makes for the meta-built ``model``, by their path in it; and
    checked equal, bitwise, to what one device makes."""
    chain, params = sw.functionalize(model, init_fn=init_fn)
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    zero3 = sw.shard_params(step, "dp", stage=3)
    full = sw.launch(lambda: zero3.full_params(zero3.init(params, sw.Mesh(dp=2), seed=seed)), world=2)[0]
    one = step.init(params, seed=seed).params
    assert all(torch.equal(full[k][n], one[k][n]) for k in one for n in one[k])
    return {name: t for layer in full.values() for name, t in layer.items()}


def assert_same_init_statistics(made: dict[str, Tensor], eager: nn.Module) -> None:
    reference = dict(eager.named_parameters())
    assert made.keys() <= reference.keys() and len(made) == len(reference), (sorted(made), sorted(reference))
    for name, value in made.items():
        want = reference[name].detach()
        if float(want.std()) == 0:
            assert torch.equal(value, want), name
            continue
        assert abs(float(value.std()) / float(want.std()) - 1) < 0.15, (name, float(value.std()), float(want.std()))
        assert abs(float(value.mean() - want.mean())) < 5 * float(want.std()) / math.sqrt(want.numel()), name
        assert not torch.equal(value, want), name  # drawn (from its own seed), not copied


def test_nanogpt_built_on_the_meta_device_starts_from_its_eager_init_with_the_recipe() -> None:
    torch.manual_seed(0)
    eager = GPT(CONFIG).double()
    with torch.device("meta"):
        meta = GPT(CONFIG).double()
    made = made_by_zero3(meta, nanogpt_init(meta))
    assert_same_init_statistics(made, eager)
    scaled = 0.02 / math.sqrt(2 * CONFIG.n_layer)
    assert abs(float(made["transformer.h.0.attn.c_proj.weight"].std()) / scaled - 1) < 0.15


def test_nanogpt_init_weights_alone_is_refused_naming_its_layernorm() -> None:
    """The init_fn materialize's docstring once gave: nanoGPT's LayerNorm sets its ones in __init__,
    which a meta build never runs, and it has no reset_parameters()."""
    with torch.device("meta"):
        meta = GPT(CONFIG)
    chain, params = sw.functionalize(meta, init_fn=meta._init_weights)
    with pytest.raises(FunctionalizeError) as refused:
        sw.train_step(chain, lm_loss, sw.optim.sgd(0.1)).init(params)
    message = str(refused.value)
    assert "'transformer.h.0.ln_1.weight' (LayerNorm, init_fn) left some of its elements unset" in message
    assert "LayerNorm has no reset_parameters()" in message and "isinstance(module, LayerNorm)" in message


def with_torch_layer_norms(model: GPT) -> GPT:
    """nanoGPT with torch's nn.LayerNorm (minGPT's choice), made on the current device."""
    for block in [*model.transformer.h, model.transformer]:
        for name, child in list(block.named_children()):
            if isinstance(child, LayerNorm):
                setattr(block, name, nn.LayerNorm(model.config.n_embd))
    return model


def test_a_torch_layer_norm_left_to_its_constructor_is_made_by_its_reset_parameters() -> None:
    """nanoGPT's _init_weights leaves LayerNorms to their constructor; torch's runs reset_parameters()
    there, so a meta build runs it too (before the init_fn, as eager does) instead of refusing."""
    torch.manual_seed(0)
    eager = with_torch_layer_norms(GPT(CONFIG)).double()
    with torch.device("meta"):
        meta = with_torch_layer_norms(GPT(CONFIG)).double()

    def init_fn(module: nn.Module, path: str) -> None:
        meta._init_weights(module)
        if path.endswith("c_proj"):
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * CONFIG.n_layer))

    assert_same_init_statistics(made_by_zero3(meta, init_fn), eager)


def test_a_model_with_its_own_init_method_and_no_init_fn_is_refused_at_init_not_at_loading() -> None:
    """Without init_fn, torch's reset_parameters() would make every Linear and Embedding (kaiming,
    N(0, 1)) where nanoGPT's _init_weights draws N(0, 0.02): another model, without a word."""
    torch.manual_seed(0)
    eager = with_torch_layer_norms(GPT(CONFIG))
    with torch.device("meta"):
        meta = with_torch_layer_norms(GPT(CONFIG))
    chain, params = sw.functionalize(meta)  # nothing is made yet: weights may still be loaded
    step = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1))
    with pytest.raises(FunctionalizeError, match=r"^init: GPT .*defines its own initialization \(GPT\._init_weights\)"
                                                 r".*init_fn=model\._init_weights.*init_fn=lambda module: None"):
        step.init(params)
    loaded = sw.checkpoint.init_from_state_dict(step, eager.state_dict())
    assert torch.equal(step.full_params(loaded)["model"]["transformer.wte.weight"], eager.lm_head.weight.detach())
    # torch's defaults, asked for knowingly: every layer's reset_parameters()
    chain, params = sw.functionalize(meta, init_fn=lambda module: None)
    made = sw.train_step(chain, lm_loss, sw.optim.sgd(0.1)).init(params, seed=0).params["model"]
    assert torch.equal(made["transformer.h.0.ln_1.weight"], torch.ones(CONFIG.n_embd))
    assert float(made["transformer.wpe.weight"].std()) > 0.5  # nn.Embedding's N(0, 1)


def test_init_fn_is_called_with_the_path_only_when_it_takes_two_arguments() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 2)))
    seen: list[tuple[str, str]] = []

    def with_path(module: nn.Module, path: str) -> None:
        seen.append((type(module).__name__, path))
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 2.0 if path == "1.0" else 1.0)
            nn.init.zeros_(module.bias)

    chain, params = sw.functionalize(model, init_fn=with_path)
    made = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)).init(params).params
    assert torch.equal(made["1"]["0.weight"], torch.full((2, 4), 2.0))
    assert torch.equal(made["0"]["weight"], torch.ones(4, 3))
    assert ("Linear", "1.0") in seen and ("Sequential", "1") in seen and ("Sequential", "") in seen

    def with_a_default(module: nn.Module, std: float = 0.5) -> None:  # the original form: no path given
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, std)
            nn.init.zeros_(module.bias)

    chain, params = sw.functionalize(model, init_fn=with_a_default)
    made = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)).init(params).params
    assert torch.equal(made["0"]["weight"], torch.full((4, 3), 0.5))
    with pytest.raises(TypeError, match=r"init_fn=.*needs 3 positional arguments.*fn\(module, path\)"):
        sw.functionalize(model, init_fn=lambda module, path, std: None)
