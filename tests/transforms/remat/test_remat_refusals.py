"""What remat refuses, and the uses next to them it still runs exactly.

Found by hunting: a layer drawing from a generator of its own got another mask when recomputed
(a wrong gradient, no error); an in-place op on an output ``dots_saveable`` saved failed with
torch's bare error; a policy's class passed for a policy failed at the first step.
"""

from __future__ import annotations

import re
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.transforms.remat import (
    DotsSaveable,
    EverythingSaveable,
    NothingSaveable,
    OffloadToCpu,
    SaveOnlyTheseNames,
    dots_saveable,
    everything_saveable,
    nothing_saveable,
    offload_to_cpu,
    remat,
)

from .test_remat_step import SaveNothingSelectively

aten = torch.ops.aten


def _params_after(step: sw.Step, params: Any, batches: list[Any]) -> list[torch.Tensor]:
    state = step.init(params)
    for batch in batches:
        state, _ = step(state, batch)
    return optree.tree_leaves(state.params)


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _batches() -> list[Any]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 6, dtype=torch.float64, generator=gen), torch.randn(8, 3, dtype=torch.float64, generator=gen))
        for _ in range(2)
    ]


# -- random ops with a generator of the layer's own ------------------------------------------------


class _Noisy(nn.Module):
    """A linear layer whose mask comes from ``generator`` (its own, or a default one)."""

    def __init__(self, d: int, generator: Any) -> None:
        super().__init__()
        self.lin, self.generator = nn.Linear(d, d), generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        keep = torch.rand(h.shape, generator=self.generator(), dtype=h.dtype) > 0.5
        return h * keep * 2.0


def _noisy_step(generator: Any) -> tuple[sw.Step, Any]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_Noisy(6, generator), nn.Tanh(), nn.Linear(6, 3)).double())
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params


def _own() -> Any:
    gen = torch.Generator().manual_seed(123)
    return lambda: gen


RECOMPUTING = [nothing_saveable, dots_saveable, SaveNothingSelectively(), offload_to_cpu(dots_saveable)]


@pytest.mark.parametrize("policy", RECOMPUTING, ids=repr)
def test_a_random_op_with_an_own_generator_is_refused_where_it_would_be_recomputed(policy: Any) -> None:
    """Without the refusal the recomputation drew a new mask: the gradient of another forward."""
    step, params = _noisy_step(_own())
    with pytest.raises(ValueError, match=(
        rf"remat\({re.escape(repr(policy))}\): layer '0' calls aten.rand.generator with a torch.Generator of its own.*"
        r"replays only the default generators.*Draw from the default generator.*torch.manual_seed.*"
        r"leave the layer out of remat")):
        remat(step, policy)(remat(step, policy).init(params), _batches()[0])


@pytest.mark.parametrize("policy", [everything_saveable, offload_to_cpu()], ids=repr)
def test_an_own_generator_under_a_policy_that_recomputes_nothing_runs_exactly(policy: Any) -> None:
    step, params = _noisy_step(_own())
    plain = _params_after(step, params, _batches())
    step, params = _noisy_step(_own())
    _assert_equal(_params_after(remat(step, policy), params, _batches()), plain)


def test_an_own_generator_whose_op_the_policy_saves_runs_exactly() -> None:
    """A selective policy that saves the random op's output replays it from the cache."""
    def save_random(op: Any, *args: Any, **kwargs: Any) -> bool:
        return bool(op == aten.rand.generator)

    step, params = _noisy_step(_own())
    plain = _params_after(step, params, _batches())
    step, params = _noisy_step(_own())
    _assert_equal(_params_after(remat(step, save_random), params, _batches()), plain)


