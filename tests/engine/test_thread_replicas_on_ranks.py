"""A ThreadReplicas made on a rank thread (a transform applied inside each rank's function, whose rebuilt
chain the other ranks reuse) is shared by ranks that run at once: a rank copying the module while another is
inside a call copied that rank's tensors swapped into it (tensor_parallel built in each rank: a meta tensor of
the other rank's prediction in layer 'head', or its values, silently). Made deterministic here: rank 0 calls
and holds its call open until rank 1 has made its copy."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.collectives.backends.current import current_backend
from shardwise.collectives.launch import launch
from shardwise.engine.model.module_call import ThreadReplicas

_inside = threading.Event()  # rank 0 is inside its call, its tensors swapped into the module it calls
_copied = threading.Event()  # rank 1 has its copy


class _HeldOpen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if current_backend().rank == 0:
            _inside.set()
            assert _copied.wait(30), "rank 1 never made its copy"
        return self.lin(x)


def _tensors(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return {"lin.weight": torch.randn(2, 3, generator=gen), "lin.bias": torch.randn(2, generator=gen)}


def test_a_rank_copies_the_module_clean_while_the_rank_that_made_it_is_inside_a_call() -> None:
    made: list[ThreadReplicas] = []
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(9))

    def main() -> torch.Tensor:
        rank = current_backend().rank
        if rank == 0:
            made.append(ThreadReplicas(_HeldOpen()))
            return made[0].get()(_tensors(0), x)
        assert _inside.wait(30), "rank 0 never called"
        call = made[0].get()
        _copied.set()
        held = [*call.module.parameters(), *call.module.buffers()]
        assert all(t.is_meta for t in held), "rank 1's copy holds rank 0's tensors, swapped in while it copied"
        return call(_tensors(1), x)

    _inside.clear()
    _copied.clear()
    out = launch(main, 2, timeout=8.0)
    for rank in (0, 1):
        t = _tensors(rank)
        assert torch.equal(out[rank], F.linear(x, t["lin.weight"], t["lin.bias"]))
