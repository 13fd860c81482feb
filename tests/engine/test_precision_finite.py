"""The finite check a mixed-precision step skips its update on (``layout.precision.all_finite``).

It reads each gradient's largest magnitude from one multi-tensor kernel, so it relies on that
kernel's max propagating a NaN. These tests pin that on every device this machine has (a CUDA
run checks the accelerator's kernel, whose tensors it splits into chunks: the non-finite value
sits in the first, a middle and the last chunk of a tensor larger than several of them).
"""

from __future__ import annotations

import pytest
import torch

from shardwise.engine.layout.precision import all_finite

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
LONG = 5 * 65536 + 17  # several of the CUDA multi-tensor kernel's 65536-element chunks


def _grads(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(3,), (LONG,), (0,), (7, 5), (1,)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_gradients_read_finite_even_at_the_dtypes_largest_value(device: str, dtype: torch.dtype) -> None:
    grads = _grads(device, dtype)
    grads[1][LONG // 2] = torch.finfo(dtype).max  # finite; a sum of such values would overflow
    grads[1][LONG // 2 + 1] = torch.finfo(dtype).max
    grads[3][2, 2] = -torch.finfo(dtype).max
    flag = all_finite(grads)
    assert flag.dtype == torch.float64 and flag.shape == () and flag.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("where", [(0, 1), (1, 0), (1, 3 * 65536 + 5), (1, LONG - 1), (3, 34), (4, 0)])
def test_one_non_finite_element_anywhere_reads_not_finite(
    device: str, dtype: torch.dtype, bad: str, where: tuple[int, int]
) -> None:
    grads = _grads(device, dtype)
    tensor, index = where
    grads[tensor].view(-1)[index] = BAD[bad]
    assert all_finite(grads).item() == 0.0
    grads[tensor].view(-1)[index] = 0.5
    assert all_finite(grads).item() == 1.0  # and the same list without it reads finite again


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_and_empty_lists(device: str) -> None:
    grads = [torch.ones(4, device=device, dtype=d) for d in DTYPES]
    assert all_finite(grads).item() == 1.0
    grads[1][3] = float("nan")  # a NaN in bf16 beside finite values of wider dtypes
    assert all_finite(grads).item() == 0.0
    assert all_finite([]).item() == 1.0
    assert all_finite([torch.empty(0, device=device)]).item() == 1.0  # an empty shard has nothing to check
    assert all_finite([], device=torch.device(device)).device.type == device


@pytest.mark.parametrize("device", DEVICES)
def test_complex_gradients_read_by_their_parts_and_integers_as_finite(device: str) -> None:
    """A complex value whose parts are finite but whose magnitude overflows is finite; one with an
    infinite or NaN part is not. Integer and bool tensors hold no non-finite value."""
    big = torch.tensor([3e38 + 3e38j, 1 + 1j], dtype=torch.complex64, device=device)
    assert all_finite([big]).item() == 1.0
    for bad in (complex(float("inf"), 0.0), complex(0.0, float("nan"))):
        z = big.clone()
        z[1] = bad
        assert all_finite([z, torch.ones(2, device=device)]).item() == 0.0
    ints = [torch.arange(3, device=device), torch.ones(2, dtype=torch.bool, device=device)]
    assert all_finite(ints).item() == 1.0
    assert all_finite([*ints, torch.tensor([float("nan")], device=device)]).item() == 0.0
