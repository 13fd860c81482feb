"""functionalize: bitwise parity with the module (outputs and gradients), ties, buffers, refusals.

Every comparison is exact (torch.equal): the chain runs the module's own ops in the same
order on equal values, so there is no tolerance to explain.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from copy import deepcopy
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch import Tensor, nn

from shardwise.engine.model.chain import Chain
from shardwise.engine.model.functionalize import FunctionalizeError, functionalize
from shardwise.testing.models import Block, TinyGPT, mlp

ParamTree = dict[str, dict[str, Tensor]]
GPT_UNITS: list[Any] = [["tok_emb", "blocks", "head"], Block, None]


def tiny_gpt(tie: bool = True) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=48, d_model=32, n_heads=4, n_layers=3, seq_len=12, tie_weights=tie).eval()


def tokens(batch: int = 2, time: int = 12) -> Tensor:
    return torch.randint(0, 48, (batch, time), generator=torch.Generator().manual_seed(1))


def trainable(params: ParamTree) -> ParamTree:
    return {
        layer: {n: t.clone().requires_grad_() for n, t in d.items()} for layer, d in params.items()
    }


def module_grads(module: nn.Module, x: Any, loss: Callable[[Any], Tensor]) -> dict[int, Tensor]:
    """``.grad`` of every parameter after ``loss(module(x)).backward()``, keyed by identity."""
    module.zero_grad(set_to_none=True)
    loss(module(x)).backward()
    return {id(p): p.grad for p in module.parameters() if p.grad is not None}


def module_func_grads(module: nn.Module, x: Any, loss: Callable[[Any], Tensor]) -> dict[int, Tensor]:
    """``torch.func.grad`` of ``loss(module(x))`` over the module's parameters, keyed by identity.

    On a copy: torch's functional_call replaces the parameters of a module whose submodule is
    reachable by two paths when it restores them (pytorch/pytorch#164759)."""
    named = dict(module.named_parameters())
    copy = deepcopy(module)
    grads = torch.func.grad(lambda p: loss(torch.func.functional_call(copy, p, (x,))))(
        {k: t.detach() for k, t in named.items()}
    )
    return {id(named[k]): g for k, g in grads.items()}


def assert_grads_match(
    module: nn.Module, chain: Chain, params: ParamTree, x: Any, loss: Callable[[Any], Tensor]
) -> None:
    """Chain gradients equal the module's bitwise: by backward its ``.grad``, by torch.func.grad
    its own torch.func.grad (the two differ in the last bit for some ops in torch itself, e.g.
    SiLU's backward under torch.func)."""
    expected = module_grads(module, x, loss)
    expected_functional = module_func_grads(module, x, loss)
    leaves = trainable(params)
    loss(chain(leaves, x)).backward()
    functional = torch.func.grad(lambda p: loss(chain(p, x)))(params)
    by_identity = _param_identities(module, chain)
    assert len(by_identity) == len(expected) == len(expected_functional)  # every module param appears once
    for (layer, name), pid in by_identity.items():
        assert torch.equal(leaves[layer][name].grad, expected[pid]), f"{layer}/{name}"
        assert torch.equal(functional[layer][name], expected_functional[pid]), f"{layer}/{name}"


def _param_identities(module: nn.Module, chain: Chain) -> dict[tuple[str, str], int]:
    """(layer, local name) of each owned param -> id of the module Parameter it copies."""
    named = dict(module.named_parameters(remove_duplicate=False))
    out = {}
    for layer in chain:
        for local in layer.owned_param_names:
            # fx segments and whole-module layers use full names; Sequential children their own
            # (a Sequential has no params of its own, so the two never collide).
            key = local if local in named else f"{layer.name}.{local}"
            out[(layer.name, local)] = id(named[key])
    return out


def xent(logits: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens().flatten())


# --- Sequentials and single modules ---------------------------------------------------------


@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    activation=st.sampled_from(["gelu", "relu", "tanh", "silu"]),
    seed=st.integers(0, 2**16),
)
def test_mlp_is_bitwise_the_module(widths: list[int], activation: str, seed: int) -> None:
    torch.manual_seed(seed)
    model = mlp(widths, activation)
    x = torch.randn(3, widths[0])
    chain, params = functionalize(model, example_input=x)
    assert chain.names == tuple(str(i) for i in range(len(model)))
    assert torch.equal(chain(params, x), model(x))
    assert_grads_match(model, chain, params, x, lambda y: y.square().sum())


