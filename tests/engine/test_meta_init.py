"""Models built on the meta device: functionalize describes them, Step.init makes each rank's part.

Each parameter is made from the module's own initializer seeded by (seed, its path), so a
sharded init equals the one-device init bitwise, whatever the stack; then the steps train alike.
Models: unmodified Hugging Face Llama and GPT-2 (tiny configs, random init) split per block,
an nn.Sequential, and TinyGPT with a user init_fn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import shardwise as sw
from shardwise.engine.model.functionalize import FunctionalizeError
from shardwise.testing.models import Block, CausalSelfAttention, TinyGPT, mlp

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 8, 4


def tokens(n: int = 2, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(VOCAB, (BATCH, SEQ), generator=gen), torch.randint(VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(n)]


def hf_loss(out: Any, targets: Tensor) -> Tensor:
    return sw.tp.vocab_parallel_cross_entropy(out.logits, targets)


def logits_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return sw.tp.vocab_parallel_cross_entropy(logits, targets)


def llama() -> tuple[nn.Module, Any, dict[str, Any]]:
    cfg = T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    return T.LlamaForCausalLM(cfg), T.models.llama.modeling_llama.LlamaDecoderLayer, sw.tp.llama_plan()


def gpt2() -> tuple[nn.Module, Any, dict[str, Any]]:
    cfg = T.GPT2Config(
        vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=HIDDEN, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    return T.GPT2LMHeadModel(cfg), T.models.gpt2.modeling_gpt2.GPT2Block, sw.tp.gpt2_plan()


def init_tiny_gpt(module: nn.Module) -> None:
    """What TinyGPT's own __init__ does, per module (its causal mask buffer included)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()
    if isinstance(module, TinyGPT):
        nn.init.normal_(module.pos_emb, std=0.02)
    if isinstance(module, CausalSelfAttention):
        module.mask.copy_(torch.tril(torch.ones_like(module.mask, dtype=torch.bool)))


def tiny_gpt() -> tuple[nn.Module, Any, dict[str, Any]]:
    return TinyGPT(vocab=VOCAB, d_model=HIDDEN, n_heads=4, n_layers=2, seq_len=SEQ), Block, sw.tp.tiny_gpt_plan()


FAMILIES: dict[str, Callable[[], tuple[nn.Module, Any, dict[str, Any]]]] = {
    "llama": llama, "gpt2": gpt2, "tiny_gpt": tiny_gpt,
}


def meta_built(family: str) -> tuple[sw.Step, dict[str, Any], dict[str, Any]]:
    with torch.device("meta"):
        model, block, plan = FAMILIES[family]()
    model = model.double()
    init_fn = init_tiny_gpt if family == "tiny_gpt" else None
    chain, params = sw.functionalize(model, units=block, example_input=tokens(1)[0][0], init_fn=init_fn)
    assert all(t.is_meta for d in params.values() for t in d.values())
    loss = logits_loss if family == "tiny_gpt" else hf_loss
    return sw.train_step(chain, loss, sw.optim.sgd(0.1, momentum=0.9)), params, plan


STACKS: dict[str, tuple[Callable[[sw.Step, dict[str, Any]], sw.Step], sw.Mesh]] = {
    "zero3 dp2": (lambda s, plan: sw.shard_params(s, "dp", stage=3), sw.Mesh(dp=2)),
    "zero3 dp2 x pp2": (lambda s, plan: sw.shard_params(sw.pipeline(s, "pp", "1f1b", 2), "dp", stage=3),
                        sw.Mesh(dp=2, pp=2)),
    "tp2": (lambda s, plan: sw.tensor_parallel(s, "tp", plan), sw.Mesh(tp=2)),
}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_meta_built_model_initialized_by_shard_equals_one_device_and_trains_alike(family: str, stack: str) -> None:
    reference, params, plan = meta_built(family)
    transform, mesh = STACKS[stack]
    step = transform(reference, plan)
    one = reference.init(params, seed=7).params

    def full() -> Any:
        return step.full_params(step.init(params, mesh, seed=7))

    for rank_params in sw.launch(full, world=mesh.size):
        assert rank_params.keys() == one.keys()
        for layer, tensors in one.items():
            for name, value in tensors.items():
                assert torch.equal(rank_params[layer][name], value), (layer, name)
    # the values are a real init: not all zero, weights drawn, norms ones
    assert any(float(t.abs().sum()) > 0 for d in one.values() for t in d.values())
    report = sw.testing.assert_equivalent(step, reference, mesh, tokens(), params)
    assert report.steps == 2


def test_made_values_do_not_depend_on_the_mesh_but_on_the_seed() -> None:
    with torch.device("meta"):
        model = mlp([6, 8, 4])
    chain, params = sw.functionalize(model)
    step = sw.shard_params(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)

    worlds = {}
    for world in (2, 4):
        def program(world: int = world) -> Any:
            return step.full_params(step.init(params, sw.Mesh(dp=world), seed=3))
        worlds[world] = sw.launch(program, world=world)[0]
    for layer, tensors in worlds[2].items():
        for name, value in tensors.items():
            assert torch.equal(worlds[4][layer][name], value)
    other = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)).init(params, seed=4).params
    assert not torch.equal(other["0"]["weight"], worlds[2]["0"]["weight"])


