"""remat on whole steps: exact for every policy, composes with shard_params and pipeline, saves memory.

Exactness is bitwise (``torch.equal``): remat reruns the same kernels in the
same order on the same values, and the cross-rank reductions of a distributed
step are the same with and without it, so no tolerance is needed anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.testing import strategies as sst
from shardwise.testing.models import TinyGPT
from shardwise.transforms.remat import (
    Remat,
    dots_saveable,
    everything_saveable,
    nothing_saveable,
    offload_to_cpu,
    remat,
    save_only_these_names,
    saved_bytes,
)


@dataclass(frozen=True)
class SaveNothingSelectively:
    """A selective policy (torch's selective checkpoint, asked op by op) that saves nothing. These models
    tag no value, so save_only_these_names("h") was this, silently; it is refused now (test_remat_names.py
    runs it on a model that tags)."""

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return False


POLICIES = [
    nothing_saveable,
    dots_saveable,
    everything_saveable,
    SaveNothingSelectively(),
    offload_to_cpu(),
    offload_to_cpu(dots_saveable),
]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _history(step: sw.Step, params: Any, batches: list[Any]) -> tuple[list[torch.Tensor], Any]:
    state = step.init(params)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return losses, state.params


def _distributed_history(step: sw.Step, mesh: sw.Mesh, params: Any, batches: list[Any]) -> list[Any]:
    def main() -> tuple[list[torch.Tensor], Any]:
        state = step.init(params, mesh)
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        return losses, step.full_params(state)

    return sw.launch(main, mesh.size)


def _assert_bitwise_equal(got: Any, expected: Any) -> None:
    got_leaves, got_spec = optree.tree_flatten(got)
    want_leaves, want_spec = optree.tree_flatten(expected)
    assert got_spec == want_spec
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"leaf {i} differs: max |diff| {(a - b).abs().max()}"


def _gpt(dtype: torch.dtype, vocab: int = 32, d_model: int = 16, seq_len: int = 8) -> tuple[sw.Step, Any, list[Any]]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, d_model=d_model, n_heads=2, n_layers=2, seq_len=seq_len, tie_weights=False).to(dtype)
    chain, params = sw.functionalize(model, units=["tok_emb", "blocks", "head"])
    step = sw.train_step(chain, _lm_loss, sw.optim.sgd(lr=0.5, momentum=0.9))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(vocab, (4, seq_len), generator=gen), torch.randint(vocab, (4, seq_len), generator=gen))
        for _ in range(3)
    ]
    return step, params, batches


# -- exactness -----------------------------------------------------------------------------


@settings(max_examples=6)
@given(
    case=sst.chains(max_depth=3, dtype=torch.float64) | sst.chains(max_depth=3, dtype=torch.float32),
    policy=st.sampled_from(POLICIES),
    every=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_remat_is_exact_on_drawn_mlps(case: sst.ChainCase, policy: Any, every: int, seed: int) -> None:
    step = sw.train_step(case.chain, F.mse_loss, sw.optim.sgd(lr=0.1, momentum=0.9))
    batches = sst.batches(case.widths[0], case.widths[-1], 4, 3, case.dtype, seed)
    _assert_bitwise_equal(
        _history(remat(step, policy, every=every), case.params, batches), _history(step, case.params, batches)
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_remat_is_exact_on_tiny_gpt(dtype: torch.dtype, policy: Any) -> None:
    step, params, batches = _gpt(dtype)
    _assert_bitwise_equal(_history(remat(step, policy), params, batches), _history(step, params, batches))


@pytest.mark.parametrize("policy", [nothing_saveable, dots_saveable], ids=repr)
def test_remat_composes_with_zero3_exactly(policy: Any) -> None:
    step, params, batches = _gpt(torch.float64)
    sharded = sw.shard_params(step, "dp", stage=3)
    rematted = remat(sharded, policy)
    assert rematted.sharding_spec == sharded.sharding_spec and rematted.sharding_spec.stage == 3
    mesh = sw.Mesh(dp=2)
    _assert_bitwise_equal(
        _distributed_history(rematted, mesh, params, batches), _distributed_history(sharded, mesh, params, batches)
    )
    # and remat applied before shard_params is the same step
    _assert_bitwise_equal(
        _distributed_history(sw.shard_params(remat(step, policy), "dp", stage=3), mesh, params, batches),
        _distributed_history(sharded, mesh, params, batches),
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("policy", [nothing_saveable, dots_saveable], ids=repr)
def test_remat_composes_with_pipeline_exactly(schedule: str, policy: Any) -> None:
    """zb_h1 splits backward into an input and a weight pass: each recomputes the layer."""
    step, params, batches = _gpt(torch.float64)
    piped = sw.pipeline(step, "pp", schedule, 2)
    rematted = remat(piped, policy)
    assert rematted.pipeline_spec == piped.pipeline_spec and rematted.pipeline_spec.schedule == schedule
    mesh = sw.Mesh(pp=2)
    _assert_bitwise_equal(
        _distributed_history(rematted, mesh, params, batches), _distributed_history(piped, mesh, params, batches)
    )
    _assert_bitwise_equal(
        _distributed_history(sw.pipeline(remat(step, policy), "pp", schedule, 2), mesh, params, batches),
        _distributed_history(piped, mesh, params, batches),
    )


def test_remat_passes_the_equivalence_checker_with_zero_tolerance_where_no_reduction_differs() -> None:
    step, params, batches = _gpt(torch.float64)
    sw.testing.assert_equivalent(remat(step, dots_saveable), step, sw.Mesh(dp=1), batches, params, rtol=0.0)


# -- memory --------------------------------------------------------------------------------


def test_saved_bytes_on_tiny_gpt() -> None:
    step, params, _ = _gpt(torch.float32, vocab=1024, d_model=64, seq_len=32)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(1024, (4, 32), generator=gen)
    batch = (idx, idx.roll(-1, 1))
    plain = saved_bytes(step, params, batch)
    full = saved_bytes(remat(step, nothing_saveable), params, batch)
    dots = saved_bytes(remat(step, dots_saveable), params, batch)
    every = saved_bytes(remat(step, everything_saveable), params, batch)
    activation = 4 * 32 * 64 * 4  # one (batch, time, d_model) float32 tensor
    assert plain == {"tok_emb": 4 * 32 * 8, "blocks.0": 531456, "blocks.1": 531456, "head": 66560}
    assert full == {"tok_emb": 4 * 32 * 8, "blocks.0": activation, "blocks.1": activation, "head": activation}
    assert sum(plain.values()) >= 3 * sum(full.values())
    assert every == plain
    for name in ("blocks.0", "blocks.1"):
        assert full[name] < dots[name] < plain[name]
    assert sum(full.values()) < sum(dots.values()) < sum(plain.values())


def test_remat_every_and_patterns_pick_layers() -> None:
    step, _, _ = _gpt(torch.float32)

    def picked(s: sw.Step) -> list[str]:
        return [layer.name for layer in s.chain if isinstance(layer.fn, Remat)]

    assert picked(remat(step)) == ["tok_emb", "blocks.0", "blocks.1", "head"]
    assert picked(remat(step, every=2)) == ["tok_emb", "blocks.1"]
    assert picked(remat(step, layers="blocks.*")) == ["blocks.0", "blocks.1"]
    assert picked(remat(step, layers="blocks.*", every=2)) == ["blocks.0"]
    assert picked(remat(step, layers=["head", "tok_*"])) == ["tok_emb", "head"]
    assert picked(remat(step, "dots_saveable")) == list(step.chain.names)
    assert remat(step).chain["head"].ties == step.chain["head"].ties


# -- errors ----------------------------------------------------------------------------------


def test_errors_name_the_problem_and_the_fix() -> None:
    step, _, _ = _gpt(torch.float32)
    with pytest.raises(ValueError, match=r"unknown policy; choose one of \['dots_saveable'"):
        remat(step, "dots")
    with pytest.raises(TypeError, match="unknown policy"):
        remat(step, 3)
    with pytest.raises(TypeError, match=r"call it: policy=save_only_these_names\(...\)"):
        remat(step, save_only_these_names)
    with pytest.raises(ValueError, match="remat was applied twice"):
        remat(remat(step, layers="head"), dots_saveable, layers="blocks.*")
    with pytest.raises(ValueError, match="remat was applied twice"):
        remat(sw.shard_params(remat(step), "dp", stage=3))
    with pytest.raises(ValueError, match=r"matches no layer; the chain's layers are \['tok_emb'"):
        remat(step, layers="block.*")
    with pytest.raises(ValueError, match="every is an int >= 1"):
        remat(step, every=0)
    with pytest.raises(TypeError, match="needs a shardwise Step"):
        remat(step.chain)  # type: ignore[type-var]
