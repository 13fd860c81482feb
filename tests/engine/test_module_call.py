"""ModuleCall swaps tensors through modules' private ``_parameters`` / ``_buffers`` dicts:
these tests fail loudly if torch stops keeping a module's tensors there, and check that it
computes bitwise what ``torch.func.functional_call`` computes, on the same terms."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import shardwise as sw
from shardwise.engine.model.module_call import DIRECT, ModuleCall, call_arguments
from shardwise.testing.models import TinyGPT


def _fresh(module: nn.Module) -> dict[str, torch.Tensor]:
    """Different values for every param and buffer, under functional_call's key names."""
    named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    # rand, not randn: a running variance must stay positive (NaN would make equality fail)
    return {k: torch.rand_like(v) + 0.5 if v.is_floating_point() else v.clone() for k, v in named.items()}


def test_torch_keeps_module_tensors_in_the_dicts_module_call_swaps() -> None:
    lin = nn.Linear(3, 2)
    assert lin._parameters["weight"] is lin.weight and lin._parameters["bias"] is lin.bias
    norm = nn.BatchNorm1d(3).eval()
    assert norm._buffers["running_mean"] is norm.running_mean
    lin._parameters["weight"] = torch.zeros(2, 3)  # what a swap does: forward must see it
    assert torch.equal(lin(torch.ones(1, 3)), lin.bias.detach().unsqueeze(0))


@pytest.mark.parametrize(
    "module",
    [
        nn.Linear(8, 4),
        nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 4)),
        nn.BatchNorm1d(8).eval(),
    ],
    ids=["linear", "sequential", "batchnorm-eval"],
)
def test_bitwise_functional_call_and_the_module_is_restored(module: nn.Module) -> None:
    before = {k: v for k, v in [*module.named_parameters(), *module.named_buffers()]}
    tensors = _fresh(module)
    x = torch.randn(5, 8)
    got = ModuleCall(module)(tensors, x)
    assert torch.equal(got, functional_call(module, tensors, (x,), strict=True))
    after = {k: v for k, v in [*module.named_parameters(), *module.named_buffers()]}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_tied_weights_are_fed_under_every_alias_with_gradients_summed() -> None:
    gpt = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=1, seq_len=8, tie_weights=True)
    tensors = _fresh(gpt)
    assert "head.weight" not in tensors  # named once, under the embedding's name
    leaf = tensors["tok_emb.weight"].requires_grad_(True)
    tokens = torch.randint(0, 32, (2, 8))
    ours = ModuleCall(gpt)(tensors, tokens)
    theirs = functional_call(gpt, tensors, (tokens,), strict=True)
    assert torch.equal(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours.square().sum(), leaf)
    (g_theirs,) = torch.autograd.grad(theirs.square().sum(), leaf)
    assert torch.equal(g_ours, g_theirs)


def test_other_key_sets_get_functional_calls_own_errors_and_nothing_is_left_swapped() -> None:
    lin = nn.Linear(3, 2)
    weight = lin.weight
    call = ModuleCall(lin)
    with pytest.raises(RuntimeError, match="Missing key"):
        call({"weight": torch.zeros(2, 3)}, torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        call({"weight": torch.zeros(2, 3), "bias": torch.zeros(2), "scale": torch.ones(1)}, torch.ones(1, 3))
    assert lin.weight is weight


def test_an_exception_in_forward_restores_the_module() -> None:
    lin = nn.Linear(3, 2)
    weight = lin.weight
    with pytest.raises(RuntimeError):
        ModuleCall(lin)(_fresh(lin), torch.ones(1, 4))  # wrong width
    assert lin.weight is weight


@pytest.mark.parametrize("units", [None, ["tok_emb", "blocks", "head"]], ids=["whole", "fx-units"])
def test_functionalized_layers_never_fall_back_to_functional_call(
    monkeypatch: pytest.MonkeyPatch, units: object
) -> None:
    from shardwise.engine.model import module_call as _module_call
    from shardwise.engine.model.functionalize import functionalize

    gpt = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8, tie_weights=True)
    chain, params = functionalize(gpt, units=units)  # type: ignore[arg-type]

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ModuleCall fell back to functional_call")

    monkeypatch.setattr(_module_call, "functional_call", refuse)
    tokens = torch.randint(0, 32, (2, 8))
    assert torch.equal(chain(params, tokens), gpt(tokens))