@pytest.mark.parametrize("policy", RECOMPUTING, ids=repr)
def test_the_default_generator_passed_by_name_and_dropout_still_run_exactly(policy: Any) -> None:
    """checkpoint replays the default generator (which the step seeds per compute): passing it as
    generator=torch.default_generator, or dropout (which draws from it), is exact under remat."""
    step, params = _noisy_step(lambda: torch.default_generator)
    _assert_equal(_params_after(remat(step, policy), params, _batches()), _params_after(step, params, _batches()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 3), nn.Dropout(0.3)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    _assert_equal(_params_after(remat(step, policy), params, _batches()), _params_after(step, params, _batches()))


def test_an_own_generator_outside_remat_and_under_no_grad_is_not_refused() -> None:
    step, params = _noisy_step(_own())
    plain = _params_after(step, params, _batches())
    step, params = _noisy_step(_own())
    _assert_equal(_params_after(remat(step, layers=["1", "2"]), params, _batches()), plain)  # '0' left out
    noisy = remat(step).chain["0"].fn
    with torch.no_grad():  # nothing is recomputed: an evaluation under remat may draw as it likes
        noisy(params["0"], _batches()[0][0])


# -- an in-place op on a saved output ----------------------------------------------------------------


def _matmul_chain(inplace: bool) -> tuple[sw.Step, Any, tuple[torch.Tensor, torch.Tensor]]:
    def lin(t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = x @ t["w"]
        if inplace:
            h.relu_()  # in place on the matmul's output
        else:
            h = h.relu()
        return h

    torch.manual_seed(0)
    chain = sw.Chain([sw.Layer("a", lin, ("w",)), sw.Layer("b", lin, ("w",))])
    params = {n: {"w": torch.randn(6, 6, dtype=torch.float64)} for n in "ab"}
    batch = (torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), params, batch


def test_an_in_place_op_on_an_output_dots_saveable_saved_names_the_layer_policy_op_and_fix() -> None:
    step, params, batch = _matmul_chain(inplace=True)
    rematted = remat(step, dots_saveable)
    with pytest.raises(RuntimeError, match=(
        r"remat\(dots_saveable\): layer '[ab]' changes the output of aten.mm.default \(aten.relu_.default writes "
        r"into it\) in place after the policy saved it.*out of place \(x = x \+ y for x \+= y.*a torch kernel's "
        r"own.*nothing_saveable.*leave the layer out")):
        rematted(rematted.init(params), batch)


def test_a_write_into_a_saved_output_the_backward_never_reads_again_runs_exactly() -> None:
    """The review (s41 review2): `out = fc(h); out += x; return out` under dots_saveable writes into the addmm output
    the policy saved, which no recomputation reads (addmm's backward reads its inputs; torch recomputes up to what
    the backward needs): it trained exactly, and the first version of the write check refused it at the add_."""

    def block(t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x @ t["w"]) @ t["v"]
        out += x  # into the second matmul's output, after its last use
        return out

    torch.manual_seed(0)
    chain = sw.Chain([sw.Layer("a", block, ("w", "v")), sw.Layer("b", block, ("w", "v"))])
    params = {n: {"w": torch.randn(6, 6, dtype=torch.float64), "v": torch.randn(6, 6, dtype=torch.float64)}
              for n in "ab"}
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 6, dtype=torch.float64, generator=gen), torch.randn(8, 6, dtype=torch.float64,
                                                                                   generator=gen)) for _ in range(2)]
    _assert_equal(_params_after(remat(step, dots_saveable), params, batches), _params_after(step, params, batches))


def test_the_same_layers_out_of_place_or_under_nothing_saveable_run_exactly() -> None:
    step, params, batch = _matmul_chain(inplace=True)
    plain = _params_after(step, params, [batch])
    _assert_equal(_params_after(remat(step, nothing_saveable), params, [batch]), plain)
    step, params, batch = _matmul_chain(inplace=False)
    _assert_equal(_params_after(remat(step, dots_saveable), params, [batch]), plain)


def _vgg_features() -> tuple[sw.Step, Any, list[Any]]:
    """torchvision's VGG / AlexNet features as written there: ``nn.ReLU(inplace=True)`` a Sequential child of its
    own, so ``functionalize`` makes it a layer that writes into its input, the conv layer's output."""
    torch.manual_seed(0)
    vgg = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 10)).double()
    chain, params = sw.functionalize(vgg)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 8, 8, generator=gen, dtype=torch.float64), torch.randint(10, (8,), generator=gen))
               for _ in range(2)]
    return sw.train_step(chain, F.cross_entropy, sw.optim.sgd(0.1, momentum=0.9)), params, batches