def test_sequential_of_common_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(20, 8),
        nn.LayerNorm(8),
        nn.Linear(8, 16),
        nn.GELU(),
        nn.Dropout(0.5),
        nn.Linear(16, 4),
    ).eval()
    x = torch.randint(0, 20, (3, 5))
    chain, params = functionalize(model, example_input=x)
    assert params["3"] == {} and params["4"] == {}
    assert torch.equal(chain(params, x), model(x))
    assert_grads_match(model, chain, params, x, lambda y: y.sum())


def test_dropout_in_training_mode_draws_the_same_mask() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    chain, params = functionalize(model, example_input=x)
    torch.manual_seed(7)
    expected = model(x)
    torch.manual_seed(7)
    assert torch.equal(chain(params, x), expected)


def test_named_sequential_children_name_the_layers() -> None:
    from collections import OrderedDict

    model = nn.Sequential(OrderedDict(inp=nn.Linear(2, 3), act=nn.ReLU(), out=nn.Linear(3, 1)))
    chain, params = functionalize(model)
    assert chain.names == ("inp", "act", "out")
    assert set(params["inp"]) == {"weight", "bias"}


@pytest.mark.parametrize("module", [nn.Linear(5, 3), nn.LayerNorm(5), nn.GELU()])
def test_any_single_module_is_one_layer(module: nn.Module) -> None:
    x = torch.randn(2, 5)
    chain, params = functionalize(module, example_input=x)
    assert chain.names == ("model",)
    assert set(params["model"]) == {n for n, _ in module.named_parameters()}
    assert torch.equal(chain(params, x), module(x))


def test_untraceable_module_is_fine_as_one_layer() -> None:
    """units=None never traces, so data-dependent control flow is allowed."""
    chain, _ = functionalize(Branchy(), example_input=torch.randn(3))
    assert chain.names == ("model",)


# --- the GPT: glue, ties, buffers -----------------------------------------------------------


@pytest.mark.parametrize("units", GPT_UNITS, ids=["paths", "class", "whole"])
def test_gpt_is_bitwise_the_module(units: Any) -> None:
    model = tiny_gpt()
    chain, params = functionalize(model, units=units, example_input=tokens())
    if units is Block:
        assert chain.names == ("blocks.0", "blocks.1", "blocks.2")
    elif units is not None:
        assert chain.names == ("tok_emb", "blocks.0", "blocks.1", "blocks.2", "head")
    assert torch.equal(chain(params, tokens()), model(tokens()))
    assert_grads_match(model, chain, params, tokens(), xent)


def test_gpt_glue_joins_the_following_unit_and_the_tie_is_kept() -> None:
    chain, params = functionalize(tiny_gpt(), units=["tok_emb", "blocks", "head"])
    assert set(params["tok_emb"]) == {"tok_emb.weight"}
    assert "pos_emb" in params["blocks.0"]  # glue before blocks.0
    assert set(params["head"]) == {"ln_f.weight", "ln_f.bias"}  # ln_f: glue before head
    assert chain["head"].ties == {"head.weight": ("tok_emb", "tok_emb.weight")}
    all_tensors = [t for d in params.values() for t in d.values()]
    assert (
        len(all_tensors) == len({id(t) for t in all_tensors}) == len(list(tiny_gpt().parameters()))
    )


def test_untied_gpt_has_no_ties() -> None:
    model = tiny_gpt(tie=False)
    chain, params = functionalize(model, units=Block, example_input=tokens())
    assert all(not layer.ties for layer in chain)
    assert "head.weight" in params["blocks.2"]  # glue after the last unit joins it
    assert_grads_match(model, chain, params, tokens(), xent)