def test_buffers_of_a_meta_built_model_are_made_as_the_eager_model_has_them() -> None:
    with torch.device("meta"):
        meta_model, block, _ = llama()
    eager, _, _ = llama()
    chain, _ = sw.functionalize(meta_model, units=block)
    made = {n: b for layer in chain for n, b in layer.buffers.items()}
    assert made, "the chain carries the rotary frequencies"
    for name, buffer in eager.named_buffers():
        assert not made[name].is_meta
        assert torch.equal(made[name], buffer), name


def test_a_frozen_parameter_of_a_meta_built_model_must_be_loaded_before_init() -> None:
    """A frozen (requires_grad=False) parameter, which the chain carries as a buffer, is not made by
    init (it makes what trains) but loaded. It was left the stand-in the split ran on, one zero
    expanded, and the model trained with a zero embedding; init now refuses it, and starting from
    stored weights fills it (a frozen base of its own, with no initializer, included)."""
    class Adapter(nn.Module):  # a frozen base without reset_parameters, and a trainable head
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Parameter(torch.empty(50, 8), requires_grad=False)
            self.head = nn.Linear(8, 3)

        def forward(self, ids: Tensor) -> Tensor:
            return self.head(self.base[ids])

    with torch.device("meta"):
        model = Adapter()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"frozen \(requires_grad=False\) parameters \['model.base'\](.|\n)*"
                                         r"init_from_pretrained(.|\n)*frozen=True"):
        step.init(params)
    torch.manual_seed(0)
    stored = Adapter().state_dict()
    stored["base"] = torch.randn(50, 8)
    state = sw.checkpoint.init_from_state_dict(step, stored)
    assert torch.equal(chain["model"].buffers["base"], stored["base"])
    ids = torch.tensor([1, 7, 7, 3])
    _, metrics = step(state, (ids, torch.zeros(4, 3)))
    reference = Adapter()
    reference.load_state_dict(stored)
    torch.testing.assert_close(metrics["loss"], F.mse_loss(reference(ids), torch.zeros(4, 3)))


def test_a_module_without_an_initializer_is_named_and_init_fn_is_asked_for() -> None:
    with torch.device("meta"):
        model, block, _ = tiny_gpt()
    # pos_emb is a parameter of TinyGPT itself, which has no reset_parameters; and the causal mask
    # buffer would be left unset by torch's layers' own initializers.
    with pytest.raises(FunctionalizeError, match=r"has no reset_parameters\(\).*init_fn"):
        sw.functionalize(model, units=block)


