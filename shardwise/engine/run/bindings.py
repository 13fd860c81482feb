"""A one-device step's layers bound to their parameter leaves, kept from one step to the next.

The executor binds every layer of a stage to the step's leaves (``tensor.detach().requires_grad_()``
of each parameter) once per step: a few microseconds a layer, a visible share of a small model's
step. An in-place optimizer hands the next step the same parameter tensors, so the same leaves
and bound calls serve it too, once their ``.grad`` is emptied: the forward records the same
tensors, and the backward writes fresh gradients into empty ``.grad`` as before, so the step
computes the same bits. They are kept only where nothing else reads the leaves: one device, no
ZeRO (whose gathered units change from step to step), no precision policy (new compute copies each
step), an in-place optimizer; and checked before each step (the same chain and parameter tensors,
or everything is bound again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class BoundStage(NamedTuple):
    """A stage's layers bound to a step's leaves: (name, call, buffers) per layer, and the leaves used
    by (owner layer, local name); ``quiet``: when every layer is one call of a forward that draws no
    random numbers (``Layer.bind_quiet``), those calls, which run the stage on a tensor without
    seeding its random streams; else None."""

    layers: tuple[tuple[str, Callable[[Any], Any], Mapping[str, torch.Tensor]], ...]
    leaves: dict[tuple[str, str], torch.Tensor]
    quiet: tuple[Any, ...] | None = None


@dataclass
class StageBindings:
    """What :class:`~shardwise.engine.run.executor.Executor` binds in a step, for the next step."""

    # (owner layer, local name) -> the parameter tensor its leaf was detached from
    sources: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    leaves: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    bound: dict[int, BoundStage] = field(default_factory=dict)  # per stage: Executor._bound_stage
    chain: Any = None  # the chain whose layers were bound
    emptied: bool = True  # whether every leaf's .grad is None (a step that failed midway may leave some)

    def ready_for(self, chain: Any, compute: Mapping[str, Mapping[str, torch.Tensor]]) -> bool:
        """Make these the bindings of a step of ``chain`` reading ``compute``: kept (their gradients
        emptied) when each leaf's parameter is the tensor it was detached from, else emptied for
        binding again. True when kept."""
        kept = self.chain is chain
        if kept:
            for (owner, name), tensor in self.sources.items():  # (a loop: no generator, every step)
                if compute.get(owner, {}).get(name) is not tensor:
                    kept = False
                    break
        if kept:
            if not self.emptied:
                self.clear_grads()
            self.emptied = False  # until the step's end empties them
        else:
            self.sources.clear()
            self.leaves.clear()
            self.bound.clear()
            self.chain = chain
            self.emptied = False
        return kept

    def clear_grads(self) -> None:
        """Empty every leaf's ``.grad``: the next backward writes fresh gradients, as into new leaves."""
        for leaf in self.leaves.values():
            leaf.grad = None
        self.emptied = True
