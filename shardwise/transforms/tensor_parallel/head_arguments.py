"""A Region's arguments of one slice per head (``Region(arguments={name: HeadsAlong(...)})``): each call
hands the module the rank's heads of them.

Bloom, MPT and Falcon(alibi=True) build ONE ALiBi bias for all H heads in the model, around the layers, and
pass it to every attention: Bloom's ``alibi`` ``(b * H, 1, t)`` (batch and heads folded, batch-major: row
``i * H + h``), MPT's ``position_bias`` ``(H, 1, t)``, Falcon's ``attention_mask`` ``(b, H, q, k)`` with the
bias folded in. Inside a Region a rank's q, k and v hold the heads ``[r*H/tp, (r+1)*H/tp)`` (the Colwise
projections cut their outputs into tp contiguous blocks of whole heads; a GQA layout's query heads are
contiguous per key/value group, so a rank's groups hold them too), so the rank takes exactly those of the
argument: a ``narrow`` along the heads (on the heads of ``(b, H)`` unflattened, where folded). No
communication in forward.

Gradients. A slice is differentiable: its gradient reaches the rank's heads of the whole tensor, zeros
elsewhere. The whole tensor is computed alike on every rank outside the Region, so where it requires grad (a
learned bias), each rank's gradient of it holds its own heads only: the argument first goes through
``enter`` (identity forward, all-reduce backward, Megatron's f), so every rank gets the sum, each head's
gradient once (the ranks' heads are disjoint: nothing is summed twice). A constant bias (ALiBi's) requires
no grad, and nothing is sent. ``None`` (no bias this call) is handed on; so is a size of 1 along the dim (a
bias broadcast over the heads: Falcon without ALiBi passes ``(b, 1, q, k)``), entered as well where it requires
grad (each rank's gradient of it is the sum over its own heads only).

The Region probe (region_probe.py) runs the split module on the call's (sliced) arguments and the whole
module on them tiled back (the rank's heads at every place, as it tiles the rank's weights), and cuts a
folded argument to the first sample's rows (:meth:`HeadArguments.tiled`, :meth:`HeadArguments.first_sample`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .styles import HeadsAlong, Region


def check_head_arguments(pattern: str, path: str, style: Region, module: nn.Module) -> None:
    """Refuse, when the plan is matched, an argument the module's forward does not take, or a ``heads=`` the
    Region does not name."""
    signature = inspect.signature(type(module).forward)
    params = list(signature.parameters.values())[1:]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    for name, along in style.argument_layouts().items():
        if name not in named and not takes_any:
            raise ValueError(
                f"tensor_parallel: plan[{pattern!r}] = {style} names the argument {name!r}, which "
                f"{type(module).__name__}.forward ({path!r}) does not take; its arguments are {named}"
            )
        if named and name == named[0]:
            raise ValueError(
                f"tensor_parallel: plan[{pattern!r}] = {style} names {name!r}, the hidden states of {path!r}, which "
                "enter the Region whole; HeadsAlong() is for another argument that holds one slice per head"
            )
        if along.heads is not None and along.heads not in style.heads:
            raise ValueError(
                f"tensor_parallel: plan[{pattern!r}] = {style}: HeadsAlong(heads={along.heads!r}) for {name!r}, "
                f"but the Region names the heads {style.heads}; name one of them"
            )


class HeadArguments:
    """The arguments a Region's module takes one slice per head of: where each is in the call, its layout,
    and the whole count of its heads."""

    def __init__(self, module: nn.Module, path: str, style: Region, whole: Callable[[str], int]) -> None:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
        positional = [p.name for p in params if p.kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        self.path = path
        self.positional = positional
        # Names the forward takes only through **kwargs: a call without one is refused (a misspelt name).
        self.undeclared = {name for name in style.argument_layouts() if name not in {p.name for p in params}}
        # (name, its position in args if it can be passed so, its layout, the whole head count)
        self.entries: list[tuple[str, int | None, HeadsAlong, int]] = [
            (name, positional.index(name) if name in positional else None, along,
             whole(along.heads or style.heads[0]))
            for name, along in style.argument_layouts().items()
        ]

    def cut(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], n: int, index: int, batch: int | None,
        enter: Callable[[Tensor, str], Tensor],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call with each argument cut to the rank's heads (``index`` of ``n``); ``batch``: the hidden
        states' dim 0 (a folded argument holds it times H rows); ``enter``: Megatron's f, for one that
        requires grad (given the argument and its name)."""

        def rank_heads(t: Tensor, name: str, along: HeadsAlong, heads: int) -> Tensor:
            dim = self._dim(t, name, along)
            size = t.shape[dim]
            broadcast = size == 1 and not along.folded_batch  # every head's the same: handed on whole
            if not broadcast:
                self._check_size(t, name, along, dim, heads, batch)
            if t.requires_grad and n > 1:
                # Its gradient summed over the ranks: each holds its own heads' part (of a broadcast one, the sum
                # over its own heads only: unsummed, the ranks' replicated gradients differed, review6).
                t = enter(t, name)
            if broadcast:
                return t
            local = heads // n
            if not along.folded_batch:
                return t.narrow(dim, index * local, local)
            rows = t.unflatten(dim, (size // heads, heads)).narrow(dim + 1, index * local, local)
            return rows.flatten(dim, dim + 1)

        return self._map(args, kwargs, rank_heads)

    def tiled(self, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """For the probe's whole copies: each cut argument tiled back to all H heads, the rank's heads at every
        place (as the copies tile the rank's weights)."""

        def tile(t: Tensor, name: str, along: HeadsAlong, heads: int) -> Tensor:
            dim = self._dim(t, name, along)
            local = heads // n
            if not along.folded_batch:
                return t if t.shape[dim] == 1 else torch.cat([t] * n, dim)
            rows = t.unflatten(dim, (t.shape[dim] // local, local))
            return torch.cat([rows] * n, dim + 1).flatten(dim, dim + 1)

        return self._map(args, kwargs, tile)

    def first_sample(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """For the probe's run on the batch's first sample: a folded argument cut to that sample's rows; one
        with its heads on dim 0 left whole (its dim 0 is no batch, even where its length equals one)."""

        def first(t: Tensor, name: str, along: HeadsAlong, heads: int) -> Tensor:
            dim = self._dim(t, name, along)
            if along.folded_batch:
                return t.narrow(dim, 0, t.shape[dim] // batch)
            if dim == 0 or t.shape[0] != batch:
                return t
            return t[:1]

        return self._map(args, kwargs, first)

    def located(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
        """The ids of the call's tensors that are these arguments (the probe's batch cut leaves them alone)."""
        found: set[int] = set()
        for name, position, _, _ in self.entries:
            value = args[position] if position is not None and position < len(args) else kwargs.get(name)
            if isinstance(value, Tensor):
                found.add(id(value))
        return found

    def _map(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Tensor, str, HeadsAlong, int], Tensor]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        new_args, new_kwargs = list(args), dict(kwargs)
        for name, position, along, heads in self.entries:
            if position is not None and position < len(args):
                value = args[position]
            elif name in kwargs:
                value = kwargs[name]
            elif name in self.undeclared:
                passed = [*self.positional[: len(args)], *kwargs]
                raise ValueError(
                    f"tensor_parallel: Region {self.path!r} was called without {name!r}, which its plan marks "
                    f"HeadsAlong(dim={along.dim}) and its forward takes only through **kwargs; the call passed "
                    f"{passed}: check the argument's name"
                )
            else:
                continue  # not passed: the forward's default
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise ValueError(
                    f"tensor_parallel: Region {self.path!r} was called with {name!r} = a {type(value).__name__}, "
                    f"which its plan marks HeadsAlong(dim={along.dim}): a tensor of one slice per head (or None)"
                )
            out = fn(value, name, along, heads)
            if position is not None and position < len(args):
                new_args[position] = out
            else:
                new_kwargs[name] = out
        return tuple(new_args), new_kwargs

    def _dim(self, t: Tensor, name: str, along: HeadsAlong) -> int:
        if not -t.dim() <= along.dim < t.dim():
            raise ValueError(
                f"tensor_parallel: Region {self.path!r}: HeadsAlong(dim={along.dim}) for its argument {name!r}, which "
                f"has shape {tuple(t.shape)}: dim {along.dim} is out of range for its {t.dim()} dims"
            )
        return along.dim % t.dim()

    def _check_size(
        self, t: Tensor, name: str, along: HeadsAlong, dim: int, heads: int, batch: int | None
    ) -> None:
        size = t.shape[dim]
        if along.folded_batch:
            if size % heads or (batch is not None and size != batch * heads):
                want = f"the batch ({batch}) times" if batch is not None else "a multiple of"
                raise ValueError(
                    f"tensor_parallel: Region {self.path!r}: its argument {name!r} of shape {tuple(t.shape)} is "
                    f"marked HeadsAlong(dim={along.dim}, folded_batch=True), so its dim {dim} ({size}) should be "
                    f"{want} the {heads} heads (b * H rows, batch-major, as Bloom's alibi); check the dim, "
                    "folded_batch, and which count heads= names"
                )
        elif size != heads:
            hint = (
                f"; it is {size // heads} times the heads: if it holds the batch and the heads flattened "
                "(b * H rows, Bloom's alibi), say folded_batch=True"
            ) if size % heads == 0 else "; check the dim and which count heads= names"
            raise ValueError(
                f"tensor_parallel: Region {self.path!r}: its argument {name!r} of shape {tuple(t.shape)} is marked "
                f"HeadsAlong(dim={along.dim}), so its dim {dim} ({size}) should hold one slice per head, {heads} "
                f"(or 1, broadcast over the heads){hint}"
            )
