"""A complex parameter under mixed_precision: a policy's dtypes are real, and casting a complex
tensor to one drops its imaginary part (torch only warns), so it is refused, naming it; held as a
real pair (``torch.view_as_real``), the same filter trains under a policy as on one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw


class SpectralFilter(nn.Module):
    """A learnable filter in the frequency domain (FNO, GFNet): a complex weight per frequency."""

    def __init__(self, n: int, as_pairs: bool = False) -> None:
        super().__init__()
        w = torch.randn(n // 2 + 1, dtype=torch.cfloat)
        self.as_pairs = as_pairs
        self.w = nn.Parameter(torch.view_as_real(w).clone() if as_pairs else w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.view_as_complex(self.w.float()) if self.as_pairs else self.w
        return torch.fft.irfft(torch.fft.rfft(x.float(), dim=-1) * w, n=x.shape[-1], dim=-1)


def _setup(as_pairs: bool) -> tuple[sw.Step, dict, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SpectralFilter(8, as_pairs), nn.Linear(8, 2))
    chain, params = sw.functionalize(model)
    step = sw.train_step(chain, nn.functional.mse_loss, sw.optim.sgd(0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)) for _ in range(2)]
    return step, params, batches


@pytest.mark.parametrize("policy", ["params=f32,compute=f32,output=f32", "params=f32,compute=bf16,output=f32"])
def test_a_complex_parameter_is_refused_under_a_policy(policy: str) -> None:
    step, params, batches = _setup(as_pairs=False)
    mixed = sw.mixed_precision(step, policy, overrides={"1": "params=f32,compute=f32,output=f32"})
    with pytest.raises(ValueError, match=r"layer '1' has the complex parameter 'w' \(torch.complex64\).*view_as_real"):
        mixed.init(params)
    zero3 = sw.shard_params(mixed, "dp", stage=3)
    with pytest.raises(ValueError, match="complex parameter 'w'"):
        zero3.plan(sw.Mesh(dp=2), params, batches[0])
    with pytest.raises(sw.collectives.RankFailed, match="complex parameter 'w'"):
        sw.launch(lambda: zero3.init(params, sw.Mesh(dp=2)), world=2)


def test_complex_parameters_train_without_a_policy_and_as_real_pairs_under_one() -> None:
    step, params, batches = _setup(as_pairs=False)
    zero3 = sw.shard_params(step, "dp", stage=3)
    sw.testing.assert_equivalent(zero3, step, sw.Mesh(dp=2), batches, params)
    step, params, batches = _setup(as_pairs=True)
    f32 = sw.mixed_precision(step, "params=f32,compute=f32,output=f32")
    sw.testing.assert_equivalent(sw.shard_params(f32, "dp", stage=3), step, sw.Mesh(dp=2), batches, params)