def test_tie_inside_one_layer_is_one_entry_fed_under_both_names() -> None:
    model = tiny_gpt()
    chain, params = functionalize(model)
    assert "tok_emb.weight" in params["model"] and "head.weight" not in params["model"]
    # Perturbing the one entry changes both uses: the tie is honoured by functional_call.
    params["model"]["tok_emb.weight"] = params["model"]["tok_emb.weight"] * 2
    with torch.no_grad():
        model.tok_emb.weight.mul_(2)
    assert torch.equal(chain(params, tokens()), model(tokens()))


def test_buffers_are_the_modules_own_tensors() -> None:
    model = tiny_gpt()
    chain, params = functionalize(model, units=Block)
    mask = chain["blocks.1"].buffers["blocks.1.attn.mask"]
    assert torch.equal(mask, model.blocks[1].attn.mask)
    assert mask.data_ptr() == model.blocks[1].attn.mask.data_ptr()  # no copy of the data
    assert all("mask" not in n for d in params.values() for n in d)


def test_params_are_the_modules_tensors_detached_and_the_module_is_untouched() -> None:
    model = tiny_gpt()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attributes = set(vars(model))
    _, params = functionalize(model, units=Block, example_input=tokens())
    pointers = {t.data_ptr() for t in model.state_dict().values()}
    for d in params.values():
        for t in d.values():
            assert not t.requires_grad
            assert t.data_ptr() in pointers  # the module's own memory, not a copy
    assert set(vars(model)) == attributes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("units", [None, Block])
def test_the_chain_keeps_no_tensor_of_the_module(units: Any) -> None:
    """The chain's layers call a skeleton: every parameter and buffer of the modules it holds is
    a meta tensor, so the module's memory is not kept alive by the chain."""
    model = tiny_gpt()
    chain, params = functionalize(model, units=units, example_input=tokens())
    real = {t.data_ptr() for t in model.state_dict().values()}
    for layer in chain:
        for module in _modules_of(layer.fn):
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                assert tensor.is_meta, f"{layer.name}: {name} holds data"
                assert tensor.data_ptr() not in real
    assert torch.equal(chain(params, tokens()), model(tokens()))


def _modules_of(fn: Any) -> list[nn.Module]:
    """Every nn.Module a layer fn holds, one attribute deep (its replicas' skeleton)."""
    found = []
    for value in vars(fn).values():
        module = getattr(value, "module", value)
        if isinstance(module, nn.Module):
            found.append(module)
    assert found, f"{fn!r} holds no module"
    return found


def test_frozen_params_travel_as_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    chain, params = functionalize(model, example_input=torch.randn(2, 3))
    assert set(params["0"]) == {"bias"}
    assert set(chain["0"].buffers) == {"weight"}


def test_layers_are_safe_to_call_from_many_threads() -> None:
    """Ranks of the threads backend share one chain; functional_call must not race."""
    model = tiny_gpt()
    chain, params = functionalize(model, units=Block)
    per_thread = [
        {k: {n: t + 0.01 * i for n, t in d.items()} for k, d in params.items()} for i in range(4)
    ]
    expected = [chain(p, tokens()) for p in per_thread]
    results: list[Tensor | None] = [None] * 4
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        barrier.wait()
        for _ in range(3):
            results[i] = chain(per_thread[i], tokens())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected, strict=True):
        assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize("units", GPT_UNITS, ids=["paths", "class", "whole"])
def test_chain_survives_pickle(units: Any) -> None:
    """Process ranks receive their work pickled; a functionalized chain must make the trip."""
    model = tiny_gpt()
    chain, params = functionalize(model, units=units)
    clone = pickle.loads(pickle.dumps(chain))
    assert clone.names == chain.names
    assert torch.equal(clone(params, tokens()), model(tokens()))


# --- fx splitting details --------------------------------------------------------------------


