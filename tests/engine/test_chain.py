"""Chain and Layer: hand-written pure layers, ties, validation, and parity with a plain loop."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch import Tensor

from shardwise.engine.model.chain import Chain, Layer


def linear(t: dict[str, Tensor], x: Tensor) -> Tensor:
    return torch.tanh(x @ t["w"].T)


def tied_pair() -> tuple[Chain, dict[str, dict[str, Tensor]]]:
    """An "embedding" layer owning w and a "head" layer reusing it transposed, plus a bias."""
    chain = Chain(
        [
            Layer("embed", lambda t, x: x @ t["w"], param_names=("w",)),
            Layer(
                "act",
                lambda t, x: torch.tanh(x * t["scale"]),
                buffers={"scale": torch.tensor(2.0, dtype=torch.float64)},
            ),
            Layer(
                "head",
                lambda t, x: x @ t["wt"].T + t["b"],
                param_names=("wt", "b"),
                ties={"wt": ("embed", "w")},
            ),
        ]
    )
    g = torch.Generator().manual_seed(0)
    params = {
        "embed": {"w": torch.randn(3, 5, generator=g, dtype=torch.float64)},
        "act": {},
        "head": {"b": torch.randn(3, generator=g, dtype=torch.float64)},
    }
    return chain, params


def test_sequence_protocol() -> None:
    chain, _ = tied_pair()
    assert len(chain) == 3
    assert chain.names == ("embed", "act", "head")
    assert [layer.name for layer in chain] == list(chain.names)
    assert chain[0] is chain["embed"] is chain.layers[0]
    assert chain[-1].name == "head"
    assert chain.index("head") == 2 and chain.index(-1) == 2 and chain.index(chain["act"]) == 1
    assert "act" in chain and "nope" not in chain
    with pytest.raises(KeyError, match="no layer 'nope'"):
        chain["nope"]
    with pytest.raises(TypeError, match=r"int.*str"):
        chain[1.0]  # type: ignore[call-overload]


def test_layer_params_resolves_ties_at_owner() -> None:
    chain, params = tied_pair()
    head = chain.layer_params(params, "head")
    assert set(head) == {"wt", "b"}
    assert head["wt"] is params["embed"]["w"]
    assert chain.owned_param_names("head") == ("b",) == chain["head"].owned_param_names
    assert chain.layer_params(params, 1) == {}


def test_call_matches_manual_composition() -> None:
    chain, params = tied_pair()
    x = torch.randn(4, 3, dtype=torch.float64)
    w, b = params["embed"]["w"], params["head"]["b"]
    expected = torch.tanh((x @ w) * 2.0) @ w.T + b
    assert torch.equal(chain(params, x), expected)


def test_bind_calls_the_layer_with_its_buffers_on_every_input() -> None:
    chain, params = tied_pair()
    seen: list[dict[str, Tensor]] = []
    act = chain["act"]
    spy = dataclasses.replace(act, fn=lambda t, x: seen.append(t) or act.fn(t, x))
    call = spy.bind({})
    for x in (torch.randn(2, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)):
        assert torch.equal(call(x), act({}, x))
    assert seen[0] is seen[1] and set(seen[0]) == {"scale"}  # merged once, reused
    head = chain["head"]
    x = torch.randn(4, 5, dtype=torch.float64)
    tensors = chain.layer_params(params, "head")
    assert torch.equal(head.bind(tensors)(x), head(tensors, x))


def test_tied_param_gets_summed_gradient() -> None:
    chain, params = tied_pair()
    x = torch.randn(4, 3, dtype=torch.float64)
    grads = torch.func.grad(lambda p: chain(p, x).square().sum())(params)
    assert set(grads) == {"embed", "act", "head"} and set(grads["head"]) == {"b"}

    w = params["embed"]["w"].clone().requires_grad_()
    b = params["head"]["b"]
    (torch.tanh((x @ w) * 2.0) @ w.T + b).square().sum().backward()
    assert w.grad is not None
    assert torch.equal(grads["embed"]["w"], w.grad)


def test_missing_param_names_the_layer_and_key() -> None:
    chain, params = tied_pair()
    del params["embed"]["w"]
    with pytest.raises(
        KeyError, match=r"params\['embed'\] has no 'w'.*'head' needs as 'wt' \(tied"
    ):
        chain.layer_params(params, "head")
    with pytest.raises(KeyError, match="'embed' needs as 'w'"):
        chain(params, torch.zeros(1, 3))


def test_params_that_are_not_per_layer_dicts_name_step_full_params() -> None:
    """ZeRO-3's state.params hold one flat shard per layer, a pipeline rank's only its stage's layers:
    running the chain on them says to pass step.full_params(state) (it was a bare Tensor.__contains__
    error for the flat shard)."""
    chain, params = tied_pair()
    flat = {name: torch.cat([t.flatten() for t in layer.values()]) if layer else torch.zeros(0)
            for name, layer in params.items()}
    with pytest.raises(TypeError, match=r"params\['embed'\] is a Tensor of shape \(15,\), not a dict.*"
                       r"step\.full_params\(state\)"):
        chain(flat, torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(KeyError, match=r"params\['embed'\] holds \[\]; .*step\.full_params\(state\)"):
        chain({"embed": {}, "act": {}, "head": params["head"]}, torch.zeros(1, 3, dtype=torch.float64))


def test_a_zero3_states_params_refuse_the_chain_and_full_params_run_it() -> None:
    import shardwise as sw

    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double())
    step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", 3)
    x = torch.randn(2, 4, dtype=torch.float64)

    def main() -> Tensor:
        state = step.init(params, sw.Mesh(dp=2))
        with pytest.raises(TypeError, match=r"params\['0'\] is a Tensor.*step\.full_params\(state\)"):
            chain(state.params, x)
        return chain(step.full_params(state), x)

    for out in sw.launch(main, world=2):
        assert torch.equal(out, chain(params, x))


def test_a_tensor_parallel_states_slices_refuse_the_chain_and_full_params_run_it() -> None:
    """The review (s39 longrun F1): chain(state.params, x) on a tensor-parallel state ran the whole Linear on each
    rank's slices and returned a partial sum (0.52 / 0.68 off the full model's output), without an error."""
    import shardwise as sw

    torch.manual_seed(0)
    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                                         torch.nn.Linear(16, 8)).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    tp = sw.tensor_parallel(step, "tp", {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()})
    x = torch.randn(4, 8, dtype=torch.float64)

    def main() -> Tensor:
        state = tp.init(params, sw.Mesh(tp=2))
        with pytest.raises(ValueError, match=r"layer '0''s parameter 'weight' has shape \(8, 8\), where its module's "
                                             r"Linear has \(16, 8\):.*tensor_parallel: this rank's slices.*"
                                             r"step\.full_params\(state\)"):
            chain(state.params, x)
        return chain(tp.full_params(state), x)

    for out in sw.launch(main, world=2):
        assert torch.equal(out, chain(params, x))


def test_layer_is_frozen_and_copies_its_containers() -> None:
    buffers = {"s": torch.ones(1)}
    names = ["w"]
    layer = Layer("l", linear, param_names=names, buffers=buffers)  # type: ignore[arg-type]
    buffers["t"] = torch.zeros(1)
    names.append("v")
    assert set(layer.buffers) == {"s"} and layer.param_names == ("w",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.name = "other"  # type: ignore[misc]
    renamed = dataclasses.replace(layer, name="m")
    assert renamed.name == "m" and renamed.fn is linear


def test_repr_and_summary_show_structure() -> None:
    chain, params = tied_pair()
    text = repr(chain)
    assert text.count("\n") == 4 and "embed: params w" in text and "act: buffers scale[]" in text
    assert "wt -> params['embed']['w']" in text
    summary = chain.summary(params)
    assert "w[3, 5]" in summary and "total owned params: 18" in summary
    assert repr(Chain([])) == "Chain()"
    assert "Layer('embed'" in repr(chain[0])


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([Layer("a", linear), Layer("a", linear)], "both named 'a'"),
        (
            [Layer("a", linear, ("w",), ties={"w": ("b", "w")}), Layer("b", linear, ("w",))],
            "does not come earlier",
        ),
        ([Layer("a", linear, ("w",), ties={"w": ("zz", "w")})], "no layer 'zz'"),
        (
            [Layer("a", linear, ("w",)), Layer("b", linear, ("v",), ties={"v": ("a", "x")})],
            "does not own 'x'",
        ),
        (
            [
                Layer("a", linear, ("w",)),
                Layer("b", linear, ("v",), ties={"v": ("a", "w")}),
                Layer("c", linear, ("u",), ties={"u": ("b", "v")}),
            ],
            "tie to the owner itself",
        ),
    ],
)
def test_chain_validation(layers: list[Layer], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Chain(layers)


def test_chain_refuses_non_layers() -> None:
    with pytest.raises(TypeError, match="layer 0 is a function"):
        Chain([linear])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": ""}, ValueError, "non-empty string name"),
        ({"fn": 3}, TypeError, "must be callable"),
        ({"param_names": ("w", "w")}, ValueError, r"\['w'\] more than once"),
        (
            {"param_names": ("w",), "buffers": {"w": torch.ones(1)}},
            ValueError,
            "both params and buffers",
        ),
        ({"ties": {"w": ("a", "w")}}, ValueError, "add it to param_names"),
    ],
)
def test_layer_validation(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    args: dict[str, object] = {"name": "l", "fn": linear, **kwargs}
    with pytest.raises(error, match=message):
        Layer(**args)  # type: ignore[arg-type]


@st.composite
def tied_chains(draw: st.DrawFn) -> tuple[list[int], list[int | None]]:
    """Widths of a chain of square tanh-linears, and for each layer the earlier layer it reuses (or None)."""
    n = draw(st.integers(1, 5))
    width = draw(st.integers(1, 4))
    reuse: list[int | None] = [None]
    for i in range(1, n):
        owners = [j for j in range(i) if reuse[j] is None]
        reuse.append(draw(st.none() | st.sampled_from(owners)))
    return [width] * n, reuse


@given(tied_chains(), st.integers(0, 2**16))
def test_chain_matches_reference_loop(spec: tuple[list[int], list[int | None]], seed: int) -> None:
    """A drawn chain with drawn ties equals a plain loop over weight matrices, forward and gradient."""
    widths, reuse = spec
    g = torch.Generator().manual_seed(seed)
    layers, params, weights = [], {}, []
    for i, owner in enumerate(reuse):
        ties = {} if owner is None else {"w": (str(owner), "w")}
        layers.append(Layer(str(i), linear, ("w",), ties=ties))
        if owner is None:
            params[str(i)] = {
                "w": torch.randn(widths[i], widths[i], generator=g, dtype=torch.float64)
            }
        else:
            params[str(i)] = {}
        weights.append(params[str(owner if owner is not None else i)]["w"])
    chain = Chain(layers)
    x = torch.randn(3, widths[0], generator=g, dtype=torch.float64)

    def reference(ws: list[Tensor]) -> Tensor:
        y = x
        for w in ws:
            y = torch.tanh(y @ w.T)
        return y

    assert torch.equal(chain(params, x), reference(weights))
    grads = torch.func.grad(lambda p: chain(p, x).sum())(params)
    leaves = {
        i: params[str(i)]["w"].clone().requires_grad_() for i, o in enumerate(reuse) if o is None
    }
    reference([leaves[i if o is None else o] for i, o in enumerate(reuse)]).sum().backward()
    for i, leaf in leaves.items():
        assert torch.equal(grads[str(i)]["w"], leaf.grad)