@pytest.mark.parametrize("policy", [nothing_saveable, dots_saveable], ids=["nothing", "dots"])
def test_a_layer_writing_into_its_input_runs_exactly_on_a_copy_made_inside_its_checkpoint(policy: Any) -> None:
    """Found by session 41's probing: torch's own error in backward ("modified by an inplace operation ... output 0
    of Relu"), as plain torch's per-child checkpoint gives: the checkpoint keeps the layer's input to recompute
    from, and the in-place ReLU wrote into it. Each layer's first forward now runs on a copy of its input; the
    layers that wrote into it are handed one from then on (made again by each recomputation), the others not."""
    step, params, batches = _vgg_features()
    rematted = remat(step, policy)
    _assert_equal(_params_after(rematted, params, batches), _params_after(step, params, batches))
    writes = {layer.name: layer.fn._writes_input[0] for layer in rematted.chain.layers}  # type: ignore[attr-defined]
    assert writes == {"0": False, "1": True, "2": False, "3": False, "4": True, "5": False, "6": False, "7": False}
    sw.testing.assert_equivalent(sw.shard_params(rematted, "dp", 2), step, sw.Mesh(dp=2), batches, params)


class _Split(nn.Module):
    """Hands the next layer one tensor twice (hidden and residual at a block's start), or beside a view of it."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.lin, self.view = nn.Linear(6, 6), view

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        return {"head": h[:, :3], "h": h} if self.view else (h, h)


class _WritesOneOfThem(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.lin, self.lin2, self.view = nn.Linear(6, 6), nn.Linear(3, 6), view

    def forward(self, given: Any) -> torch.Tensor:
        if self.view:  # the write into h shows in its view, as without remat
            h = given["h"].tanh_()
            return self.lin(h) + self.lin2(given["head"])
        h, residual = given
        torch.relu_(h)  # and in the residual, the same tensor
        return self.lin(h + residual)


@pytest.mark.parametrize("policy", [nothing_saveable, dots_saveable], ids=["nothing", "dots"])
@pytest.mark.parametrize("view", [False, True], ids=["same-tensor-twice", "a-view-beside"])
def test_a_write_into_one_of_aliased_inputs_shows_in_the_others_as_without_remat(view: bool, policy: Any) -> None:
    """The review: the first version of the copy above copied each tensor of the input apart, so a write into ``h``
    no longer showed in ``(h, h)``'s second entry or in a view of it: remat computed relu(h) + h where the plain
    step computes 2 relu(h), 8% off its first loss, without an error. Tensors of one storage are copied as one."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(_Split(view), _WritesOneOfThem(view), nn.Linear(6, 3)).double())
    step = sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))
    _assert_equal(_params_after(remat(step, policy), params, _batches()), _params_after(step, params, _batches()))


class _ClampsWhenOutOfRange(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.abs() > 3).any()):
            x.clamp_(-3, 3)  # only on some batches: a write into its input
        return torch.tanh(x) * x


