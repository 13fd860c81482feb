"""What the executor refuses, and how it says where: nothing trains silently wrong."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw


class _Counter(torch.nn.Module):
    """Counts its calls in a buffer: state a pure layer would lose (or share across thread ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.lin(x)


def _step(model: torch.nn.Module) -> tuple[sw.Step, dict]:
    chain, params = sw.functionalize(model)
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), params


def test_a_layer_writing_into_its_buffers_is_refused() -> None:
    step, params = _step(torch.nn.Sequential(_Counter(), torch.nn.Linear(2, 1)))
    with pytest.raises(ValueError, match=r"layer '0' wrote into its buffers \['count'\] during forward"):
        step(step.init(params), (torch.randn(4, 3), torch.randn(4, 1)))


def test_a_batch_that_does_not_fit_names_the_layer_and_the_input() -> None:
    step, params = _step(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1)))
    with pytest.raises(RuntimeError, match="cannot be multiplied") as caught:
        step(step.init(params), (torch.randn(4, 5), torch.randn(4, 1)))
    assert caught.value.__notes__ == ["in layer '0' (stage 0, micro-batch 0), on input float32[4, 5]"]
    with pytest.raises(RuntimeError) as caught:
        step(step.init(params), (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1)))
    assert caught.value.__notes__ == ["in layer '0' (stage 0, micro-batch 0), on input float64[4, 3]"]


def test_a_layer_whose_output_does_not_reach_the_loss_is_refused() -> None:
    """The later layer ignores its input: the earlier one would never train."""
    chain = sw.Chain([
        sw.Layer("first", lambda p, x: x @ p["w"], ("w",)),
        sw.Layer("cut", lambda p, x: torch.ones_like(x) * p["b"], ("b",)),
    ])
    params = {"first": {"w": torch.randn(3, 2)}, "cut": {"b": torch.ones(())}}
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match="the output of layer 'first' does not reach the loss"):
        step(step.init(params), (torch.randn(4, 3), torch.randn(4, 2)))


def test_a_layer_passing_no_float_tensor_on_is_refused() -> None:
    chain = sw.Chain([
        sw.Layer("first", lambda p, x: (x @ p["w"]).argmax(-1), ("w",)),
        sw.Layer("second", lambda p, x: x.double()[:, None] * p["s"], ("s",)),
    ])
    params = {"first": {"w": torch.randn(3, 2)}, "second": {"s": torch.ones(1)}}
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match="layer 'first' passes no floating-point tensor to layer 'second'"):
        step(step.init(params), (torch.randn(4, 3), torch.randn(4, 1)))


def test_a_joined_input_is_found_on_the_graph_or_left_to_a_hook() -> None:
    """The joined backward reads off a small graph whether a layer's input gets a gradient (its
    output's node at the input's own output index); a graph past the budget is left to a hook."""
    from shardwise.engine.run.stage_backward import reaches as _reaches

    big = torch.randn(4, 6, requires_grad=True) * 1.0
    a0, a1 = big.chunk(2, dim=1)  # one node, two outputs
    b = torch.ones((), requires_grad=True)
    assert _reaches(a0 * 2, a0) is True
    assert _reaches(a1 * 2, a0) is False  # the same SplitBackward, the other output
    assert _reaches(torch.ones_like(a0) * b, a0) is False
    assert _reaches(a0, a0) is True
    long = a0
    for _ in range(40):
        long = long * 1.0 + 0.0
    assert _reaches(long, a0) is None
    # Two residual additions, the second's branch past the budget: the input's node is two levels
    # down (a pre-LN block), found before the walk goes down the branch.
    x1 = a0 + a0 * 2.0
    branch = x1
    for _ in range(40):
        branch = branch * 1.0 + 0.0
    assert _reaches(x1 + branch, a0) is True


def test_a_layer_ignoring_its_input_behind_a_large_graph_is_refused_too() -> None:
    """Past the walk's budget the hook decides, and still refuses."""

    def cut(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        y = torch.ones_like(x) * p["b"]
        for _ in range(40):
            y = y * 1.0 + 0.0
        return y

    chain = sw.Chain([sw.Layer("first", lambda p, x: x @ p["w"], ("w",)), sw.Layer("cut", cut, ("b",))])
    params = {"first": {"w": torch.randn(3, 2)}, "cut": {"b": torch.ones(())}}
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match="the output of layer 'first' does not reach the loss"):
        step(step.init(params), (torch.randn(4, 3), torch.randn(4, 2)))


class _Checkpointed(torch.nn.Module):
    """Wraps its computation in torch.utils.checkpoint, as nanoGPT-style code or a checkpoint_wrapper does."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.lin, self.reentrant = torch.nn.Linear(4, 4), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=self.reentrant)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_layer_that_checkpoints_itself_is_refused_naming_the_fix(reentrant: bool) -> None:
    """A layer's own torch.utils.checkpoint recomputes in the backward, outside the pure layer's call:
    the step fails, and what it says points at sw.remat (torch's own message, on a meta tensor, would
    not say why)."""
    step, params = _step(torch.nn.Sequential(_Checkpointed(reentrant), _Checkpointed(reentrant)))
    batch = (torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises((RuntimeError, ValueError)) as failed:
        step(step.init(params), batch)
    said = "\n".join([str(failed.value), *getattr(failed.value, "__notes__", [])])
    assert "torch.utils.checkpoint" in said and "sw.remat(step)" in said, said


def test_a_remat_step_gets_no_note_about_a_layers_own_checkpoint() -> None:
    """sw.remat runs torch's checkpoint machinery itself: a failure in its recomputation is not blamed
    on a layer's own checkpoint."""
    from shardwise.engine.run import stage_backward

    class Boom(Exception):
        pass

    chain, params = sw.functionalize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))
    step = sw.remat(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)))
    state = step.init(params)
    batch = (torch.randn(3, 4), torch.randn(3, 1))
    assert stage_backward._raised_in_checkpoint(Boom()) is False
    original = torch.tanh
    calls = [0]

    def tanh_failing_on_recompute(t: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > 1:  # the recomputation, inside torch.utils.checkpoint
            raise Boom("recomputed")
        return original(t)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "tanh", tanh_failing_on_recompute)
        with pytest.raises(Boom) as failed:
            step(state, batch)
    assert stage_backward._raised_in_checkpoint(failed.value)
    assert not any("torch.utils.checkpoint in its forward" in n for n in getattr(failed.value, "__notes__", []))
