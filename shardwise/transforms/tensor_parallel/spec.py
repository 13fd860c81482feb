"""tensor_parallel's spec: frozen data in the step's stack, and what the engine asks of it."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...collectives.mesh import Mesh
from ...engine.layout.state_layout import Placement, TensorSplit
from ...engine.model.chain import Chain
from ...engine.plan.inside import Predicted, Recording
from ...engine.stack.compose import SPLIT
from ...engine.stack.roles import NO_CUT, BatchCut
from .count_fields import undivided_count_message
from .layer_rewrite import guard_layer, rewrite_layer
from .match import EMBEDDING, LayerPlan, Resolved, resolve
from .per_head import per_head_message
from .predict import predict
from .styles import Colwise, Rowwise, Style, gathers

_RESOLVED: weakref.WeakKeyDictionary[Chain, dict[Any, Resolved]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TPSpec:
    """Parameters split over ``axis`` by the styles of ``plan`` (see :func:`tensor_parallel`)."""

    axis: str
    plan: tuple[tuple[str, Style], ...]
    sequence_parallel: str | None = None

    name: ClassVar[str] = "tensor_parallel"
    role: ClassVar[str] = SPLIT
    # what the optimizer's update gets (the engine refuses an optimizer that is not elementwise there)
    optimizer_gets: ClassVar[str | None] = (
        "this rank's slices of the parameters the plan splits (a Colwise weight's rows, a Rowwise weight's columns)"
    )
    replica_fix: ClassVar[str] = (
        "A replicated parameter is used on per-rank values without its gradient being summed: mark the attention or "
        "MLP module holding it as a Region() in the plan, or name the blocks in sequence_parallel= if it acts on "
        "sequence slices"
    )

    def __str__(self) -> str:
        plan = ", ".join(f"{p!r}: {s}" for p, s in self.plan)
        sp = f", sequence_parallel={self.sequence_parallel!r}" if self.sequence_parallel else ""
        return f"tensor_parallel(axis={self.axis!r}, plan={{{plan}}}{sp})"

    # -- the plan on a chain --------------------------------------------------------------------
    def resolved(self, chain: Chain) -> Resolved:
        per_chain = _RESOLVED.setdefault(chain, {})
        if self not in per_chain:
            per_chain[self] = resolve(chain, dict(self.plan), self.sequence_parallel)
        return per_chain[self]

    def rewrite(self, chain: Chain, stack: tuple[Any, ...] = ()) -> Chain:
        """The chain with every styled layer calling its tensor-parallel module; under
        mixed_precision in ``stack``, its sums travel in each layer's reduce dtype."""
        resolved = self.resolved(chain)
        precision = next((getattr(s, "precision", None) for s in stack if s.name == "mixed_precision"), None)
        heads = _logits_heads(chain, resolved)
        aux_loss = next((str(s) for s in stack if s.name == "router_aux_loss"), None)
        layers = []
        split = False  # whether the layers so far leave their output split (by the chain's order)
        for layer in chain:
            lp = resolved.layers.get(layer.name)
            reduce = None if precision is None else precision.for_layer(layer.name).reduce
            changes = lp is not None and (lp.installs or lp.blocks or lp.vary or lp.owned_only)
            if changes and lp is not None:
                layers.append(rewrite_layer(layer, lp, self.axis, reduce, heads.get(layer.name, ()), aux_loss))
                split = _leaves_split(lp, split)
            else:
                layers.append(guard_layer(layer, self.axis, between=split))
        rewritten = Chain(layers)
        _RESOLVED.setdefault(rewritten, {})[self] = resolved
        return rewritten

    def splits(self, chain: Chain, parts: int) -> dict[tuple[str, str], TensorSplit]:
        """Every split parameter, by (owner layer, owner's local name), for an axis of ``parts``."""
        return {k: TensorSplit(self.axis, s.dim, parts, s.blocks) for k, s in self.resolved(chain).splits.items()}

    def tensor_splits(self, chain: Chain, mesh: Mesh | None) -> dict[tuple[str, str], TensorSplit]:
        """Every split parameter, by (owner layer, owner's local name), for this axis of ``mesh``."""
        return self.splits(chain, _mesh(mesh, self.axis).axis_size(self.axis))

    def check_sizes(self, chain: Chain, params: Mapping[str, Mapping[str, torch.Tensor]], parts: int) -> None:
        """Refuse heads or parameter dims that the axis size does not divide, naming them (a per-head
        parameter by its own path first: the one value per head the user named)."""
        for per_head in self.resolved(chain).splits.values():
            if per_head.heads is not None and per_head.heads[2] % parts:
                path, attr, count = per_head.heads
                raise ValueError(per_head_message(path, count, attr, parts, self.axis))
        for lp in self.resolved(chain).layers.values():
            for _, path, attr, count in lp.cut_whole:
                if count % parts:
                    raise ValueError(per_head_message(path, count, attr, parts, self.axis))
        resolved = self.resolved(chain)
        for path, attr, value, field in resolved.heads:
            if value % parts:
                pattern = next((p for p, paths in resolved.matched.items() if path in paths), path)
                raise ValueError(undivided_count_message(path, attr, value, field, parts, self.axis, pattern))
        for (layer, name), split in self.splits(chain, parts).items():
            try:
                split.check(tuple(params[layer][name].shape), f"tensor_parallel: parameter {name!r} of layer {layer!r}")
            except ValueError as err:
                hint = resolved.splits[(layer, name)].hint
                if not hint:
                    raise
                raise ValueError(f"{err}; {hint}") from None

    def local_view(
        self, chain: Chain, params: Mapping[str, Mapping[str, torch.Tensor]], mesh: Mesh | None, rank: int | None
    ) -> dict[str, dict[str, torch.Tensor]]:
        """The parameters as tensor-parallel index of ``rank`` (default: the calling rank) computes with."""
        mesh = _mesh(mesh, self.axis)
        parts = mesh.axis_size(self.axis)
        self.check_sizes(chain, params, parts)
        index = mesh.axis_index(self.axis) if rank is None else mesh.coords_of(rank)[self.axis]
        splits = self.splits(chain, parts)
        return {
            layer: {n: splits[(layer, n)].local(t, index) if (layer, n) in splits else t for n, t in tensors.items()}
            for layer, tensors in params.items()
        }

    def replicated(self, chain: Chain) -> frozenset[tuple[str, str]]:
        """The parameters every tensor-parallel index holds whole (counted once in the gradient norm)."""
        splits = self.resolved(chain).splits
        return frozenset(
            (layer.name, n) for layer in chain for n in layer.owned_param_names if (layer.name, n) not in splits
        )

    def batch_cut(self, mesh: Mesh | None) -> BatchCut:
        """None: every index of the axis takes the same batch."""
        return NO_CUT

    def counts_replicated(self, mesh: Mesh | None) -> bool:
        """Index 0 of the axis alone counts the loss, the tokens and the replicated gradients in the
        metrics: every index computes them alike."""
        return _mesh(mesh, self.axis).axis_index(self.axis) == 0

    def rng_rank(self, mesh: Mesh | None) -> int:
        """The first index of the axis: random ops on replicated values (dropout on the residual
        stream) draw alike on every index."""
        mesh = _mesh(mesh, self.axis)
        return mesh.rank_of({**mesh.coords, self.axis: 0})

    # -- prediction --------------------------------------------------------------------------------
    def inner_collectives(
        self,
        chain: Chain,
        placement: Placement,
        shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
        loss_fn: Callable[[Any, Any], Any],
        inputs: Any,
        targets: Any,
        recording: Recording,
        *,
        split_backward: bool | None = None,
    ) -> Predicted:
        """Its own prediction of the collectives each compute issues inside its layers, in place of the
        engine's (which runs each stage whole): layer by layer, each distinct layer once, so a 70B's 80
        blocks run once (predict.py)."""
        return predict(chain, placement, shapes, loss_fn, inputs, targets, recording, split_backward=split_backward)

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        """Per layer, what tensor parallel does to it, for the Plan."""
        notes = {}
        resolved = self.resolved(chain)
        for name, lp in resolved.layers.items():
            parts = [f"{i.path}: {i.style}" for i in lp.installs]
            parts += [f"{s.heads[0]}: PerHead()" for (layer, _), s in resolved.splits.items()
                      if layer == name and s.heads is not None]
            if lp.blocks:
                parts.append("sequence parallel: " + ", ".join(p for _, p, _, _ in lp.blocks))
            if lp.vary:
                parts.append(f"gradients summed over {self.axis!r} where used on per-rank values: {sorted(lp.vary)}")
            if parts:
                notes[name] = "tensor parallel: " + "; ".join(parts)
        return notes