def test_a_layer_that_writes_into_its_input_only_later_is_refused_naming_it() -> None:
    """The review: a layer whose first forward wrote nothing is handed its input itself from then on; a later
    batch's write failed in backward with torch's "modified by an inplace operation", naming no layer."""
    torch.manual_seed(0)
    chain, params = sw.functionalize(nn.Sequential(nn.Linear(6, 6), _ClampsWhenOutOfRange(), nn.Linear(6, 3)).double())
    rematted = remat(sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1)), nothing_saveable)
    gen = torch.Generator().manual_seed(0)
    state = rematted.init(params)
    state, _ = rematted(state, (0.01 * torch.randn(8, 6, generator=gen, dtype=torch.float64),
                                torch.randn(8, 3, generator=gen, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match=r"remat\(nothing_saveable\): layer '1' wrote into its input in place on "
                                           r"this call, though its first forward did not.*Write it out of place"):
        rematted(state, (100 * torch.randn(8, 6, generator=gen, dtype=torch.float64),
                         torch.randn(8, 3, generator=gen, dtype=torch.float64)))


class _Recurrent(nn.Module):
    """Embedding -> a torch recurrent layer -> Linear: the recurrence one unit."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.emb, self.head = kind, nn.Embedding(16, 8), nn.Linear(8 if kind != "bidirectional" else 16, 16)
        self.rnn = nn.GRUCell(8, 8) if kind == "cell" else nn.GRU(8, 8, batch_first=True,
                                                                    bidirectional=kind == "bidirectional")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


class _RecurrentUnit(nn.Module):
    def __init__(self, rnn: nn.Module, kind: str) -> None:
        super().__init__()
        self.rnn, self.kind = rnn, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "cell":
            return self.rnn(x)[0]
        h, out = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype), []
        for t in range(x.shape[1]):
            h = self.rnn(x[:, t], h)
            out.append(h)
        return torch.stack(out, 1)


def _recurrent(kind: str) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    m = _Recurrent(kind)
    model = nn.Sequential(m.emb, _RecurrentUnit(m.rnn, kind), m.head).double()
    chain, params = sw.functionalize(model)
    gen = torch.Generator().manual_seed(0)
    batches = [(lambda ids: (ids[:, :-1], ids[:, 1:]))(torch.randint(0, 16, (4, 7), generator=gen)) for _ in range(2)]
    step = sw.train_step(chain, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()), sw.optim.sgd(0.1))
    return step, params, batches


@pytest.mark.parametrize("kind", ["gru", "bidirectional", "cell"])
def test_a_gru_writing_into_the_projection_dots_saveable_saved_is_refused(kind: str) -> None:
    """Found by session 41's probing: nn.GRU's CPU kernel adds into the gates of the input projection it saved (through
    an _unsafe_view, whose version counter torch's check reads is its own): under dots_saveable the backward read the
    changed gates, 3.9% off in the gradient norm, float64, one device, with no error. Refused at the write now;
    nothing_saveable computes torch's step exactly."""
    step, params, batches = _recurrent(kind)
    rematted = remat(step, dots_saveable)
    with pytest.raises(RuntimeError, match=r"remat\(dots_saveable\): layer '1' changes the output of "
                                           r"aten\.addmm\.default \(aten\.add_\.Tensor writes into it\) in place"):
        rematted(rematted.init(params), batches[0])
    _assert_equal(_params_after(remat(step, nothing_saveable), params, batches), _params_after(step, params, batches))


# -- a policy's class given for a policy ---------------------------------------------------------------


@pytest.mark.parametrize(("cls", "fix"), [
    (NothingSaveable, r"pass an instance: NothingSaveable\(\) \(or sw.policies.nothing_saveable, or the name "
                      r"'nothing_saveable'\)"),
    (EverythingSaveable, r"pass an instance: EverythingSaveable\(\)"),
    (DotsSaveable, r"pass an instance: DotsSaveable\(\).*'dots_saveable'"),
    (SaveOnlyTheseNames, r"build one: save_only_these_names\('name', ...\)"),
    (OffloadToCpu, r"build one: offload_to_cpu\(...\)"),
])
def test_a_policy_class_is_refused_when_remat_is_applied(cls: type, fix: str) -> None:
    """It was accepted (a class is callable) and failed at the first step with
    ``NothingSaveable.__init__() takes 1 positional argument but 3 were given``."""
    step, _ = _noisy_step(_own())
    expected = rf"remat\(policy={cls.__name__}\): this is a policy class, not a policy; {fix}"
    with pytest.raises(TypeError, match=expected):
        remat(step, cls)
    if cls is not OffloadToCpu:
        with pytest.raises(TypeError, match=rf"offload_to_cpu\(policy={cls.__name__}\): this is a policy class"):
            offload_to_cpu(cls)