class Scaled(nn.Module):
    """A glue param read before the first unit but used after it, and a constant made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        s = self.scale
        h = self.a(x)
        return self.b(h * s) * torch.tensor(3.0)


class Pairs(nn.Module):
    """A unit that returns a tuple, consumed by the next unit."""

    def __init__(self) -> None:
        super().__init__()
        self.split = SplitTwo()
        self.join = JoinTwo()

    def forward(self, x: Tensor) -> Tensor:
        return self.join(self.split(x)) + 1


class SplitTwo(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.sin(), x.cos()


class JoinTwo(nn.Module):
    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        return xs[0] * xs[1]


def test_glue_param_sinks_to_its_user_and_constants_stay_off_the_module() -> None:
    model = Scaled()
    attributes = set(vars(model))
    chain, params = functionalize(model, units=["a", "b"], example_input=torch.randn(2, 4))
    assert "scale" in params["b"] and "scale" not in params["a"]
    assert set(vars(model)) == attributes
    assert_grads_match(model, chain, params, torch.randn(2, 4), lambda y: y.sum())


def test_a_tuple_may_cross_a_boundary() -> None:
    x = torch.randn(5)
    chain, params = functionalize(Pairs(), units=["split", "join"], example_input=x)
    y = chain[0](params["split"], x)
    assert isinstance(y, tuple) and len(y) == 2
    assert torch.equal(chain(params, x), Pairs()(x))


def test_batchnorm_in_training_mode_is_refused_and_eval_works() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
    with pytest.raises(FunctionalizeError, match=r"'1' \(BatchNorm1d\).*\.eval\(\).*GroupNorm.*"
                       r"track_running_stats=False: it then normalises with the statistics of the batch it is "
                       r"called on.*a step that cuts the batch.*refuses it"):
        functionalize(model)
    model.eval()
    chain, _ = functionalize(model, example_input=torch.randn(5, 3))
    assert set(chain["1"].buffers) == {"running_mean", "running_var", "num_batches_tracked"}


class Masked(nn.Module):
    """A mask computed once in glue and used by every block: two values cross each boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        mask = x > 0
        for block in self.blocks:
            x = block(x, mask)
        return x