class _MaskedAttention(nn.Module):
    """nanoGPT's attention: a causal mask made in __init__ (a persistent buffer), no reset_parameters."""

    def __init__(self, mask_device: str | None = None) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ, device=mask_device)).view(1, 1, SEQ, SEQ))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, HIDDEN // 2).transpose(1, 2) for z in self.qkv(x).split(HIDDEN, 2))
        a = (q @ k.transpose(-2, -1) / (HIDDEN // 2) ** 0.5).masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return self.proj((a.softmax(-1) @ v).transpose(1, 2).reshape(b, t, HIDDEN))


class _ResettableMaskedAttention(_MaskedAttention):
    def reset_parameters(self) -> None:
        self.bias.copy_(torch.ones_like(self.bias).tril())


class _MaskedGPT(nn.Module):
    def __init__(self, attention: Callable[[], nn.Module] = _MaskedAttention) -> None:
        super().__init__()
        self.wte, self.attn, self.head = nn.Embedding(VOCAB, HIDDEN), attention(), nn.Linear(HIDDEN, VOCAB)
        self.gain = nn.Parameter(torch.ones(HIDDEN))  # of the root, which has no reset_parameters

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)
        return self.head(self.gain * (x + self.attn(x)))


def _init_mask(module: nn.Module) -> None:
    if isinstance(module, _MaskedAttention):
        module.bias.copy_(torch.ones_like(module.bias).tril())


def test_a_meta_buffer_without_an_initializer_is_refused_naming_ways_that_work(tmp_path: Any) -> None:
    """The refusal of nanoGPT's causal mask (made in __init__, so meta under torch.device("meta")) also
    offered "load the values (sw.checkpoint.init_from_state_dict)": impossible, functionalize had
    refused, so there was no step to load into. Each way it names now is run here: functionalize
    takes the model, and the step started from the stored weights computes the loss the real
    model does."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    real = _MaskedGPT().double()
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, tmp_path / "model.safetensors")
    ids, targets = tokens(1)[0]
    expected = logits_loss(real(ids), targets)
    with torch.device("meta"):
        model = _MaskedGPT().double()
    with pytest.raises(FunctionalizeError) as refused:
        sw.functionalize(model, example_input=ids)
    message = str(refused.value)
    assert message.startswith("functionalize: buffer 'attn.bias' is on the meta device")
    assert "init_fn=fn" in message and "give _MaskedAttention a reset_parameters()" in message
    assert "device='cpu'" in message and "init_from_state_dict" not in message
    ways: dict[str, tuple[Callable[[], nn.Module], Any]] = {
        "init_fn": (_MaskedGPT, _init_mask),
        "reset_parameters": (lambda: _MaskedGPT(_ResettableMaskedAttention), None),
        "a device for the buffer": (lambda: _MaskedGPT(lambda: _MaskedAttention(mask_device="cpu")), None),
    }
    for way, (build, init_fn) in ways.items():
        with torch.device("meta"):
            model = build().double()
        chain, _ = sw.functionalize(model, example_input=ids, init_fn=init_fn)
        step = sw.train_step(chain, logits_loss, sw.optim.sgd(0.1))
        _, metrics = step(sw.checkpoint.init_from_pretrained(step, tmp_path), (ids, targets))
        torch.testing.assert_close(metrics["loss"], expected, rtol=1e-12, atol=0, msg=way)


def test_a_meta_parameter_without_an_initializer_is_refused_at_init_and_loading_it_works() -> None:
    torch.manual_seed(0)
    real = _MaskedGPT().double()
    with torch.device("meta"):
        model = _MaskedGPT(lambda: _MaskedAttention(mask_device="cpu")).double()
    ids, targets = tokens(1)[0]
    chain, params = sw.functionalize(model, example_input=ids)
    step = sw.train_step(chain, logits_loss, sw.optim.sgd(0.1))
    with pytest.raises(FunctionalizeError, match=r"^init: parameter 'gain' .*init_from_state_dict in place of step"):
        step.init(params)
    _, metrics = step(sw.checkpoint.init_from_state_dict(step, real.state_dict()), (ids, targets))
    torch.testing.assert_close(metrics["loss"], logits_loss(real(ids), targets), rtol=1e-12, atol=0)


def test_an_init_fn_that_leaves_a_tensor_unset_is_refused() -> None:
    with torch.device("meta"):
        model, block, _ = tiny_gpt()

    def forgets_the_mask(module: nn.Module) -> None:  # sets every parameter but not the mask
        if isinstance(module, TinyGPT):
            nn.init.normal_(module.pos_emb, std=0.02)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()

    with pytest.raises(FunctionalizeError, match=r"'blocks.0.attn.mask'.*left some of its elements unset"):
        sw.functionalize(model, units=block, init_fn=forgets_the_mask)


def test_a_tensor_found_set_is_made_once_from_then_on_with_the_same_values() -> None:
    """Each tensor is made twice (from two fills) the first time, to find an element its initializer leaves unset;
    once found set, a second init (a warm-up then a measured run, another thread rank) makes it once."""
    made: list[str] = []

    def init_fn(module: nn.Module, path: str) -> None:
        if isinstance(module, nn.Linear):
            made.append(path)
            nn.init.normal_(module.weight)
            nn.init.zeros_(module.bias)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    chain, params = sw.functionalize(model, init_fn=init_fn)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    first = step.init(params)
    once = len(made)
    second = step.init(params)
    assert once == 8 and len(made) - once == 4  # four tensors: made twice each, then once each
    for layer, tensors in first.params.items():
        for name, t in tensors.items():
            assert torch.equal(t, second.params[layer][name]), f"{layer}.{name} made again differs"


class _Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.empty(4)), nn.Parameter(torch.empty(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w + self.b


def test_a_tensor_left_unset_is_refused_at_every_init() -> None:
    def forgets_the_bias(module: nn.Module, path: str) -> None:
        if isinstance(module, _Affine):
            nn.init.normal_(module.w)

    with torch.device("meta"):
        model = nn.Sequential(_Affine())
    chain, params = sw.functionalize(model, init_fn=forgets_the_bias)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    for _ in range(2):
        with pytest.raises(FunctionalizeError, match=r"'0\.b'"):
            step.init(params)


def test_meta_parameters_without_a_way_to_make_them_are_refused() -> None:
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(3, 2)))
    meta = {layer: {n: t.to("meta") for n, t in d.items()} for layer, d in params.items()}
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(
        ValueError, match=r"params\['0'\]\['(weight|bias)'\].*meta tensors.*functionalize the meta-built"
    ):
        step.init(meta)


def test_init_fn_and_device_are_refused_for_a_model_that_has_its_values() -> None:
    with pytest.raises(TypeError, match=r"init_fn=.*meta device.*drop init_fn"):
        sw.functionalize(nn.Sequential(nn.Linear(3, 2)), init_fn=lambda m: None)


def test_the_users_meta_module_is_left_meta() -> None:
    with torch.device("meta"):
        model, block, _ = llama()
    chain, params = sw.functionalize(model, units=block)
    sw.train_step(chain, hf_loss, sw.optim.sgd(0.1)).init(params)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
