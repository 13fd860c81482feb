"""ZeRO-1/2 under a precision policy that narrows hold only their master shards, as ZeRO-3 does.

They held every rank's whole parameters in the master dtype, cast whole compute copies of them each
step and all-gathered the updated shards in the master dtype: more than float32 ZeRO-2 itself (407.9
against 371.4 MiB a rank on benchmarks/memory.py's 200 MB model at world 4). Now the state holds this
rank's flat shard of every unit (1/world of the floats), and each step gathers every unit in the
compute dtype before its first forward and frees it after its last backward. Stage 1 still reduces
the gradients once after the backward, stage 2 in buckets as it ends.

The numbers compare with the single-device step under the same policy. ``params=f64,compute=f32``
narrows too, and keeps the comparison at float32 rounding: each rank's float32 gradient over its part
of the batch is summed in float64, where one device rounds the whole batch's once (2^-24 relative
each), and AdamW's update divides by a moment that carries it, so 1e-5 of the layer's largest
parameter. Under bf16 and fp16 the roundings are 2^-9 and 2^-12 and grow the same way over three
AdamW steps: 2^-6 and 2^-8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp

KIB = 2**-10  # bucket_mb of one KiB: a bucket per layer or two


def _problem(dtype: torch.dtype = torch.float64) -> tuple[Any, dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 16, 5]).to(dtype))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=dtype), torch.randn(8, 5, generator=gen, dtype=dtype))
               for _ in range(3)]
    return chain, params, batches


def _base(chain: Any) -> sw.Step:
    return sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.adamw(1e-2, weight_decay=0.1), clip_norm=0.5)


POLICIES = {  # policy -> (dtype of the given params, loss scale, rtol against one device)
    "params=f64,compute=f32,output=f64": (torch.float64, None, 1e-5),
    "params=f32,compute=bf16,output=f32": (torch.float32, None, 2**-6),
    "params=f32,compute=f16,output=f32": (torch.float32, "dynamic", 2**-8),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_matches_the_single_device_step_under_the_policy(policy: str, stage: int, world: int) -> None:
    """Two micro-batches, gradient clipping, AdamW, three steps; buckets of a layer or two."""
    dtype, loss_scale, rtol = POLICIES[policy]
    chain, params, batches = _problem(dtype)
    reference = sw.mixed_precision(_base(chain), policy, loss_scale=loss_scale)
    sharded = sw.shard_params(reference, "dp", stage, accumulation=2, bucket_mb=KIB)
    report = sw.testing.assert_equivalent(sharded, reference, sw.Mesh(dp=world), batches, params, rtol=rtol)
    assert max(report.max_rel_err) > 0  # the roundings really differ: the comparison is not vacuous


@pytest.mark.parametrize("stage", [1, 2])
def test_the_state_holds_one_shard_of_every_unit(stage: int) -> None:
    """Each rank holds its flat shard of every unit, 1/world of the floats: together the model once."""
    chain, params, batches = _problem(torch.float32)
    step = sw.shard_params(sw.mixed_precision(_base(chain), "params=f32,compute=bf16"), "dp", stage)
    unit_numel = {layer: sum(t.numel() for t in ts.values()) for layer, ts in params.items() if ts}

    def rank() -> dict[str, torch.Tensor]:
        state = step.init(params, sw.Mesh(dp=4))
        state, _ = step(state, batches[0])
        return dict(state.params)

    for shards in sw.launch(rank, 4):
        assert {u: (t.shape, t.dtype) for u, t in shards.items()} == {
            u: (torch.Size([-(-n // 4)]), torch.float32) for u, n in unit_numel.items()}
    plan = step.plan(sw.Mesh(dp=4), params)
    assert plan.memory["params"][0] == 4 * sum(-(-n // 4) for n in unit_numel.values())
    assert {w.dtype for a in plan.for_rank(0) if a.kind == "gather" for w in a.wire} == {"bfloat16"}
    assert plan.count("gather_params", rank=0) == 0


def test_a_policy_that_does_not_narrow_keeps_whole_parameters() -> None:
    """float32 alone, or compute in the stored dtype: whole parameters at rest, gathered at the end."""
    chain, params, batches = _problem(torch.float32)
    for step in (sw.shard_params(_base(chain), "dp", 2),
                 sw.shard_params(sw.mixed_precision(_base(chain), "params=f32,compute=f32"), "dp", 2)):
        def rank(step: sw.Step = step) -> dict[str, Any]:
            state, _ = step(step.init(params, sw.Mesh(dp=2)), batches[0])
            return dict(state.params)

        held = sw.launch(rank, 2)[0]
        assert {n: t.shape for n, t in held["0"].items()} == {n: t.shape for n, t in params["0"].items()}
        assert step.plan(sw.Mesh(dp=2), params).count("gather", rank=0) == 0


def _save_steps(step: sw.Step, params: dict[str, Any], batches: list[Any], mesh: sw.Mesh | None,
                path: Path) -> None:
    def rank() -> None:
        state = step.init(params, mesh)
        for batch in batches[:2]:
            state, _ = step(state, batch)
        sw.checkpoint.save(path, state, step)

    sw.launch(rank, 1 if mesh is None else mesh.size)


def _loaded(step: sw.Step, mesh: sw.Mesh | None, path: Path, batch: Any) -> tuple[dict[str, torch.Tensor], float]:
    """(rank 0's full state dict of the loaded state, the loss of a step from it)."""
    def rank() -> tuple[dict[str, torch.Tensor], float]:
        state = sw.checkpoint.load(path, step, mesh)
        full = sw.checkpoint.full_state_dict(step, state)
        _, metrics = step(state, batch)
        return full, float(metrics["loss"])

    return sw.launch(rank, 1 if mesh is None else mesh.size)[0]


def test_checkpoints_move_between_layouts(tmp_path: Path) -> None:
    """Saved by bf16 ZeRO-2 (shards at rest), loaded by ZeRO-3, by one device and by float32 ZeRO-2
    (whole parameters at rest), and the other way: the same weights, and the same next step."""
    chain, params, batches = _problem(torch.float32)
    base = _base(chain)
    bf16 = sw.mixed_precision(base, "params=f32,compute=bf16,output=f32")
    zero2 = sw.shard_params(bf16, "dp", 2, bucket_mb=KIB)
    _save_steps(zero2, params, batches, sw.Mesh(dp=2), tmp_path / "bf16_zero2")
    saved, loss = _loaded(zero2, sw.Mesh(dp=2), tmp_path / "bf16_zero2", batches[2])
    for step, mesh in ((sw.shard_params(bf16, "dp", 3), sw.Mesh(dp=4)), (bf16, None),
                       (sw.shard_params(bf16, "dp", 1), sw.Mesh(dp=4))):
        full, other = _loaded(step, mesh, tmp_path / "bf16_zero2", batches[2])
        assert full.keys() == saved.keys() and all(torch.equal(full[k], saved[k]) for k in saved)
        assert other == pytest.approx(loss, rel=2**-7)  # the batch cut another way: bf16 roundings
    # Whole parameters at rest, as bf16 ZeRO-2 held them before (a policy, for the loss scale it saves)
    f32 = sw.shard_params(sw.mixed_precision(base, "params=f32,compute=f32"), "dp", 2)
    full, _ = _loaded(f32, sw.Mesh(dp=2), tmp_path / "bf16_zero2", batches[2])
    assert all(torch.equal(full[k], saved[k]) for k in saved)
    _save_steps(f32, params, batches, sw.Mesh(dp=2), tmp_path / "f32_zero2")
    want, _ = _loaded(f32, sw.Mesh(dp=2), tmp_path / "f32_zero2", batches[2])
    full, _ = _loaded(zero2, sw.Mesh(dp=4), tmp_path / "f32_zero2", batches[2])
    assert all(torch.equal(full[k], want[k]) for k in want)


def test_full_state_dict_is_the_given_model_after_init() -> None:
    chain, params, _ = _problem(torch.float32)
    step = sw.shard_params(sw.mixed_precision(_base(chain), "params=f32,compute=bf16"), "dp", 2)
    module = mlp([6, 16, 16, 5])
    module.load_state_dict({f"{layer}.{n}": t for layer, ts in params.items() for n, t in ts.items()})

    def rank() -> dict[str, torch.Tensor]:
        return sw.checkpoint.full_state_dict(step, step.init(params, sw.Mesh(dp=4)))

    for full in sw.launch(rank, 4):
        assert full.keys() == module.state_dict().keys()
        assert all(torch.equal(full[k], v) for k, v in module.state_dict().items())


def test_options_of_the_end_of_step_gather_are_refused_under_a_narrowing_policy() -> None:
    chain, params, _ = _problem(torch.float32)
    bf16 = sw.mixed_precision(_base(chain), "params=f32,compute=bf16")
    for option in ("overlap_gather", "update_in_buckets"):
        step = sw.shard_params(bf16, "dp", 2, **{option: True})
        with pytest.raises(ValueError, match=f"{option}=True.*no all-gather of the updated parameters"):
            step.plan(sw.Mesh(dp=2), params)
    # Stating what happens is accepted: nothing overlaps, no update by buckets.
    sw.shard_params(bf16, "dp", 2, overlap_gather=False, update_in_buckets=False).plan(sw.Mesh(dp=2), params)


@pytest.mark.parametrize("stage", [1, 2])
def test_keeping_and_prefetching_mean_what_the_layout_does(stage: int) -> None:
    """The shards-at-rest layout gathers every unit before its first forward and keeps it to its last
    backward: reshard_after_forward=False and prefetch= state or shape that and are accepted (they were
    refused as "nothing to gather"), True, which would not happen, is refused naming stage 3 (it was
    accepted and did nothing). Under a policy that does not narrow, nothing is gathered, as before."""
    chain, params, batches = _problem(torch.float32)
    policy = "params=f32,compute=bf16,output=f32"
    bf16 = sw.mixed_precision(_base(chain), policy)
    mesh = sw.Mesh(dp=2)
    with pytest.raises(ValueError, match=r"reshard_after_forward=True\) under a precision policy .*use stage=3"):
        sw.shard_params(bf16, "dp", stage, reshard_after_forward=True).plan(mesh, params)
    kept = sw.shard_params(bf16, "dp", stage, reshard_after_forward=False, prefetch=2)
    default = sw.shard_params(bf16, "dp", stage)
    assert str(kept.plan(mesh, params).for_rank(0)) != str(default.plan(mesh, params).for_rank(0))  # prefetch 2
    reference = sw.mixed_precision(_base(chain), policy)
    sw.testing.assert_equivalent(kept, reference, mesh, batches, params, rtol=2**-6)
    # Applied after shard_params, the policy decides the same.
    later = sw.mixed_precision(sw.shard_params(_base(chain), "dp", stage, reshard_after_forward=True), policy)
    with pytest.raises(ValueError, match=r"reshard_after_forward=True\) under a precision policy"):
        later.plan(mesh, params)
    f32 = sw.shard_params(_base(chain), "dp", stage, prefetch=2)
    with pytest.raises(ValueError, match=r"prefetch=2\): stage \d holds whole parameters here"):
        f32.plan(mesh, params)