class MaskedBlock(nn.Module):
    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return torch.where(mask, x * 2, x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            x = -x
        return self.lin(x)


class Hooked(nn.Module):
    """A forward hook on the root, which a split never runs (refused: engine/model/root_hooks.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.register_forward_hook(lambda module, args, out: out * 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


class Spare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.spare = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


class Ignores(nn.Module):
    """The second unit does not depend on the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.register_buffer("c", torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        self.a(x)
        return self.b(self.c)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.lin(x + y)


@pytest.mark.parametrize(
    ("make", "units", "message"),
    [
        (
            tiny_gpt,
            ["tok_emb", "blockz", "head"],
            r"unknown unit 'blockz'.*did you mean \['blocks'",
        ),
        (
            tiny_gpt,
            ["blocks", "tok_emb", "head"],
            r"order forward runs them; unit 0 is 'blocks.0' but forward runs 'tok_emb'",
        ),
        (
            tiny_gpt,
            ["blocks", "blocks.1"],
            r"units 'blocks.1' and 'blocks.1.attn'|'blocks.1' is listed twice",
        ),
        (tiny_gpt, ["blocks.0", "blocks.0.attn"], r"'blocks.0' and 'blocks.0.attn' overlap"),
        (tiny_gpt, ["pos_emb"], "unknown unit 'pos_emb'"),
        (tiny_gpt, ["head.weight"], "unknown unit 'head.weight'"),
        (tiny_gpt, [], "units is empty"),
        (Ignores, ["a", "b"], r"between units 'a' and 'b' no value flows"),
        (
            tiny_gpt,
            ["blocks.0.attn", "blocks.0.mlp"],
            r"'blocks.0.attn' and 'blocks.0.mlp.0' 2 values cross(.|\n)*'add' = add\(\.\.\.\) at File .*models.py",
        ),
        (
            Masked,
            ["blocks"],
            r"between units 'blocks.0' and 'blocks.1' 2 values cross(.|\n)*'gt' = gt\(\.\.\.\) at File(.|\n)*"
            r"'blocks_0', the output of 'blocks.0'(.|\n)*buffer",
        ),
        (Masked, nn.Linear, "contains no Linear"),
        (
            Branchy,
            ["lin"],
            r"cannot trace Branchy.forward(.|\n)*control flow(.|\n)*nn.Sequential(.|\n)*Layer",
        ),
        (Pairs, ["split.nothing"], "unknown unit 'split.nothing'"),
        (Spare, ["lin", "spare"], "'spare' is never called"),
        (TwoInputs, ["lin"], "second required argument 'y'"),
    ],
)
def test_refusals_name_the_place_and_the_fix(
    make: Callable[[], nn.Module], units: Any, message: str
) -> None:
    with pytest.raises(FunctionalizeError, match=message):
        functionalize(make(), units=units)


def test_tracing_goes_through_attention_and_its_mask_buffer() -> None:
    """With only the ends as units, blocks are glue: traced through, the mask read from the graph."""
    model = tiny_gpt()
    chain, params = functionalize(model, units=["tok_emb", "head"], example_input=tokens())
    assert set(chain["head"].buffers) == {f"blocks.{i}.attn.mask" for i in range(3)}
    assert_grads_match(model, chain, params, tokens(), xent)


def test_shared_unit_called_twice_is_refused() -> None:
    lin = nn.Linear(3, 3)
    with pytest.raises(FunctionalizeError, match="'0' is called 2 times"):
        functionalize(nn.Sequential(lin, nn.ReLU(), lin), units=["0", "1"])


def test_repeated_child_of_a_sequential_is_tied() -> None:
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    chain, params = functionalize(model, example_input=torch.randn(2, 3))
    assert params["2"] == {} and chain["2"].ties == {
        "weight": ("0", "weight"),
        "bias": ("0", "bias"),
    }
    assert_grads_match(model, chain, params, torch.randn(2, 3), lambda y: y.sum())


class CountsCalls(nn.Module):
    """Its glue reads a count its own forward advances: traced once, the chain would keep the count of the
    trace (engine/model/glue_reads.py refuses the write at the trace; example_input caught the result)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.b(self.a(x)) * self.calls


@pytest.mark.parametrize("example", [None, torch.randn(2, 3)])
def test_a_split_whose_glue_writes_its_module_is_refused_and_the_module_put_back(example: Tensor | None) -> None:
    model = CountsCalls()
    with pytest.raises(FunctionalizeError, match=r"changes numbers its modules hold while torch.fx traces it "
                       r"\(CountsCalls at the root: self.calls \(0 -> 1\)\).*Keep the count outside forward.*put back"):
        functionalize(model, units=["a", "b"], example_input=example)
    assert model.calls == 0


def test_a_hook_on_the_split_model_itself_is_refused_and_a_whole_one_keeps_it() -> None:
    with pytest.raises(FunctionalizeError, match=r"Hooked has forward hook .* on the model itself"):
        functionalize(Hooked(), units=["a", "b"], example_input=torch.randn(2, 3))
    functionalize(Hooked(), example_input=torch.randn(2, 3))  # one layer calls the module itself


def test_example_input_catches_a_layer_that_mutates_a_buffer() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x: Tensor) -> Tensor:
            self.count.add_(1)
            return x

    with pytest.raises(FunctionalizeError, match="layer 'model' modified its buffer 'count'"):
        functionalize(Counter(), example_input=torch.zeros(1))


def test_a_module_holding_an_object_deepcopy_refuses_is_functionalized_and_runs_on_threads() -> None:
    """The chain's skeleton (and each thread's replica) copies the module; a lock in it cannot be
    deep-copied, so the copy is made module by module, sharing the lock."""
    import shardwise as sw

    model = mlp([3, 5, 2]).double()
    model[2].lock = threading.Lock()
    x = torch.randn(4, 3, dtype=torch.float64)
    chain, params = functionalize(model, example_input=x)
    assert chain["2"].fn.module.lock is model[2].lock
    assert all(t.is_meta for t in chain["0"].fn.module.parameters())
    for out in sw.launch(lambda: chain(params, x), world=2):  # rank 1 runs on its own replica
        assert torch.equal(out, model(x))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x))


def _trains_as_the_module(chain: Any, params: Any, model: nn.Module, batches: list[Any]) -> tuple[Any, Any, nn.Module]:
    """The own-loss model's split trained by SGD with momentum beside the module itself, the losses
    bitwise equal at every step: (the step, its last state, the trained module)."""
    import shardwise as sw

    step = sw.train_step(chain, lambda out, _: out[1], sw.optim.sgd(0.1, momentum=0.9))
    state = step.init(params)
    reference = deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch, targets in batches:
        state, metrics = step(state, (batch, targets))
        opt.zero_grad()
        loss = reference(**batch)[1]
        loss.backward()
        opt.step()
        assert torch.equal(metrics["loss"], loss.detach())
    return step, state, reference


class _OwnLossGPT(nn.Module):
    """nanoGPT's shape: ``forward(idx, targets=None)`` returns (logits, loss), the loss when given targets."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.h = nn.ModuleList([_Residual() for _ in range(2)])
        self.head = nn.Linear(8, 16)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_a_dict_example_of_keyword_arguments_is_split_by_recording_and_trains_bitwise() -> None:
    """fx traces forward's first argument alone (targets fixed at None): with a dict batch of keyword
    arguments the split is recorded on the example instead, as for Hugging Face models."""
    import shardwise as sw

    torch.manual_seed(0)
    model = _OwnLossGPT().double()
    g = torch.Generator().manual_seed(1)
    batches = [({"idx": t[:, :-1], "targets": t[:, 1:]}, None) for t in
               (torch.randint(0, 16, (4, 7), generator=g) for _ in range(3))]
    chain, params = functionalize(model, units=_Residual, example_input=batches[0][0])
    assert chain.names == ("embed", "h.0", "h.1", "head")
    step, state, reference = _trains_as_the_module(chain, params, model, batches)
    full = {n: t for layer in state.params.values() for n, t in layer.items()}
    assert all(torch.equal(full[n], p) for n, p in reference.named_parameters())
    piped = sw.pipeline(step, "pp", "1f1b", 2)
    sw.testing.assert_equivalent(piped, step, sw.Mesh(pp=2), batches, params)


def test_a_dict_example_with_the_embedding_as_first_unit_trains_as_one_device() -> None:
    """Units that start at the embedding (``units=["wte", "h"]``) on a dict example: the glue
    before the first unit only passes the batch's token ids on. No gradient needs to reach the batch,
    so that glue passing no floating-point tensor is not refused (it was, as a layer gradients could
    not flow through); the split trains bitwise as the torch module, and over dp=2 and a pipeline as
    the single-device step."""
    import shardwise as sw

    torch.manual_seed(0)
    model = _OwnLossGPT().double()
    g = torch.Generator().manual_seed(1)
    batches = [({"idx": t[:, :-1], "targets": t[:, 1:]}, None) for t in
               (torch.randint(0, 16, (4, 7), generator=g) for _ in range(2))]
    chain, params = functionalize(model, units=["wte", "h"], example_input=batches[0][0])
    assert chain.names == ("embed", "wte", "h.0", "h.1", "head")
    step, _, _ = _trains_as_the_module(chain, params, model, batches)
    sw.testing.assert_equivalent(sw.shard_params(step, "dp", 3), step, sw.Mesh(dp=2), batches, params)
    sw.testing.assert_equivalent(sw.pipeline(step, "pp", "1f1b", 2), step, sw.Mesh(pp=2), batches, params)


def test_a_unit_named_like_the_layer_around_the_units_is_refused_naming_the_clash() -> None:
    """A unit called ``head`` (or ``embed``) on the call-recording split made two layers of one name,
    refused by the chain with a bare ValueError; it is refused naming the clash and the way out."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (2, 4), generator=g)
    with pytest.raises(FunctionalizeError, match=r"the unit 'head' has the name of the layer .* leave 'head' out"):
        functionalize(_OwnLossGPT(), units=["wte", "h", "head"], example_input={"idx": ids, "targets": ids})
    chain, _ = functionalize(_OwnLossGPT(), units=["wte", "h"], example_input={"idx": ids, "targets": ids})
    assert chain.names[-1] == "head" and "head.weight" in str(chain.owned_param_names("head"))


def test_a_first_layer_with_parameters_and_no_floating_output_is_still_refused() -> None:
    """Only a parameter-free first layer may pass no floating-point tensor: one with parameters would
    get no gradient."""
    class IntOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x).argmax(-1)

    with pytest.raises(FunctionalizeError, match=r"layer '0' returns a Tensor that carries no floating-point"):
        functionalize(nn.Sequential(IntOut(), nn.Embedding(3, 2)), example_input=torch.randn(2, 3))


class _Shared:
    """An object of the model's own that it hands every unit (as Gemma-3n's shared key/value states)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []


class _HandsAnObject(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_TakesShared(), _TakesShared()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = _Shared()
        for block in self.blocks:
            x = block(x, shared)
        return x


class _TakesShared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, shared: _Shared) -> torch.Tensor:
        shared.seen.append(x)
        return self.linear(x)


def test_a_unit_handed_an_object_of_the_models_is_refused_with_the_way_out() -> None:
    with pytest.raises(FunctionalizeError, match=r"receives a _Shared at arguments.*units=None"):
        functionalize(_HandsAnObject(), units=_TakesShared, example_input=torch.randn(2, 4))
    chain, _ = functionalize(_HandsAnObject(), example_input=torch.randn(2, 4))  # units=None: one layer
    assert len(chain.names) == 1


@pytest.mark.parametrize("kind", ["attention", "lstm"])
def test_a_module_on_transposed_activations_is_checked_with_parameters_that_require_grad(kind: str) -> None:
    """The check against the module ran the chain on parameters that did not require grad, the module on its
    own that do; torch's matmul folds a 3-D input into one 2-D product only for a weight that does not, so a
    Linear after nn.MultiheadAttention(batch_first=True) or nn.LSTM(batch_first=True) (outputs of transposed
    strides) rounded 1 ulp differently and functionalize refused the model ('the chain differs from the
    module ... 5.55e-17'). Now it is accepted, and the chain computes the module's output bitwise."""

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
            self.mix = (nn.MultiheadAttention(16, 2, batch_first=True) if kind == "attention"
                        else nn.LSTM(16, 16, batch_first=True))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            h = self.mix(h, h, h, need_weights=False)[0] if kind == "attention" else self.mix(h)[0]
            return self.out(h)

    torch.manual_seed(0)
    model = Mixer().double()
    x = torch.randn(8, 4, 6, dtype=torch.float64)
    chain, params = functionalize(model, example_input=x)
    trained = {layer: {k: v.detach().requires_grad_() for k, v in ps.items()} for layer, ps in params.items()}
    got = x
    for layer in chain:
        got = layer(chain.layer_params(trained, layer), got)
    assert torch.equal(got, model(x))


def test_a_lazy_module_not_called_yet_is_refused_naming_the_first_call() -> None:
    """Found by session 41's probing: torch's "uninitialized parameter" error came out of functionalize's alias
    check, example_input= or not."""
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    with pytest.raises(FunctionalizeError, match=r"'0' \(LazyLinear\) has parameters not made yet \(weight, "
                       r"bias\).*Call the model once on an input like your batches \(model\(example\)\)"):
        functionalize(model)
    x = torch.randn(3, 5)
    model(x)
    chain, params = functionalize(model)
    torch.testing.assert_close(chain(params, x), model(x))
