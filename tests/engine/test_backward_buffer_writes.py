"""What a hook does to its module in the backward: a buffer written there (a gradient statistic kept by a
module's backward hook) is refused where the step cuts the batch, and a hook that reads its module's tensors
after the layer's call (where the step's copy holds meta stand-ins) fails with a note saying so."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import shardwise as sw


class Tracked(nn.Module):
    """A gradient-statistic tracker (K-FAC, gradient noise): its backward hook keeps a statistic the forward reads.
    As a closure over the module the hook writes the chain's buffer itself; as a bound method, the step's copy of
    the module (a meta stand-in after the layer's call)."""

    def __init__(self, bound: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("gstat", torch.zeros(()))
        self.lin.register_full_backward_hook(self._track if bound else lambda m, gi, go: self._track(m, gi, go))

    def _track(self, module: nn.Module, grad_input: object, grad_output: tuple[Tensor, ...]) -> None:
        self.gstat.add_(grad_output[0].pow(2).sum().detach())

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x) * (1.0 + 100.0 * self.gstat))


class DataTracked(Tracked):
    """The statistic written through ``.data`` (its own version counter): seen by its contents."""

    def _track(self, module: nn.Module, grad_input: object, grad_output: tuple[Tensor, ...]) -> None:
        self.gstat.data.mul_(0.5).add_(grad_output[0].pow(2).mean().detach())


class BoundTracked(Tracked):
    def __init__(self) -> None:
        super().__init__(bound=True)


class RebindingTracked(Tracked):
    """The same statistic kept by rebinding (``self.gstat = self.gstat + v``), not in place: no version moves."""

    def __init__(self) -> None:
        super().__init__(bound=True)

    def _track(self, module: nn.Module, grad_input: object, grad_output: tuple[Tensor, ...]) -> None:
        self.gstat = self.gstat + grad_output[0].pow(2).sum().detach()


class Scaled(nn.Module):
    """Scales its gradient by a buffer, read by a hook the forward registers: in backward, after the call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("gscale", torch.tensor(0.5))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * self.gscale)
        return torch.tanh(h)


def _model(inner: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), inner(), nn.Linear(8, 2)).double()


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(3)]


def test_a_buffer_a_backward_hook_writes_trains_as_torch_on_one_device() -> None:
    model, reference = _model(Tracked), _model(Tracked)  # (a deep copy's hook would write the model's buffer)
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    state = step.init(params)
    for x, y in _batches():
        state, metrics = step(state, (x, y))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        optimizer.step()
        assert float(metrics["loss"]) == pytest.approx(loss.item(), rel=1e-12)


@pytest.mark.parametrize("how, world", [
    ("zero1", 2), ("zero3", 2), ("accumulation", 1), ("pipeline", 2),
])
def test_a_buffer_a_backward_hook_writes_is_refused_where_the_batch_is_cut(how: str, world: int) -> None:
    chain, params = sw.functionalize(_model(Tracked))
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    made = {
        "zero1": lambda: sw.shard_params(step, "dp", stage=1),
        "zero3": lambda: sw.shard_params(step, "dp", stage=3),
        "accumulation": lambda: sw.shard_params(step, "dp", stage=1, accumulation=2),
        "pipeline": lambda: sw.pipeline(step, "pp", "1f1b", microbatches=2),
    }[how]()
    axis = "pp" if how == "pipeline" else "dp"
    with pytest.raises(sw.collectives.RankFailed, match=r"the buffers 'gstat' of layer '1' were written during the "
                       r"backward \(a module's backward hook.*This step cuts the batch"):
        sw.launch(lambda: made(made.init(params, sw.Mesh(**{axis: world})), _batches()[0]), world=world)


def test_a_buffer_written_through_data_in_backward_is_refused_where_the_batch_is_cut() -> None:
    chain, params = sw.functionalize(_model(DataTracked))
    zero3 = sw.shard_params(sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)
    with pytest.raises(sw.collectives.RankFailed, match=r"the buffers 'gstat' of layer '1' were written during the "
                       r"backward \(a module's backward hook.*This step cuts the batch"):
        sw.launch(lambda: zero3(zero3.init(params, sw.Mesh(dp=2)), _batches()[0]), world=2)


def test_a_buffer_written_through_the_module_copy_in_backward_is_refused_on_one_device_too() -> None:
    chain, params = sw.functionalize(_model(BoundTracked))
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"the buffers 'gstat' of layer '1' were written during the backward, through "
                       r"the step's copy of the layer's module.*the write is lost"):
        step(step.init(params), _batches()[0])


@pytest.mark.parametrize("world", [1, 2])
def test_a_buffer_rebound_through_the_module_copy_in_backward_is_refused_at_the_next_call(world: int) -> None:
    """The first step trains as torch's (its forward ran before the hook); the second would read the old value."""
    chain, params = sw.functionalize(_model(RebindingTracked))
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1))
    made = step if world == 1 else sw.shard_params(step, "dp", stage=3)

    def two_steps() -> None:
        state = made.init(params, None if world == 1 else sw.Mesh(dp=2))
        for batch in _batches()[:2]:
            state, _ = made(state, batch)

    with pytest.raises((ValueError, sw.collectives.RankFailed), match=r"RebindingTracked's tensor 'gstat' was set to "
                       r"another tensor between two calls of its layer.*the new value is lost"):
        sw.launch(two_steps, world=world)


def test_a_hook_reading_its_module_in_backward_fails_with_a_note() -> None:
    chain, params = sw.functionalize(_model(Scaled))
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(RuntimeError, match="meta") as raised:
        step(step.init(params), _batches()[0])
    assert any("let the hook close over the value" in note for note in getattr(raised.value, "__notes__", []))
