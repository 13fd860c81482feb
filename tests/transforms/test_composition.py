"""All four transforms on one dp=2 x pp=2 mesh, in orders where the order should not matter.

The reference is the single-device step with the same precision policy. With a
bf16 policy the distributed step rounds gradients per rank and per
micro-batch where the reference rounds the whole-batch gradient once, so
gradient-derived values may differ by the rounding of a few bf16 sums:
2^-8 relative per rounding, and gradients are accumulated over 2 data-parallel
ranks x 2 micro-batches (up to 4 x 2^-9 = 2^-7 of the gradient), hence rtol = 2^-6 here; the
worst seen over three steps is 2.3e-3. remat changes nothing (it is
exact), and in float64 with f64 compute the whole stack agrees to 1e-12.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.testing.models import mlp


def _problem(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    chain, params = sw.functionalize(mlp([6, 16, 12, 10, 3], "gelu").to(dtype))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen, dtype=dtype), torch.randn(8, 3, generator=gen, dtype=dtype))
               for _ in range(3)]
    step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9), clip_norm=1.0)
    return step, params, batches


ORDERS = {
    "mp(remat(pp(shard)))": lambda s, p: sw.mixed_precision(
        sw.remat(sw.pipeline(sw.shard_params(s, "dp", 3), "pp", "1f1b", 2)), p),
    "shard(pp(remat(mp)))": lambda s, p: sw.shard_params(
        sw.pipeline(sw.remat(sw.mixed_precision(s, p)), "pp", "1f1b", 2), "dp", 3),
    "remat(shard(mp(pp)))": lambda s, p: sw.remat(
        sw.shard_params(sw.mixed_precision(sw.pipeline(s, "pp", "1f1b", 2), p), "dp", 3)),
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_all_four_in_float64_are_exact_to_1e12(order: str) -> None:
    step, params, batches = _problem(torch.float64)
    composed = ORDERS[order](step, "params=f64,compute=f64,output=f64,reduce=f64")
    reference = sw.mixed_precision(step, "params=f64,compute=f64,output=f64,reduce=f64")
    sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=2, pp=2), batches, params, rtol=1e-12)


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_all_four_in_bf16_match_the_single_device_bf16_step(order: str) -> None:
    step, params, batches = _problem(torch.float32)
    composed = ORDERS[order](step, "compute=bf16")
    reference = sw.mixed_precision(step, "compute=bf16")
    report = sw.testing.assert_equivalent(composed, reference, sw.Mesh(dp=2, pp=2), batches, params, rtol=2**-6)
    assert max(report.max_rel_err) > 0


def test_orders_agree_with_each_other_exactly() -> None:
    """Where the order should not matter it does not: the composed steps run the same computation."""
    step, params, batches = _problem(torch.float32)
    mesh = sw.Mesh(dp=2, pp=2)
    results = []
    for order in sorted(ORDERS):
        composed = ORDERS[order](step, "compute=bf16")

        def run(composed: sw.Step = composed) -> list:
            state = composed.init(params, mesh)
            for b in batches:
                state, _ = composed(state, b)
            full = composed.full_params(state)
            return [t for layer in full.values() for t in layer.values()]

        results.append(sw.launch(run, 4)[0])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_a_composition_that_cannot_work_is_refused() -> None:
    step, _, _ = _problem(torch.float32)
    with pytest.raises(ValueError, match="applied twice"):
        sw.remat(sw.remat(step))
    with pytest.raises(ValueError, match="mixed_precision was applied twice"):
        sw.mixed_precision(sw.shard_params(sw.mixed_precision(step), "dp"))
    with pytest.raises(ValueError, match="both use axis 'pp'"):
        sw.shard_params(sw.pipeline(step, "pp"), "pp")