def _mesh(mesh: Mesh | None, axis: str) -> Mesh:
    """The step's mesh, which a split step always has (step.init refuses none: its axis needs one)."""
    if mesh is None:
        raise ValueError(f"tensor_parallel(axis={axis!r}) needs the mesh: call step.init(params, mesh)")
    return mesh


def _logits_heads(chain: Chain, resolved: Resolved) -> dict[str, tuple[str, ...]]:
    """Per layer, its Colwise modules (by path) that enter the split region themselves and leave their
    output split: a head whose logits reach the loss split (own_loss.py guards a model holding one).
    Read off the layer's modules, not the chain's order: a Hugging Face model's ``embed`` and ``head``
    both call the whole model, and ``head`` also holds the embedding its head is tied to."""
    heads = {}
    for layer in chain:
        lp = resolved.layers.get(layer.name)
        found = () if lp is None else tuple(
            i.path for i in lp.installs
            if isinstance(i.style, Colwise) and i.enters and not gathers(i.style, i.kind == EMBEDDING)
        )
        if found:
            heads[layer.name] = found
    return heads


def _leaves_split(lp: LayerPlan, before: bool) -> bool:
    """Whether a layer leaves its output split: after a Rowwise, no; after only sharded Colwise
    modules (that enter the region themselves: a layer of its own each, as an nn.Sequential's
    children are), yes; otherwise as it found it."""
    styled = [i for i in lp.installs if isinstance(i.style, (Colwise, Rowwise))]
    if any(isinstance(i.style, Rowwise) for i in styled):
        return False
    if styled and lp.blocks == [] and all(
        isinstance(i.style, Colwise) and i.enters and not gathers(i.style, i.kind == EMBEDDING) for i in styled
    ):
        return True
    return before
