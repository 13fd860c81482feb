"""Runs one rank's actions of a Plan.

Each layer's forward keeps its own small autograd graph: the layer input is a
detached leaf, so ``B(layer)`` can run that layer's backward alone, in whatever
order the plan says (a pipeline interleaves them; FSDP frees parameters
between them). The kernels and the order of accumulation are those of one
``loss.backward()`` over the whole chain, so results are bitwise equal to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from .chain import Chain
from .plan import BACKWARD, FORWARD, LOSS, UPDATE, Action

LossFn = Callable[[Any, Any], torch.Tensor]


def _float_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree``, in pytree order: the values gradients flow through.

    A layer's output and the next layer's input leaves have the same structure,
    so gradients are matched between them by position in this list.
    """
    return [
        t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]


def _as_input_leaf(tree: Any) -> Any:
    """Cut the graph at a layer boundary: floating tensors become fresh leaves that require grad."""

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return t.detach().requires_grad_(True)
        return t

    return optree.tree_map(cut, tree)


def _detached(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _grads_of(
    outputs: torch.Tensor | list[torch.Tensor],
    output_grads: list[torch.Tensor | None] | None,
    wrt: list[torch.Tensor],
) -> list[torch.Tensor | None]:
    """Gradients of ``outputs`` (seeded with ``output_grads``) w.r.t. ``wrt``; None where unused."""
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]]
    if isinstance(outputs, torch.Tensor):
        pairs = [(outputs, None)] if outputs.requires_grad else []
    else:
        assert output_grads is not None
        pairs = [(o, g) for o, g in zip(outputs, output_grads, strict=True) if g is not None and o.requires_grad]
    if not pairs or not wrt:
        return [None] * len(wrt)
    got = torch.autograd.grad(
        [o for o, _ in pairs], wrt, [g for _, g in pairs] if output_grads is not None else None, allow_unused=True
    )
    return list(got)


@dataclass
class _Saved:
    inputs: Any
    params: dict[str, torch.Tensor]
    outputs: Any


@dataclass
class Executor:
    """Forward, loss and backward of a Chain on one batch, one action at a time.

    After the plan has run, ``grads`` holds the gradient of the loss with
    respect to every owned parameter (same pytree as the params), and ``loss``
    the detached loss.
    """

    chain: Chain
    loss_fn: LossFn
    params: Mapping[str, Mapping[str, torch.Tensor]]
    inputs: Any
    targets: Any
    loss_scale: float = 1.0
    loss: torch.Tensor | None = None
    grads: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _saved: dict[str, _Saved] = field(default_factory=dict)
    _next_input: Any = None
    _output_grad: list[torch.Tensor | None] = field(default_factory=list)
    _position: int = 0

    def run(self, actions: tuple[Action, ...], handlers: Mapping[str, Callable[[Action], None]] | None = None) -> None:
        """Run ``actions`` in order; ``handlers`` maps extra action kinds (from transforms) to callables."""
        own: dict[str, Callable[[Action], None]] = {
            FORWARD: self.forward,
            LOSS: self.compute_loss,
            BACKWARD: self.backward,
        }
        table = {**own, **(handlers or {})}
        for action in actions:
            handler = table.get(action.kind)
            if handler is None:
                if action.kind == UPDATE:
                    continue  # the Step applies the optimizer after the executor is done
                raise ValueError(f"the executor has no handler for action {action} (kind {action.kind!r})")
            handler(action)

    # -- actions --------------------------------------------------------------
    def forward(self, action: Action) -> None:
        name = self._layer_name(action)
        index = self.chain.names.index(name)
        if index != self._position:
            raise RuntimeError(f"F({name}) runs out of order: expected layer {self.chain.names[self._position]!r}")
        # The batch needs no gradient; only activations between layers do.
        x = _detached(self.inputs) if index == 0 else _as_input_leaf(self._next_input)
        local = {k: v.detach().requires_grad_(True) for k, v in self.chain.layer_params(self.params, name).items()}
        with torch.enable_grad():
            y = self.chain[name](local, x)
        self._saved[name] = _Saved(x, local, y)
        self._next_input = y
        self._position += 1

    def compute_loss(self, action: Action) -> None:
        if self._position != len(self.chain):
            raise RuntimeError("loss runs before the last layer's forward")
        output = self._next_input
        with torch.enable_grad():
            loss = self.loss_fn(output, self.targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor (the mean loss over the batch), got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        scaled = loss if self.loss_scale == 1.0 else loss * self.loss_scale
        self._output_grad = _grads_of(scaled, None, _float_leaves(output))
        self.loss = loss.detach()

    def backward(self, action: Action) -> None:
        name = self._layer_name(action)
        saved = self._saved.pop(name, None)
        if saved is None:
            raise RuntimeError(f"B({name}) runs before F({name}) or twice")
        outs = _float_leaves(saved.outputs)
        if len(outs) != len(self._output_grad):
            raise RuntimeError(f"B({name}): {len(self._output_grad)} output gradients for {len(outs)} outputs")
        ins = [t for t in _float_leaves(saved.inputs) if t.requires_grad]
        param_names = list(saved.params)
        got = _grads_of(outs, self._output_grad, ins + [saved.params[k] for k in param_names])
        self._output_grad = got[: len(ins)]
        self._accumulate(name, dict(zip(param_names, got[len(ins) :], strict=True)))

    # -- helpers --------------------------------------------------------------
    def _accumulate(self, layer: str, grads: dict[str, torch.Tensor | None]) -> None:
        ties = self.chain[layer].ties
        for local, g in grads.items():
            owner, owner_local = ties.get(local, (layer, local))
            if g is None:
                g = torch.zeros_like(self.params[owner][owner_local])
            slot = self.grads.setdefault(owner, {})
            # Later layers run backward first, so a tied weight sums its uses in
            # the order a single loss.backward() would.
            slot[owner_local] = g if owner_local not in slot else slot[owner_local] + g

    def ordered_grads(self) -> dict[str, dict[str, torch.Tensor]]:
        """Gradients in the params' own structure (every owned parameter present)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for layer, tensors in self.params.items():
            got = self.grads.get(layer, {})
            out[layer] = {k: got[k] if k in got else torch.zeros_like(v) for k, v in tensors.items()}
        return out

    @staticmethod
    def _layer_name(action: Action) -> str:
        if action.layer is None:
            raise ValueError(f"action {action} needs a layer")
        return action.layer
