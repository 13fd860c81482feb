"""engine/torch_api.written_tensors reads torch's private op schemas: fails loudly where torch changes them."""

from __future__ import annotations

import torch

from shardwise.engine.torch_api import written_tensors


def test_the_tensors_an_op_writes_into_are_read_from_its_schema() -> None:
    a, b, out = torch.ones(3), torch.ones(3), torch.empty(3)
    aten = torch.ops.aten
    assert [t is a for t in written_tensors(aten.add_.Tensor, (a, b), {})] == [True]
    assert [t is out for t in written_tensors(aten.add.out, (a, b), {"out": out})] == [True]
    assert written_tensors(aten.add.Tensor, (a, b), {}) == []
    assert [t is a for t in written_tensors(aten.relu_.default, (a,), {})] == [True]
    assert written_tensors(aten.mm.default, (a.view(3, 1), b.view(1, 3)), {}) == []
    assert written_tensors(object(), (a,), {}) == []  # an op without a schema (a higher-order op's) writes nothing
