"""expert_parallel's spec: frozen data in the step's stack (a SPLIT over its axis), and what the engine asks of it."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...collectives.mesh import Mesh
from ...engine.layout.state_layout import TensorSplit
from ...engine.model.chain import Chain, Layer
from ...engine.model.module_call import ThreadReplicas, kept_in_copies, module_fn
from ...engine.stack.compose import SPLIT
from ...engine.stack.in_layer import grad_summed
from ...engine.stack.roles import BatchCut
from .block_forward import EPForward
from .blocks import OWN, Block, find_blocks
from .own_block import OwnForward

Blocks = dict[str, tuple[Block, ...]]  # layer name -> its MoE blocks
_RESOLVED: weakref.WeakKeyDictionary[Chain, Blocks] = weakref.WeakKeyDictionary()


def resolve(chain: Chain, who: str = "expert_parallel", *, trainable: bool = True) -> Blocks:
    """The MoE blocks of every layer of ``chain``, refusing a chain without one (or with one it does not
    know); ``who`` (the transform that asks: expert_parallel, router_aux_loss) begins the refusal.
    ``trainable``: refuse experts the layer does not own as trainable parameters (expert_parallel splits
    them; router_aux_loss reads only the routers, so a fine-tune with frozen experts keeps its aux loss)."""
    found = _RESOLVED.get(chain)
    if found is None:
        found = _find(chain, who)
        _RESOLVED[chain] = found
    if trainable:
        for name, blocks in found.items():
            layer = chain[name]
            for b in blocks:
                missing = [n for n in b.local_names() if n not in layer.owned_param_names]
                if missing:
                    raise ValueError(
                        f"{who}: layer {name!r} holds the experts {b.path or '(the layer)'} but does not own "
                        f"{missing} as trainable parameters (frozen with requires_grad=False, or tied); {who} "
                        "splits trainable experts. To train the rest with the experts fixed, keep them trainable "
                        "in the module and freeze them in the optimizer: sw.optim.group('*experts*', frozen=True)"
                    )
    return found


def _find(chain: Chain, who: str) -> Blocks:
    found: Blocks = {}
    unsplit: list[str] = []  # modules that hold experts in another layout (for the refusal)
    for layer in chain:
        # A layer functionalize built calls a module (fn.replicas.module) whose tensors' local names
        # in the layer start with the replica's prefix (a decoder layer's path in the model); another
        # split's wrapper (tensor_parallel's, which rewrites first) holds that module fn as its ``fn``.
        replicas = getattr(module_fn(layer.fn), "replicas", None)
        module = getattr(replicas, "module", None)
        if not isinstance(module, nn.Module):
            continue
        prefix = str(getattr(replicas, "prefix", ""))
        blocks = tuple(find_blocks(module, prefix.rstrip(".") or layer.name, prefix, who))
        if blocks:
            found[layer.name] = blocks
        unsplit += [f"{prefix}{path} ({type(sub).__name__}: {_layout(sub)})" for path, sub in module.named_modules()
                    if isinstance(getattr(sub, "experts", None), nn.Module)
                    or type(sub).__name__.endswith(("MoE", "Moe"))]  # JetMoe's MLP: input_linear, output_linear
    if not found:
        held = (
            f"; the model's experts are in another layout, which {who} does not split: {', '.join(unsplit[:3])}"
            f"{' ...' if len(unsplit) > 3 else ''}. Leave {who} out for this model"
            f"{' (shard its experts with shard_params)' if who == 'expert_parallel' else ''}, or write the "
            "block's forward to call moe_dispatch_combine on its experts' weights"
            if unsplit else "; nothing to do"
        )
        raise ValueError(
            f"{who}: the step's chain has no mixture-of-experts block (a module with fused experts "
            "experts.gate_up_proj / experts.down_proj: TopKMoE, HF MixtralSparseMoeBlock, "
            "Qwen2MoeSparseMoeBlock, OlmoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, DeepseekV3MoE, Glm4MoeMoE, "
            f"JambaSparseMoeBlock, GptOssMLP, PhimoeSparseMoeBlock){held}"
        )
    return found


def _layout(module: nn.Module) -> str:
    """``module``'s experts' own parameters, as ``experts.up_proj, experts.down_proj`` (NemotronH's, without a
    gate), or its children where it has no ``experts``, for a refusal."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        return "children " + ", ".join(n for n, _ in module.named_children())
    names = [f"experts.{n}" for n, _ in experts.named_parameters(recurse=False)]
    return ", ".join(names) or f"experts as {type(experts).__name__}"


