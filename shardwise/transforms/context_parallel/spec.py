"""context_parallel's spec: frozen data in the step's stack (a SPLIT over its axis that cuts the
sequence, no parameter), and what the engine asks of it."""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import optree
import torch
from torch import Tensor

from ...collectives.mesh import Mesh
from ...engine.layout.state_layout import TensorSplit
from ...engine.model.chain import Chain, Layer
from ...engine.model.module_call import ThreadReplicas, kept_in_copies
from ...engine.stack import in_layer
from ...engine.stack.compose import SPLIT
from ...engine.stack.roles import BatchCut
from .attention import (
    CPForward,
    GlobalPositions,
    GPT2Forward,
    HFForward,
    LayerParts,
    find_parts,
    heads_of,
    module_fn,
    reading_batch,
)
from .comm import whole_sequence
from .cut import cutting
from .hf_interface import SplitAttention, point_at_split_attention
from .layout import check_sequence_length, local_chunks, shard_order
from .masks import TokenMask, token_mask
from .sequence_dims import hand_over
from .shifted import refuse_targets_equal_to_inputs
from .unsplit import at_positions, watched

# Per chain, per positions= (what a layer's tables are depends on it: another call on the same chain that
# lists another table must not get the first call's).
_RESOLVED: weakref.WeakKeyDictionary[Chain, dict[tuple[str, ...], dict[str, LayerParts]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class CPSpec:
    """Sequences cut over ``axis``; attention exchanges the rest (see :func:`context_parallel`)."""

    axis: str
    attention: str = "ring"
    balanced: bool = True
    positions: tuple[str, ...] = ("pos_emb",)
    dim: int = 1
    token_weighted: bool = False  # the step weighs each rank's loss by its token count (train_step(tokens=...))

    name: ClassVar[str] = "context_parallel"
    cuts_batch: ClassVar[bool] = True  # each rank computes a part of every sequence (compose.py)
    role: ClassVar[str] = SPLIT
    optimizer_gets: ClassVar[str | None] = None  # every parameter whole: any optimizer (compose.py)
    replica_fix: ClassVar[str] = (
        "context_parallel sums every parameter's gradient over its axis inside the layers; a difference means "
        "a layer computed differently on the ranks (random ops drawing alike?), or it is a bug: report it"
    )

    def __str__(self) -> str:
        return (
            f"context_parallel(axis={self.axis!r}, attention={self.attention!r}, balanced={self.balanced!r}, "
            f"positions={self.positions!r})"
        )

    def resolve(self, chain: Chain) -> dict[str, LayerParts]:
        """Per layer, its attention modules and position tables; a chain without attention is refused."""
        known = _RESOLVED.get(chain, {}).get(self.positions)
        if known is not None:
            return known
        found: dict[str, LayerParts] = {}
        for layer in chain:
            parts = find_parts(layer, self.positions)
            if parts is not None:
                found[layer.name] = parts
        if not any(p.attentions or p.own or p.interfaced for p in found.values()):
            raise ValueError(
                "context_parallel: the step's chain has no attention module it can split (TinyGPT's "
                "CausalSelfAttention, Hugging Face attentions that call transformers' AttentionInterface) and no "
                "module whose forward calls ring_attention / ulysses_attention; nothing to run over the sequence's "
                "parts. Write the model's attention with one of those two functions, or leave context_parallel out"
            )
        _RESOLVED.setdefault(chain, {})[self.positions] = found
        return found

    def rewrite(self, chain: Chain, stack: tuple[Any, ...] = ()) -> Chain:
        """The chain with every attention over the whole sequence, every position table read at the
        rank's global positions, and every parameter's gradient summed over the axis (in
        mixed_precision's reduce dtype, if any)."""
        found = self.resolve(chain)
        precision = next((getattr(s, "precision", None) for s in stack if s.name == "mixed_precision"), None)
        layers = []
        for position, layer in enumerate(chain):
            fn = layer.fn
            parts = found.get(layer.name)
            if parts is not None and (parts.attentions or parts.rotaries or parts.interfaced):
                fn = self._install(fn, parts, layer.name)
            tables = frozenset(parts.tables) if parts is not None else frozenset()
            reduce = None if precision is None else precision.for_layer(layer.name).reduce
            wrapped = CPLayerFn(fn, self, frozenset(layer.param_names), tables, reduce, reads_batch=position == 0,
                                label=layer.name)
            layers.append(Layer(
                layer.name, wrapped, layer.param_names, layer.buffers, layer.ties, layer.frozen,
            ))
        rewritten = Chain(layers)
        _RESOLVED.setdefault(rewritten, {})[self.positions] = found
        return rewritten

    def _install(self, fn: Any, parts: LayerParts, layer: str) -> Any:
        """A copy of the layer fn whose module's attentions run :class:`CPForward` (or HF's, GPT-2's), and
        its rotary embeddings :class:`GlobalPositions`. Under another split's wrapper (tensor_parallel's)
        the wrapper is copied around the new module fn; where that split installed a forward of its own
        on the attention (tensor_parallel's Region, which calls the class's forward inside its own), ours
        goes beneath it, as the forward of a subclass of the module's class."""
        if hasattr(fn, "replicas"):
            return self._install_in_module_fn(fn, parts, layer)
        outer = copy.copy(fn)
        outer.fn = self._install(fn.fn, parts, layer)
        return outer

    def _install_in_module_fn(self, fn: Any, parts: LayerParts, layer: str) -> Any:
        replicas = fn.replicas
        module = replicas.module
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        copied = copy.deepcopy(module, memo={**kept_in_copies(module), **{id(t): t for _, t in named}})
        for path in parts.attentions:
            target = copied.get_submodule(path)
            kind = HFForward if hasattr(target, "q_proj") else GPT2Forward if hasattr(target, "c_attn") else CPForward
            forward = kind(target, self.axis, self.attention, self.balanced, f"{layer}: {path}")
            if "forward" in vars(target):  # another split's forward, which calls the class's: ours beneath it
                target._context_parallel_forward = forward
                target.__class__ = _beneath(type(target))
            else:
                target.forward = forward
        for path in parts.interfaced:  # its own forward, pointed at the split attention function
            target = copied.get_submodule(path)
            implementation = getattr(getattr(target, "config", None), "_attn_implementation", None)
            point_at_split_attention(target, SplitAttention(self.axis, self.attention, self.balanced,
                                                            f"{layer}: {path}", implementation))
        for path in parts.rotaries:
            target = copied.get_submodule(path)
            target.forward = GlobalPositions(target, self.axis, self.balanced)
        new_fn = copy.copy(fn)
        new_fn.replicas = ThreadReplicas(copied, replicas.prefix)
        return new_fn

    def tensor_splits(self, chain: Chain, mesh: Mesh | None) -> dict[tuple[str, str], TensorSplit]:
        """None cut: every parameter is replicated over the axis. Ulysses' head split is checked here,
        where the mesh is first known (step.init, step.plan)."""
        if self.attention == "ulysses":
            parts = _mesh(mesh, self.axis).axis_size(self.axis)
            for layer, found in self.resolve(chain).items():
                for path in (*found.attentions, *found.interfaced):
                    fn: Any = chain[layer].fn  # a module fn (find_parts found the attention there)
                    heads = heads_of(module_fn(fn).replicas.module.get_submodule(path))
                    if heads % parts:
                        raise ValueError(
                            f"context_parallel: {layer}: {path} has {heads} heads, which the {parts} ranks of axis "
                            f"{self.axis!r} do not divide (Ulysses gives each rank whole heads); use "
                            "attention='ring', or an axis size that divides the heads"
                        )
        return {}

    def local_view(
        self, chain: Chain, params: Mapping[str, Mapping[str, Tensor]], mesh: Mesh | None, rank: int | None
    ) -> Mapping[str, Mapping[str, Tensor]]:
        """The parameters themselves: every rank of the axis computes with them whole."""
        return params

    def replicated(self, chain: Chain) -> frozenset[tuple[str, str]]:
        """Every parameter: each rank holds it whole and its summed gradient agrees."""
        return frozenset((layer.name, n) for layer in chain for n in layer.owned_param_names)

    def batch_cut(self, mesh: Mesh | None) -> BatchCut:
        """The axis cuts each sequence, not the batch: each rank takes its part of every sequence
        (:meth:`cut_sequence`)."""
        parts = _mesh(mesh, self.axis).axis_size(self.axis)
        return BatchCut(sequence_parts=parts, cut_sequence=functools.partial(self.cut_sequence, mesh=mesh),
                        sequence_dim=self.dim)

    def cut_sequence(self, pair: Any, rank: int | None, mesh: Mesh | None) -> Any:
        """This rank's part of every batch leaf along ``dim`` (inputs and targets alike), in the layout
        the attention expects (balanced: chunks ``i`` and ``2n - 1 - i`` of ``2n``)."""
        mesh = _mesh(mesh, self.axis)
        n = mesh.axis_size(self.axis)
        i = mesh.axis_index(self.axis) if rank is None else mesh.coords_of(rank)[self.axis]
        inputs = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inputs, Mapping):
            _check_batch_dict(inputs)
        refuse_targets_equal_to_inputs(pair, self.dim)

        def cut(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() <= self.dim:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"context_parallel cuts every batch leaf's sequence dim {self.dim}, but a leaf is {shape}; "
                    "give inputs and targets a sequence dim (targets shifted on the whole sequence), or pass "
                    "dim= where the sequence is"
                )
            length = check_sequence_length("context_parallel", t.shape[self.dim], n, self.balanced, self.axis)
            chunks = local_chunks(i, n, self.balanced)
            return torch.cat([t.narrow(self.dim, c * length, length) for c in chunks], self.dim)

        return optree.tree_map(cut, pair)

    def counts_replicated(self, mesh: Mesh | None) -> bool:
        """Index 0 alone counts the gradients (summed, alike on every index) in the norm; every index
        counts its own loss and tokens (its part of the sequences)."""
        return _mesh(mesh, self.axis).axis_index(self.axis) == 0

    def rng_rank(self, mesh: Mesh | None) -> None:
        """Its own: every rank computes on its own tokens."""
        return None

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        """Per layer, what context parallel does to it, for the Plan."""
        how = {
            "ring": "the key/value slice passed round the ring (n - 1 ppermutes forward, n - 1 backward)",
            "ulysses": "all-to-alls from sequence- to head-split and back (4 forward, 4 backward)",
        }[self.attention]
        notes = {}
        for name, parts in self.resolve(chain).items():
            said = []
            if parts.attentions:
                said.append(f"attention {', '.join(parts.attentions)} over the whole sequence: {how}")
            if parts.interfaced:
                said.append(f"attention {', '.join(parts.interfaced)} (its own forward, through transformers' "
                            f"AttentionInterface) over the whole sequence: {how}")
            if parts.own:
                said.append(f"{', '.join(p or '(the layer)' for p in parts.own)} calls ring_attention / "
                            "ulysses_attention itself (kept as written)")
            if parts.tables:
                said.append(f"position tables {', '.join(parts.tables)} read at the rank's global positions")
            notes[name] = "context parallel: " + "; ".join(said)
        for other in chain:
            if other.param_names:
                summed = f"gradients summed over {self.axis!r} in backward"
                notes[other.name] = f"{notes[other.name]}; {summed}" if other.name in notes else (
                    f"context parallel: {summed}")
        return notes


_POOLED_WEIGHTED = (
    "context_parallel(axis={axis!r}): layer {layer!r} returns a mean over every element of a tensor that holds the "
    "part's positions (a 0-d auxiliary loss term, such as aux + (h * h).mean()): each rank takes the mean of its own "
    "part, which is the whole sequence's only where the step averages the ranks' losses with equal weights, and "
    "train_step(tokens=...) weighs each rank's loss by its own token count (padded labels count unequally), so "
    "the term would be weighted by the ranks' counts without an error. Use train_step(tokens=None) (a mean loss, "
    "no padding) or tokens='per_shard_mean', add the term outside the layers, or leave context_parallel out"
)


class CPLayerFn:
    """A layer fn under context parallel: its position tables read at the rank's global positions and
    every parameter's gradient summed over the axis (the engine's ``in_layer.grad_summed``). The layer
    that reads the batch (the chain's first) also turns a batch dict's padding ``attention_mask`` or
    restarting ``position_ids`` into the whole sequence's :class:`TokenMask`, which travels to every
    attention in the mask's place (one all-gather of the rank's part), and tells the rotary embeddings
    whether the batch gave positions."""

    def __init__(self, fn: Callable[[dict[str, Tensor], Any], Any], spec: CPSpec, names: frozenset[str],
                 tables: frozenset[str], reduce: torch.dtype | None, reads_batch: bool = False,
                 label: str = "") -> None:
        self.fn, self.spec, self.names, self.tables, self.reduce = fn, spec, names, tables, reduce
        self.reads_batch, self.label = reads_batch, label
        # (thread, input shapes) whose run was watched (unsplit.py): per rank thread, so that each rank's first call
        # is watched layer after layer and each layer's output tags are handed to the next (hand_over)
        self.checked: set[tuple[Any, ...]] = set()

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        """The layer on the rank's part of the sequence; the first call for an input shape watched for an
        attention left over the part only (``unsplit.py``)."""
        shapes = (threading.get_ident(), *(tuple(t.shape) for t in optree.tree_leaves(x) if isinstance(t, Tensor)))
        if shapes in self.checked:
            hand_over(None, None)
            return self._call(tensors, x)
        with watched(self.label, self.spec.axis, self.spec.dim, x, self.reads_batch) as follower:
            out = self._call(tensors, x)
            if self.spec.token_weighted and follower.pools(out):
                raise ValueError(_POOLED_WEIGHTED.format(axis=self.spec.axis, layer=self.label))
        hand_over(follower, out)  # the next layer's inputs hold positions where these outputs do
        self.checked.add(shapes)
        return out

    def _call(self, tensors: dict[str, Tensor], x: Any) -> Any:
        with cutting(self.spec.axis, self.spec.balanced):  # what a module's own ring_attention call must match
            return self._cut_call(tensors, x)

    def _cut_call(self, tensors: dict[str, Tensor], x: Any) -> Any:
        spec = self.spec
        summed = {
            k: in_layer.grad_summed(t, spec.axis, k, self.reduce) if k in self.names else t for k, t in tensors.items()
        }
        given = self.reads_batch and isinstance(x, Mapping) and x.get("position_ids") is not None
        if self.tables and not given:  # position ids the batch gives read the table at each token's own
            local = _sequence_length(x, spec.dim)
            summed = {k: at_positions(self._at_positions(t, local)) if k in self.tables else t
                      for k, t in summed.items()}
        if not self.reads_batch:
            return self.fn(summed, x)
        if isinstance(x, Mapping):
            _check_batch_dict(x)  # cut_sequence checked it; a layer fn called directly is checked here
            if x.get("attention_mask") is not None or given:
                x = {**x, "attention_mask": self._token_mask(x).carried()}
        with reading_batch("given" if given else "counted"):
            return self.fn(summed, x)

    def _token_mask(self, batch: Mapping[str, Any]) -> TokenMask:
        """The whole sequence's padding (a 2-D attention_mask) or packed sequences (position_ids), as
        transformers reads them, from this rank's part (all-gathered over the axis)."""
        spec = self.spec
        mask, positions = batch.get("attention_mask"), batch.get("position_ids")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                token_mask(attention_mask=mask)  # refuses with the fix
            whole = whole_sequence((mask != 0).to(torch.uint8), spec.axis, spec.balanced, "attention_mask")
            return token_mask(attention_mask=whole)
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            raise ValueError(
                f"context_parallel: the batch's position_ids is {_shape(positions)}; it must be a [batch, seq] "
                "tensor, cut with the tokens"
            )
        return token_mask(position_ids=whole_sequence(positions, spec.axis, spec.balanced, "position_ids"))

    def _at_positions(self, table: Tensor, local: int) -> Tensor:
        """The table's rows at this rank's global positions, first: the layer reads rows 0 .. local - 1
        (``table[:, :t]`` or an embedding of ``arange(t)``), which are then the right ones."""
        spec = self.spec
        n, i = in_layer.size(spec.axis), in_layer.index(spec.axis)
        mine = shard_order(local * n, n, spec.balanced)[i * local : (i + 1) * local].to(table.device)
        dim = table.dim() - 2
        if table.shape[dim] < local * n:
            raise ValueError(
                f"context_parallel: the position table has {table.shape[dim]} positions, fewer than the sequence's "
                f"{local * n}; use sequences no longer than the model's"
            )
        return table.index_select(dim, mine)


_BENEATH: dict[type, type] = {}


def _beneath(cls: type) -> type:
    """A subclass of ``cls`` whose forward is the instance's ``_context_parallel_forward``, for a wrapper
    installed on the instance that calls ``type(module).forward`` (the instance attribute, not a
    closure, so that the copies each thread rank makes of the module call their own)."""
    if cls not in _BENEATH:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._context_parallel_forward(*args, **kwargs)

        _BENEATH[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    return _BENEATH[cls]


def _check_batch_dict(batch: Mapping[str, Any]) -> None:
    """Refuse what a batch dict can hold that context parallel would train wrong."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        token_mask(attention_mask=mask)  # refuses with the fix
    labels, ids = batch.get("labels"), batch.get("input_ids")
    if isinstance(labels, torch.Tensor) and isinstance(ids, torch.Tensor) and labels.shape != ids.shape:
        raise ValueError(
            f"context_parallel: the batch dict has labels of shape {list(labels.shape)}, not one per token "
            f"(input_ids are {list(ids.shape)}): a loss per sequence (a sequence classifier's, pooled from one "
            "token of the sequence), which context parallel does not split, since it cuts every sequence over its "
            "ranks; leave context_parallel out for this model"
        )
    if labels is not None:
        raise ValueError(
            "context_parallel: the batch dict has labels, which the model would shift by one inside each rank's "
            "part of the sequence (a wrong target at every chunk's end); pass the batch as (inputs, targets) with "
            "the targets shifted on the whole sequence, and a loss_fn on the logits (with shift_labels in the "
            "batch too: the model's own loss over a rank's part is not one context parallel splits)"
        )
    if batch.get("position_ids") is not None and "attention_mask" not in batch:
        raise ValueError(
            "context_parallel: the batch dict has position_ids but no attention_mask entry; the mask of the whole "
            "sequence (packed sequences, as transformers reads them from position_ids) travels to the attentions "
            "in its place: add 'attention_mask': None to the batch dict (and to functionalize's example_input), "
            "which means the same to the model"
        )


def _shape(x: Any) -> str:
    return f"of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def _sequence_length(x: Any, dim: int) -> int:
    leaves = [t for t in optree.tree_leaves(x) if isinstance(t, torch.Tensor) and t.dim() > dim]
    if not leaves:
        raise ValueError(
            f"context_parallel: a layer reading a position table got no tensor with a sequence dim {dim}; "
            "the table must be read where the sequence is"
        )
    return int(leaves[0].shape[dim])


def _mesh(mesh: Mesh | None, axis: str) -> Mesh:
    if mesh is None:
        raise ValueError(f"context_parallel(axis={axis!r}) needs the mesh: call step.init(params, mesh)")
    return mesh