class _TwoPaths(nn.Module):
    """One Linear reachable as ``a`` and as ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_a_submodule_reachable_by_two_paths_gets_its_own_parameters_back() -> None:
    """torch's functional_call swaps such a slot twice and restores the swapped-in tensor
    (pytorch/pytorch#164759); ModuleCall reads every original before it swaps any."""
    module = _TwoPaths()
    weight, bias = module.a.weight, module.a.bias
    saved = weight.detach().clone()
    tensors = _fresh(module)
    assert tensors.keys() == {"a.weight", "a.bias"}  # the alias is fed under the first name
    x = torch.randn(4, 3)
    got = ModuleCall(module)(tensors, x)
    assert module.a.weight is weight and module.b.weight is weight and module.a.bias is bias
    assert torch.equal(weight, saved)
    copy = _TwoPaths()  # functional_call on a module of its own: it may not give the parameters back
    copy.load_state_dict(module.state_dict())
    assert torch.equal(got, functional_call(copy, tensors, (x,), strict=True))


DIRECT_MODULES = {
    "linear": lambda: nn.Linear(8, 6),
    "linear-no-bias": lambda: nn.Linear(8, 6, bias=False),
    "gelu": nn.GELU,
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "dropout": lambda: nn.Dropout(0.3),
    "dropout-eval": lambda: nn.Dropout(0.3).eval(),
    "layernorm": lambda: nn.LayerNorm(8),
    "layernorm-no-affine": lambda: nn.LayerNorm(8, elementwise_affine=False),
    "layernorm-no-bias": lambda: nn.LayerNorm(8, bias=False),
}


def _swapped_and_direct(module: nn.Module, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[
        ModuleCall, ModuleCall]:
    swapped = ModuleCall(module)
    swapped._direct = None  # the swap around module(x), as for any other module
    direct = ModuleCall(module)
    assert direct._direct is DIRECT[type(module)]
    return swapped, direct


@pytest.mark.parametrize("make", list(DIRECT_MODULES.values()), ids=list(DIRECT_MODULES))
def test_direct_calls_are_bitwise_the_module_call_values_and_gradients(make: Any) -> None:
    """A module in DIRECT is called through its forward's one function: the same values and the same
    gradients, bit for bit, as the swap around module(x) (dropout under the same seed)."""
    module = make()
    values = _fresh(module)
    results = []
    for use_direct in (False, True):
        tensors = {k: v.clone().requires_grad_(True) for k, v in values.items()}
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(5, 8, generator=gen).requires_grad_(True)
        call = _swapped_and_direct(module, tensors, x)[use_direct]
        torch.manual_seed(7)
        y = call(tensors, x)
        grads = torch.autograd.grad(y.square().sum(), [x, *tensors.values()])
        results.append([y, *grads])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_module_with_hooks_or_a_subclass_is_called_as_a_module() -> None:
    """Hooks (its own or global) and a forward set on the instance run as module(x) runs them: the
    direct call steps aside."""
    lin = nn.Linear(4, 4)
    tensors = _fresh(lin)
    x = torch.randn(2, 4)
    seen: list[str] = []
    handle = lin.register_forward_hook(lambda m, i, o: seen.append("own"))
    ModuleCall(lin)(tensors, x)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append("global"))
    try:
        ModuleCall(lin)(tensors, x)
    finally:
        handle.remove()
    assert seen == ["own", "global"]

    lin.forward = lambda input: 3 * torch.nn.functional.linear(input, lin.weight, lin.bias)  # as tensor_parallel
    tripled = 3 * torch.nn.functional.linear(x, tensors["weight"], tensors["bias"])
    assert torch.equal(ModuleCall(lin)(tensors, x), tripled)
    del lin.forward

    class Doubled(nn.Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(input)

    assert ModuleCall(Doubled(4, 4))._direct is None
    assert set(DIRECT) >= {nn.Linear, nn.GELU}


# --- how a layer calls its module on a dict --------------------------------------------------


class _Kwargs(nn.Module):
    def forward(self, x: Any, **kwargs: Any) -> Any:
        return x, kwargs


class _Named(nn.Module):
    def forward(self, input_ids: Any, labels: Any = None) -> Any:
        return input_ids, labels


class _One(nn.Module):
    def forward(self, batch: Any) -> Any:
        return batch


class _BatchAndMask(nn.Module):
    def forward(self, batch: Any, mask: Any = None) -> Any:
        return batch, mask


class _BatchAndKwargs(nn.Module):
    def forward(self, batch: Any, mask: Any = None, **kwargs: Any) -> Any:
        return batch, mask, kwargs


class _OptionalFirst(nn.Module):  # Hugging Face's: input_ids or inputs_embeds, and **kwargs
    def forward(self, input_ids: Any = None, inputs_embeds: Any = None, **kwargs: Any) -> Any:
        return input_ids, inputs_embeds, kwargs


@pytest.mark.parametrize(
    ("module", "x", "spread"),
    [
        (_Named(), {"input_ids": 1, "labels": 2}, True),  # every key an argument
        (_Kwargs(), {"x": 1, "return_dict": True}, True),  # one key an argument, the rest **kwargs
        (_Kwargs(), {"a": 1, "b": 2}, False),  # forward(x, **kwargs) given a dict: the dict is x
        (_One(), {"a": 1, "b": 2}, False),
        (_One(), {"batch": 1, "b": 2}, False),  # a one-argument forward: the dict is its argument
        # A required first argument the dict does not name: the dict is it, as module(batch) (review:
        # these were spread, or refused, where eager torch passes the dict whole).
        (_BatchAndMask(), {"x": 1, "mask": 2}, False),
        (_BatchAndKwargs(), {"x": 1, "mask": 2}, False),
        (_OptionalFirst(), {"inputs_embeds": 1, "shift_labels": 2}, True),  # an optional first: keywords
    ],
)
def test_a_dict_is_spread_into_keywords_when_forward_takes_them(module: nn.Module, x: Any, spread: bool) -> None:
    args, kwargs = call_arguments(module, x)
    assert (args, kwargs) == (((), x) if spread else ((x,), {}))


def test_a_dict_naming_some_arguments_and_others_forward_cannot_take_is_refused_naming_them() -> None:
    with pytest.raises(TypeError, match=r"\['return_dict'\](.|\n)*takes no \*\*kwargs(.|\n)*remove \['return_dict'\]"):
        call_arguments(_Named(), {"input_ids": 1, "labels": 2, "return_dict": True})


class _HoldsALock(nn.Module):
    """A module that cannot be deep-copied: a thread's copy is made module by module."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.lin, self.lock = nn.Linear(4, 4), threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4)), _HoldsALock],
                         ids=["deep copy", "module by module"])
def test_a_thread_copy_keeps_the_models_hooks_not_one_another_thread_put_on_its_module(make: Any) -> None:
    """The owner thread's module carried a hook of the owner's (the sequence-first check's pre-hook, which hears
    only its own thread) while another thread made its copy: the copy kept it after the owner removed it, a call
    per forward for good. A hook the model held when the chain was made stays on every copy; a hook put on a copy
    made module by module is not on the original."""
    import threading

    from shardwise.engine.model.module_call import ThreadReplicas

    model = make()

    def models_hook(module: nn.Module, args: Any) -> None:
        pass

    model.register_forward_pre_hook(models_hook)
    replicas = ThreadReplicas(model)
    owner = replicas.get().module
    inner = next(iter(owner.children()))
    handle = inner.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    got: dict[str, nn.Module] = {}
    thread = threading.Thread(target=lambda: got.setdefault("copy", replicas.get().module))
    thread.start()
    thread.join()
    handle.remove()
    copy = got["copy"]
    copied_inner = next(iter(copy.children()))
    assert copy is not owner and copied_inner is not inner
    assert not copied_inner._forward_pre_hooks and not copied_inner._forward_pre_hooks_with_kwargs
    assert list(copy._forward_pre_hooks.values()) == [models_hook]  # the skeleton holds no data: not called here
    copied_inner.register_forward_pre_hook(models_hook)
    assert not inner._forward_pre_hooks


class _KeywordsOnly(nn.Module):
    """A wrapper as the guide writes one for a batch dict: ``forward(self, **batch)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.lin(batch["x"]) * batch["scale"]


def test_a_forward_of_keywords_only_is_given_the_batch_as_keywords() -> None:
    """The finetune review: ``forward(self, **batch)`` was handed the dict as one positional argument (TypeError:
    takes 1 positional argument but 2 were given), in functionalize and in every call."""
    batch = {"x": torch.randn(3, 4), "scale": torch.tensor(2.0)}
    assert call_arguments(_KeywordsOnly(), batch) == ((), batch)
    model = _KeywordsOnly()
    chain, params = sw.functionalize(model, example_input=batch)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    target = torch.randn(3, 2)
    _, metrics = step(step.init(params), (batch, target))
    assert float(metrics["loss"]) == pytest.approx(F.mse_loss(model(**batch), target).item(), rel=1e-6)