@dataclass(frozen=True)
class EPSpec:
    """Experts split over ``axis``, which also cuts the batch (see :func:`expert_parallel`)."""

    axis: str
    capacity_factor: float | None = None
    drop_per_rank: bool = False  # a rank may drop the assignments over the capacity (else: refused)

    name: ClassVar[str] = "expert_parallel"
    cuts_batch: ClassVar[bool] = True  # each rank routes its share of the batch (compose.py)
    role: ClassVar[str] = SPLIT
    # what the optimizer's update gets (the engine refuses an optimizer that is not elementwise there)
    optimizer_gets: ClassVar[str | None] = (
        "this rank's slices of the stacked expert weights (its own experts: a part of dim 0)"
    )
    replica_fix: ClassVar[str] = (
        "expert_parallel sums every replicated parameter's gradient over its axis inside the layers; a difference "
        "means a layer computed differently on the ranks (random ops drawing alike?), or it is a bug: report it"
    )

    def __str__(self) -> str:
        drop = ", drop_per_rank=True" if self.drop_per_rank else ""
        return f"expert_parallel(axis={self.axis!r}, capacity_factor={self.capacity_factor!r}{drop})"

    def expert_keys(self, chain: Chain) -> frozenset[tuple[str, str]]:
        blocks = resolve(chain).items()
        return frozenset((layer, n) for layer, found in blocks for b in found for n in b.local_names())

    def rewrite(self, chain: Chain, stack: tuple[Any, ...] = ()) -> Chain:
        """The chain with every MoE block dispatching to its experts' owners, and every replicated
        parameter's gradient summed over the axis (in mixed_precision's reduce dtype, if any)."""
        blocks = resolve(chain)
        sequence_split = next((s for s in stack if getattr(s, "sequence_parallel", None)), None)
        aux = next((s for s in stack if s.name == "router_aux_loss"), None)
        if sequence_split is not None and aux is not None:
            # Under sequence parallel each rank of its axis routes only its slice of the sequence: the routing
            # statistics would be the slice's (tensor_parallel refuses this for the experts it knows; these
            # blocks may hold others).
            raise ValueError(
                f"expert_parallel with {sequence_split} under {aux}: each rank of {sequence_split.axis!r} routes "
                "only its slice of the sequence inside the sequence-parallel blocks, so the routing statistics "
                "would be the slice's and the aux loss another than the whole sequence's; drop sequence_parallel= "
                "or the aux loss"
            )
        experts = self.expert_keys(chain)
        precision = next((getattr(s, "precision", None) for s in stack if s.name == "mixed_precision"), None)
        layers = []
        for layer in chain:
            fn = layer.fn
            if layer.name in blocks:
                fn = self._install(fn, blocks[layer.name], layer.name)
            summed = frozenset(n for n in layer.param_names if layer.ties.get(n, (layer.name, n)) not in experts)
            reduce = None if precision is None else precision.for_layer(layer.name).reduce
            layers.append(Layer(layer.name, SummedFn(fn, self.axis, summed, reduce), layer.param_names, layer.buffers,
                                layer.ties, layer.frozen))
        rewritten = Chain(layers)
        _RESOLVED[rewritten] = blocks
        return rewritten

    def _install(self, fn: Any, blocks: tuple[Block, ...], layer: str) -> Any:
        """A copy of the layer fn whose module's MoE blocks run :class:`EPForward`; under another split's
        wrapper (tensor_parallel's) the wrapper is copied around the new module fn."""
        if not hasattr(fn, "replicas"):
            outer = copy.copy(fn)
            outer.fn = self._install(fn.fn, blocks, layer)
            return outer
        replicas = fn.replicas
        module = replicas.module
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        copied = copy.deepcopy(module, memo={**kept_in_copies(module), **{id(t): t for _, t in named}})
        for b in blocks:
            target = copied.get_submodule(b.path) if b.path else copied
            where = f"{layer}.{b.path}" if b.path else layer
            if "forward" in vars(target):
                raise ValueError(
                    f"expert_parallel: {where} ({type(target).__name__}) already runs another split's forward "
                    "(a tensor_parallel plan that styles the MoE block or its experts): expert_parallel splits its "
                    "experts over its own axis; leave the MoE block out of the tensor-parallel plan"
                )
            if b.kind == OWN:  # its forward calls moe_dispatch_combine itself: kept, told the split
                target.forward = OwnForward(target, self.axis, self.drop_per_rank, where)
            else:
                target.forward = EPForward(target, b, self.axis, self.capacity_factor, where, self.drop_per_rank)
        new_fn = copy.copy(fn)
        new_fn.replicas = ThreadReplicas(copied, replicas.prefix)
        return new_fn

    def tensor_splits(self, chain: Chain, mesh: Mesh | None) -> dict[tuple[str, str], TensorSplit]:
        """Every expert weight, by (owner layer, local name): dim 0 (the experts) cut over the axis."""
        parts = _mesh(mesh, self.axis).axis_size(self.axis)
        for layer, blocks in resolve(chain).items():
            for b in blocks:
                if b.num_experts % parts:
                    raise ValueError(
                        f"expert_parallel: {layer}{'.' + b.path if b.path else ''} has {b.num_experts} experts, which "
                        f"the {parts} ranks of axis {self.axis!r} do not divide; use an expert-parallel size that "
                        f"divides {b.num_experts}"
                    )
        return {key: TensorSplit(self.axis, 0, parts) for key in self.expert_keys(chain)}

    def local_view(
        self, chain: Chain, params: Mapping[str, Mapping[str, Tensor]], mesh: Mesh | None, rank: int | None
    ) -> dict[str, dict[str, Tensor]]:
        """The parameters as ``rank``'s index of the axis (default: the calling rank's) computes with: its experts."""
        mesh = _mesh(mesh, self.axis)
        splits = self.tensor_splits(chain, mesh)
        index = mesh.axis_index(self.axis) if rank is None else mesh.coords_of(rank)[self.axis]
        return {
            layer: {n: splits[(layer, n)].local(t, index) if (layer, n) in splits else t for n, t in tensors.items()}
            for layer, tensors in params.items()
        }

    def replicated(self, chain: Chain) -> frozenset[tuple[str, str]]:
        """Every parameter but the experts: each rank holds it whole and its summed gradient agrees."""
        experts = self.expert_keys(chain)
        return frozenset(
            (layer.name, n) for layer in chain for n in layer.owned_param_names if (layer.name, n) not in experts
        )

    def batch_cut(self, mesh: Mesh | None) -> BatchCut:
        """The axis cuts the batch: each rank routes its own tokens."""
        return BatchCut(axes=(self.axis,))

    def counts_replicated(self, mesh: Mesh | None) -> bool:
        """Index 0 alone counts the replicated gradients (summed, alike on every index) in the norm;
        every index counts its own loss and tokens (the batch is cut over the axis) and experts."""
        return _mesh(mesh, self.axis).axis_index(self.axis) == 0

    def rng_rank(self, mesh: Mesh | None) -> None:
        """Its own: every rank computes on its own tokens."""
        return None

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        """Per layer, what expert parallel does to it, for the Plan."""
        drops = "each rank drops its assignments over it" if self.drop_per_rank else "a step that would drop is refused"
        bound = "the rank's tokens" if self.capacity_factor is None else (
            f"the capacity (factor {self.capacity_factor}; {drops})"
        )
        notes = {}
        for layer, blocks in resolve(chain).items():
            parts = [
                f"{b.path or '(the layer)'}: {b.num_experts} experts split over {self.axis!r}"
                f"{' (its own forward, calling moe_dispatch_combine)' if b.kind == OWN else ''}; an all-gather of the "
                f"routing counts and two all-to-alls (dispatch, combine) of [experts x slots, hidden] forward, the "
                f"two again backward; slots fixed at its bound, {bound}, so the bytes do not depend on the routing"
                for b in blocks
            ]
            notes[layer] = "expert parallel: " + "; ".join(parts)
        for other in chain:
            if other.param_names and other.name not in notes:
                notes[other.name] = f"expert parallel: replicated gradients summed over {self.axis!r} in backward"
        return notes


class SummedFn:
    """A layer fn whose replicated parameters have their gradients summed over the axis (``grad_summed``)."""

    def __init__(self, fn: Callable[[dict[str, Tensor], Any], Any], axis: str, names: frozenset[str],
                 reduce: torch.dtype | None) -> None:
        self.fn, self.axis, self.names, self.reduce = fn, axis, names, reduce

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        summed = {k: grad_summed(t, self.axis, k, self.reduce) if k in self.names else t for k, t in tensors.items()}
        return self.fn(summed, x)


def _mesh(mesh: Mesh | None, axis: str) -> Mesh:
    if mesh is None:
        raise ValueError(f"expert_parallel(axis={axis!r}) needs the mesh: call step.init(params, mesh)")
    return mesh
