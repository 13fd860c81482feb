"""Save at step k on one mesh and stack, load on another, continue: equal to the uninterrupted run.

The reference is the single-device step over all the batches; float64 on threads, so the
1e-12 relative bound of the equivalence tests applies (meshes differ only in the order
of their sums). A load that loses the optimizer state or the loss scale fails these
(the control tests show that the comparison catches exactly that).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.engine.checkpoint import save_load as ck
from shardwise.engine.checkpoint.cut import boxes, flat_start
from shardwise.engine.checkpoint.file_format import CheckpointError
from shardwise.testing import strategies as sst
from shardwise.testing.models import mlp

RTOL = 1e-12


def _world(mesh: sw.Mesh | None) -> int:
    return 1 if mesh is None else mesh.size


def _save_after(step: Any, params: Any, mesh: sw.Mesh | None, batches: list, path: Path) -> list:
    state = step.init(params, mesh)
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(metrics.get("loss_scale"))
    ck.save(path, state, step)
    return history


def _resume(step: Any, mesh: sw.Mesh | None, batches: list, path: Path) -> Any:
    state = ck.load(path, step, mesh)
    return sw.testing.record_history(step, state, batches)


def roundtrip(save_step: Any, save_mesh: Any, load_step: Any, load_mesh: Any, params: Any, batches: list,
              k: int, path: Path) -> Any:
    """Per-rank histories of steps k+1.. after saving at step k on one mesh and loading on the other."""
    sw.launch(functools.partial(_save_after, save_step, params, save_mesh, batches[:k], path), _world(save_mesh))
    return sw.launch(functools.partial(_resume, load_step, load_mesh, batches[k:], path), _world(load_mesh))


def _problem(optimizer: Any = None, widths: tuple[int, ...] = (5, 7, 3, 6), steps: int = 4, batch: int = 24):
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp(list(widths)).double())
    step = sw.train_step(chain, torch.nn.functional.mse_loss, optimizer or sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, widths[0], generator=gen, dtype=torch.float64),
                torch.randn(batch, widths[-1], generator=gen, dtype=torch.float64)) for _ in range(steps)]
    return step, params, batches


def _zero(step: Any, stage: int) -> Any:
    return sw.shard_params(step, "dp", stage=stage)


def _pp(step: Any, **kw: Any) -> Any:
    return sw.pipeline(step, "pp", kw.pop("schedule", "1f1b"), kw.pop("microbatches", 2), **kw)


RESHARDS: dict[str, tuple[Any, Any, Any, Any]] = {
    "dp2-zero3 -> dp4-zero1": (lambda s: _zero(s, 3), sw.Mesh(dp=2), lambda s: _zero(s, 1), sw.Mesh(dp=4)),
    "dp4-zero2 -> single": (lambda s: _zero(s, 2), sw.Mesh(dp=4), lambda s: s, None),
    "single -> dp3-zero3": (lambda s: s, None, lambda s: _zero(s, 3), sw.Mesh(dp=3)),
    "pp2 -> single": (_pp, sw.Mesh(pp=2), lambda s: s, None),
    "single -> pp2": (lambda s: s, None, _pp, sw.Mesh(pp=2)),
    "dp2xpp2-zero3 -> pp2 other partition": (
        lambda s: _pp(_zero(s, 3)),
        sw.Mesh(dp=2, pp=2),
        lambda s: _pp(s, schedule="gpipe", partition=[4, 1]),
        sw.Mesh(pp=2),
    ),
    "pp2 -> dp2xpp3-zero2": (_pp, sw.Mesh(pp=2), lambda s: _pp(_zero(s, 2), stages=3), sw.Mesh(dp=2, pp=3)),
}


@pytest.mark.parametrize("name", list(RESHARDS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_reshard_continues_as_uninterrupted(name: str, optimizer: str, tmp_path: Path) -> None:
    save_t, save_mesh, load_t, load_mesh = RESHARDS[name]
    opt = sw.optim.sgd(0.1, momentum=0.9) if optimizer == "sgd" else sw.optim.adamw(1e-2, weight_decay=0.1)
    step, params, batches = _problem(opt)
    expected = sw.testing.record_history(step, step.init(params), batches)
    per_rank = roundtrip(save_t(step), save_mesh, load_t(step), load_mesh, params, batches, 2, tmp_path / "c")
    sw.testing.compare_histories(per_rank, expected[2:], rtol=RTOL)


class _WithMarker(torch.nn.Module):
    """A linear layer with a 0-element parameter (the device/dtype marker pattern)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        self.marker = torch.nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(self.marker.dtype))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_without_elements_under_zero_is_saved_and_reshards(stage: int, tmp_path: Path) -> None:
    """No rank's shard holds an element of it, yet the checkpoint records it (once): it loads on the
    layout that saved it and on others."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_WithMarker(5, 4), torch.nn.Tanh(), _WithMarker(4, 3)).double()
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(12, 5, generator=gen, dtype=torch.float64),
                torch.randn(12, 3, generator=gen, dtype=torch.float64)) for _ in range(3)]
    expected = sw.testing.record_history(step, step.init(params), batches)
    sw.launch(functools.partial(_save_after, _zero(step, stage), params, sw.Mesh(dp=2), batches[:1], tmp_path / "c"),
              2)
    for load_step, mesh in ((_zero(step, stage), sw.Mesh(dp=2)), (step, None), (_zero(step, 3), sw.Mesh(dp=3))):
        per_rank = sw.launch(functools.partial(_resume, load_step, mesh, batches[1:], tmp_path / "c"), _world(mesh))
        sw.testing.compare_histories(per_rank, expected[1:], rtol=RTOL)


def test_a_load_without_the_optimizer_state_is_caught(tmp_path: Path) -> None:
    """Control: resuming with fresh momentum (what full_params + init gives) diverges, and the
    comparison the tests above use says so."""
    step, params, batches = _problem()
    expected = sw.testing.record_history(step, step.init(params), batches)
    sharded = _zero(step, 3)
    sw.launch(functools.partial(_save_after, sharded, params, sw.Mesh(dp=2), batches[:2], tmp_path / "c"), 2)

    def fresh_momentum() -> Any:
        state = ck.load(tmp_path / "c", sharded, sw.Mesh(dp=2))
        state = state._replace(opt_state=sharded.optimizer.init(state.params))
        return sw.testing.record_history(sharded, state, batches[2:])

    with pytest.raises(sw.testing.NotEquivalentError):
        sw.testing.compare_histories(sw.launch(fresh_momentum, 2), expected[2:], rtol=RTOL)


def test_a_loss_scale_saved_out_of_range_is_refused_at_load(tmp_path: Path) -> None:
    """A loss scale checks its fields when made, also when a load rebuilds it: one saved before
    the checks (here: built around them) is refused with the checkpoint named, not resumed."""
    step, params, _ = _problem()
    mixed = sw.mixed_precision(step, "params=f64,compute=f64", loss_scale="dynamic")
    unchecked = tuple.__new__(sw.precision.DynamicLossScale, (8.0, 2.0, 4.0, 0, 1.0, 0))  # backoff 4, interval 0
    ck.save(tmp_path / "c", mixed.init(params)._replace(loss_scale=unchecked), mixed)
    with pytest.raises(CheckpointError, match=r"carries a loss scale no step can run with.*backoff_factor=4.0"):
        ck.load(tmp_path / "c", mixed)


@pytest.mark.parametrize(("saved", "resumed"), [
    ("bf16", "plain"), ("bf16", "f32"), ("fp16_dynamic", "bf16"), ("fp16_dynamic", "plain"), ("plain", "fp16_dynamic"),
])
def test_a_run_moves_to_another_precision_policy_with_its_parameters_and_moments(
        tmp_path: Path, saved: str, resumed: str) -> None:
    """A checkpoint of a bf16 run (no loss scale: NoLossScale) was refused by a float32 step, and one of an
    fp16 run with a dynamic scale by any step that scales otherwise, naming a loss scale the user never
    chose (V100 -> A100 lost its moments). The parameters and moments are saved unscaled: the resumed step
    goes on with them and its own scale, as the same step started from those values does."""
    step, params, batches = _problem()
    policies = {
        "plain": lambda s: s,
        "f32": lambda s: sw.mixed_precision(s, "params=f64,compute=f64"),
        "bf16": lambda s: sw.mixed_precision(s, "params=f64,compute=bf16,output=f64"),
        "fp16_dynamic": lambda s: sw.mixed_precision(s, "params=f64,compute=f16,output=f64", loss_scale="dynamic"),
    }
    before, after = policies[saved](step), policies[resumed](step)
    state = before.init(params)
    for batch in batches[:2]:
        state, _ = before(state, batch)
    ck.save(tmp_path / "c", state, before)
    loaded = ck.load(tmp_path / "c", after)
    assert loaded.loss_scale == after.initial_loss_scale()
    assert loaded.step == 2
    fresh = after.init(params)._replace(params=state.params, opt_state=state.opt_state, step=state.step)
    for batch in batches[2:]:
        loaded, got = after(loaded, batch)
        fresh, want = after(fresh, batch)
        assert float(got["loss"]) == float(want["loss"])
    assert all(torch.equal(loaded.params[k][n], fresh.params[k][n]) for k in fresh.params for n in fresh.params[k])


def test_dynamic_loss_scale_survives_a_reshard(tmp_path: Path) -> None:
    """The scale grows every 2 finite steps: a load that dropped the count of good steps would
    grow it a step late. All-f64 policy, so the parameters are exact too."""
    step, params, batches = _problem(steps=5)
    scale = sw.precision.DynamicLossScale(scale=8.0, growth_interval=2)
    mixed = sw.mixed_precision(_zero(step, 3), "params=f64,compute=f64", loss_scale=scale)
    target = _pp(sw.mixed_precision(step, "params=f64,compute=f64", loss_scale=scale))
    path = tmp_path / "c"
    sw.launch(functools.partial(_save_after, mixed, params, sw.Mesh(dp=2), batches[:3], path), 2)

    def resume() -> list:
        state = ck.load(path, target, sw.Mesh(pp=2))
        scales = []
        for batch in batches[3:]:
            state, metrics = target(state, batch)
            scales.append(float(metrics["loss_scale"]))
        return [scales, state.loss_scale]

    def uninterrupted() -> list:
        state = target.init(params, sw.Mesh(pp=2))
        scales = []
        for batch in batches:
            state, metrics = target(state, batch)
            scales.append(float(metrics["loss_scale"]))
        return [scales[3:], state.loss_scale]

    resumed, reference = sw.launch(resume, 2)[0], sw.launch(uninterrupted, 2)[0]
    assert resumed == reference
    assert reference[0] != [reference[0][0]] * len(reference[0]), "the scale must change after the save point"
    expected = sw.testing.record_history(step, step.init(params), batches)
    sw.testing.compare_histories(
        roundtrip(mixed, sw.Mesh(dp=2), target, sw.Mesh(pp=2), params, batches, 3, tmp_path / "d"),
        expected[3:],
        rtol=RTOL,
    )


def test_a_resumed_step_keeps_its_own_loss_scale_settings(tmp_path: Path) -> None:
    """Found by session 41's probing: the load took the saved loss scale whole, so a step built with
    StaticLossScale(128) resumed at the saved 4096, and a new dynamic rule (growth 4 every 5 steps) at the saved
    (2 every 2000), without a word. The settings are the step's, as its optimizer's are; a dynamic scale's value
    and count of good steps go on."""
    step, params, batches = _problem()
    policy = "params=f64,compute=f64"
    static = sw.mixed_precision(step, policy, loss_scale=4096.0)
    ck.save(tmp_path / "s", static.init(params), static)
    resumed = sw.mixed_precision(step, policy, loss_scale=128.0)
    assert ck.load(tmp_path / "s", resumed).loss_scale == sw.precision.StaticLossScale(128.0)
    saved_rule = sw.precision.DynamicLossScale(scale=64.0, growth_interval=2000)
    dynamic = sw.mixed_precision(step, policy, loss_scale=saved_rule)
    state = dynamic.init(params)
    for batch in batches[:2]:
        state, _ = dynamic(state, batch)
    ck.save(tmp_path / "d", state, dynamic)
    new_rule = sw.precision.DynamicLossScale(scale=8.0, growth_factor=4.0, growth_interval=5, min_scale=1.0)
    loaded = ck.load(tmp_path / "d", sw.mixed_precision(step, policy, loss_scale=new_rule)).loss_scale
    assert loaded == new_rule._replace(scale=64.0, good_steps=2)


def _stack(draw: st.DrawFn, kind: str) -> tuple[Any, sw.Mesh]:
    if kind == "dp":
        return draw(sst.transform_stacks(axis="dp")), sw.Mesh(dp=draw(st.sampled_from([1, 2, 3])))
    if kind == "pp":
        return sst.TransformStack((("pipeline", draw(sst.pipeline_options("pp"))),)), sw.Mesh(pp=2)
    return draw(sst.transform_stacks(axis="dp", pp="pp")), sw.Mesh(dp=2, pp=2)


@st.composite
def _reshards(draw: st.DrawFn) -> tuple:
    kinds = ["dp", "pp", "dp x pp"]
    save = _stack(draw, draw(st.sampled_from(kinds)))
    load = _stack(draw, draw(st.sampled_from(kinds)))
    return save, load


@settings(max_examples=8)
@given(problem=sst.problems(max_steps=1), reshard=_reshards(), k=st.integers(1, 2))
def test_drawn_reshards_continue_exactly(problem: sst.Problem, reshard: tuple, k: int, tmp_path_factory: Any) -> None:
    (save_stack, save_mesh), (load_stack, load_mesh) = reshard
    assume(len(problem.step.chain) >= 2)  # a pipeline of two stages needs two layers
    micro = math.lcm(save_stack.microbatches, load_stack.microbatches)
    batches = sst.batches(problem.case.widths[0], problem.case.widths[-1],
                          problem.per_rank_batch * math.lcm(save_mesh.size, load_mesh.size) * micro,
                          k + 2, problem.case.dtype, problem.seed)
    expected = sw.testing.record_history(problem.step, problem.step.init(problem.params), batches)
    path = tmp_path_factory.mktemp("ckpt") / "c"
    per_rank = roundtrip(save_stack.apply(problem.step), save_mesh, load_stack.apply(problem.step), load_mesh,
                         problem.params, batches, k, path)
    sw.testing.compare_histories(per_rank, expected[k:], rtol=RTOL)


def test_async_save_commits_on_wait_and_the_next_save_waits(tmp_path: Path) -> None:
    step, params, batches = _problem()
    sharded = _zero(step, 3)
    expected = sw.testing.record_history(step, step.init(params), batches)

    def main() -> Any:
        state = sharded.init(params, sw.Mesh(dp=2))
        state, _ = sharded(state, batches[0])
        ck.save(tmp_path / "a", state, sharded, blocking=False)
        state, _ = sharded(state, batches[1])  # training goes on while the files are written
        second = ck.save(tmp_path / "b", state, sharded, blocking=False)
        committed_first = (tmp_path / "a" / "COMMITTED").is_file()  # the second save waited for it
        second.wait()
        return committed_first, second.wait()

    outcomes = sw.launch(main, 2)
    assert all(ok for ok, _ in outcomes) and outcomes[0][1] == tmp_path / "b"
    for name, done in (("a", 1), ("b", 2)):
        per_rank = sw.launch(functools.partial(_resume, sharded, sw.Mesh(dp=2), batches[done:], tmp_path / name), 2)
        sw.testing.compare_histories(per_rank, expected[done:], rtol=RTOL)


def test_a_load_waits_for_this_ranks_save_to_its_path_still_under_way(tmp_path: Path) -> None:
    """load(path) right after save(path, ..., blocking=False) loads that save: the first one (not
    "interrupted"), and one replacing an older checkpoint (not the older one)."""
    step, params, batches = _problem()
    sharded = _zero(step, 3)

    (tmp_path / "x").mkdir()

    def main() -> list[int]:
        state = sharded.init(params, sw.Mesh(dp=2))
        steps = []
        for batch in batches[:2]:
            state, _ = sharded(state, batch)
            ck.save(tmp_path / "c", state, sharded, blocking=False, overwrite=True)
            spelled = tmp_path / "c" if not steps else tmp_path / "x" / ".." / "c"  # the same path spelled otherwise
            steps.append(ck.load(spelled, sharded, sw.Mesh(dp=2)).step)
        return steps

    assert sw.launch(main, 2) == [[1, 2], [1, 2]]


@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=4), data=st.data())
def test_boxes_cover_a_flat_range_exactly_once_in_order(shape: list[int], data: st.DataObject) -> None:
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    flat = torch.arange(n).reshape(shape)
    got = []
    for offsets, sizes in boxes(tuple(shape), start, stop):
        box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert box.reshape(-1)[0].item() == flat_start(tuple(shape), offsets) if box.numel() else True
        got += box.reshape(-1).tolist()
    assert got == list(range(start, stop))
    assert len(boxes(tuple(shape), start, stop)) <= max(1, 2 * len(shape) - 1)
