"""The roles a transform's spec plays for the engine, each a written protocol: the few members the
engine may read or call on a spec of that role, and when it does. Nothing else of a spec is
ever asked (engine/stack/compose.py's rules aside, which may name transforms).

Every spec is frozen data with a ``name`` (its transform's), a ``role`` (one of
:data:`ROLES`) and a text form (``str(spec)``, what a TrainState records of the step).
:func:`check_role` refuses a spec that lacks a member of its role's protocol, naming it.

* PLACEMENT (pipeline) decides which layers each rank holds and when they compute.
* SHARDING (shard_params) shards a rank's units over a data-parallel axis.
* SPLIT (tensor_parallel, expert_parallel, context_parallel) cuts parameters, the batch or its
  sequences over an axis and rewrites the layers that compute with them.
* REWRITE (mixed_precision, remat) rewrites layer functions.

A SPLIT is what the engine knows least about, so its protocol says it all:

* what it cuts: ``tensor_splits`` (parameters, each over the split's axis; empty for none),
  ``local_view`` (the slices a rank computes with), ``replicated`` (what every index holds whole),
  and ``batch_cut``, one :class:`BatchCut` (the axes it cuts the batch over, the parts it cuts each
  sequence into, and how to cut a pair of inputs and targets);
* how its layers run: ``rewrite``; the collectives they issue inside a compute go through
  ``stack/in_layer.py``, which records them while the engine predicts the Plan (so the Plan lists
  them after their compute, as ``inside`` actions with their op) and a traced run times them; a
  split may bring its own prediction (:class:`OwnPrediction`: tensor parallel's goes layer by layer),
  else the engine's runs;
* what a rank counts and draws: ``counts_replicated``, ``rng_rank``, ``replica_fix``.

A step asks the stack's splits as one (``stack/splits.py``): none reads as ``NO_SPLIT``, which cuts
nothing; several, one per mesh axis, have their answers combined. So a new split transform touches
no engine file but one rule in compose.py: it lives in its own folder, plays this role, records its
in-layer collectives through ``in_layer``, and compose.py says, if need be, where it cannot go yet
or where its rewrite goes among the others'. expert_parallel and context_parallel are such
transforms: no engine code names them outside compose.py's rules (tests/test_layering.py checks it).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...collectives.mesh import Mesh
from ..layout.state import Params
from ..layout.state_layout import TensorSplit
from ..model.chain import Chain
from .in_layer import Issued

PLACEMENT = "placement"  # decides which layers each rank holds and when they compute (pipeline)
SHARDING = "sharding"  # shards a rank's units over an axis (shard_params)
REWRITE = "rewrite"  # rewrites layer functions (mixed_precision, remat)
SPLIT = "split"  # cuts parameters over an axis and rewrites the layers that use them (tensor_parallel)
ROLES = (PLACEMENT, SHARDING, REWRITE, SPLIT)

# The plan room comes after this one, so its types (Placement's schedule, Action) are Any here.


@dataclass(frozen=True)
class BatchCut:
    """How a split cuts the batch (:meth:`SplitRole.batch_cut`), after shard_params' cut over its axis.

    ``axes``: the mesh axes it cuts the batch (dim 0 of every leaf) over, in order: each index takes
    its own share. ``sequence_parts``: how many parts it cuts each sequence of that share into, and
    ``cut_sequence(pair, rank)``: the part of every sequence of the (inputs, targets) ``pair`` that
    ``rank`` takes (None: the calling rank), along ``sequence_dim`` of every leaf (the loss probe
    halves the targets there). Each share and each part is a replica of the mean: the loss is seeded
    by 1 / (all of them), and each index counts its own loss and tokens.
    """

    axes: tuple[str, ...] = ()
    sequence_parts: int = 1
    cut_sequence: Callable[[Any, int | None], Any] | None = None
    sequence_dim: int = 1

    def __post_init__(self) -> None:
        if self.sequence_parts < 1 or (self.sequence_parts > 1 and self.cut_sequence is None):
            raise ValueError(
                f"BatchCut(sequence_parts={self.sequence_parts}, cut_sequence={self.cut_sequence!r}): a cut of each "
                "sequence into parts (at least 1) says how a rank cuts a pair: give cut_sequence"
            )

    @property
    def cuts(self) -> bool:
        """Whether the split's indices take different shares (and so count their own losses and tokens)."""
        return bool(self.axes) or self.sequence_parts > 1

    def sequence(self, pair: Any, rank: int | None) -> Any:
        """``rank``'s part of every sequence of ``pair`` (the pair itself when sequences are not cut)."""
        return pair if self.cut_sequence is None else self.cut_sequence(pair, rank)


NO_CUT = BatchCut()  # the batch as shard_params left it: every index of the split takes the same


class Spec(Protocol):
    """What every spec has."""

    name: str  # the transform's name: in errors, and in compose.py's rules
    role: str  # one of ROLES: which protocol below the engine reads it by


class PlacementRole(Spec, Protocol):
    """A spec that places the chain's layers on the ranks of an axis and orders their computes."""

    axis: str  # step.init and step.plan: the mesh must have it
    microbatches: int  # the lowering and the batch cut: how many micro-batches a rank's batch is cut into
    poison: bool  # the step's run: whether used transfer buffers are filled with NaN
    trace: bool  # Step.traced: whether a step reports its action times by default

    def place(self, chain: Chain, mesh: Mesh, params: Params | None) -> tuple[Any, Any]:
        """The lowering, once per layout: (Placement, schedule) of the chain on ``mesh``, refusing what cannot run."""
        ...

    def rank_computes(self, placement: Any, schedule: Any, index: int) -> list[Any]:
        """The lowering: the compute actions of the ranks at ``index`` of the axis, in order."""
        ...

    def kept_per_index(
        self, schedule: Any, per_stage: Sequence[int], of_batch: Sequence[int] | None = None
    ) -> tuple[int, ...]:
        """step.plan with a batch: the activation bytes each index keeps for backward."""
        ...


class ShardingRole(Spec, Protocol):
    """A spec that shards each rank's units (a layer's owned parameters, flat) over an axis."""

    axis: str  # the data-parallel axis: the batch is cut over it, the units sharded over it
    # HSDP's second data-parallel axis (None: none): the batch is cut over it too, the shards replicated
    # over it, and each gradient shard all-reduced over it after its reduce-scatter over ``axis``
    replicate: str | None
    stage: int  # ZeRO stage: what is sharded (1: optimizer state, 2: + gradients, 3: + parameters)
    accumulation: int  # the lowering and the batch cut: micro-batches per rank without a pipeline
    reshard_after_forward: bool | None  # compose.reshard_after_forward: None means the stated default

    def insert(
        self, actions: Sequence[Any], stage_needs: Mapping[int, tuple[str, ...]], *, reshard: bool, pipelined: bool,
        deferred: set[str], device: Any = "cpu", holds_shards: bool = False,
    ) -> list[Any]:
        """The lowering: the rank's computes with the gathers, frees and reduce-scatters inserted
        (``device``: where the rank computes, which some of its defaults depend on; ``holds_shards``:
        the state holds shards at rest, stage 3's layout, which the computes gather)."""
        ...


class RewriteRole(Spec, Protocol):
    """A spec that rewrites layer functions (compose.add rebuilds the chain in REWRITE_ORDER)."""

    def rewrite(self, chain: Chain) -> Chain:
        """compose.add, each time the stack changes: ``chain`` with this spec's layer functions."""
        ...

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        """step.plan: per layer, what this spec does to it, for the Plan's notes."""
        ...


class SplitRole(Spec, Protocol):
    """A spec that cuts parameters over an axis and rewrites the layers that compute with them."""

    axis: str  # the mesh must have it; one split per axis (compose.py)
    replica_fix: str  # the replica check's error: how to fix replicated gradients that differ over the axis

    def rewrite(self, chain: Chain, stack: tuple[Any, ...]) -> Chain:
        """compose.add: ``chain`` with the split layers (``stack``: the rest, e.g. a reduce dtype to sum in)."""
        ...

    def layer_notes(self, chain: Chain) -> dict[str, str]:
        """step.plan: per layer, what the split does to it, for the Plan's notes."""
        ...

    def tensor_splits(self, chain: Chain, mesh: Mesh | None) -> dict[tuple[str, str], TensorSplit] | None:
        """step.layout: how each split parameter, by (owner layer, local name), is cut over the axis."""
        ...

    def local_view(self, chain: Chain, params: Params, mesh: Mesh | None, rank: int | None) -> Params:
        """step.layout, init, plan: ``params`` as ``rank`` (None: the calling rank) computes with them."""
        ...

    def replicated(self, chain: Chain) -> frozenset[tuple[str, str]]:
        """The step's run: the parameters every index of the axis holds whole (their gradients must agree)."""
        ...

    def batch_cut(self, mesh: Mesh | None) -> BatchCut:
        """The batch cut (engine/step/batch_cut.py, for the run and the Plan alike): how this split cuts
        the rank's share of the global batch, after shard_params' cut (:data:`NO_CUT`: not at all)."""
        ...

    def counts_replicated(self, mesh: Mesh | None) -> bool:
        """The step's run: whether this rank counts what every index computes alike (loss, tokens,
        replicated gradients) in the metrics; one index per group does, or they would be counted again."""
        ...

    def rng_rank(self, mesh: Mesh | None) -> int | None:
        """The step's run: the rank whose random streams this rank draws (None: its own)."""
        ...


class OwnPrediction(Protocol):
    """What a SPLIT spec may add (:func:`check_role` does not ask for it): its own prediction of the
    collectives its layers issue inside each compute. Without it the engine predicts them
    (``engine/plan/inside.py``'s ``predict_inside``: every stage run whole on fake tensors), which suits
    any split whose layers record their collectives through ``in_layer`` (``stack/in_layer.py``); tensor
    parallel brings its own (layer by layer, each distinct layer once, and zero-bubble's ``I`` and ``W``)."""

    def inner_collectives(
        self, chain: Chain, placement: Any, shapes: Mapping[str, Mapping[str, tuple[torch.Size, torch.dtype]]],
        loss_fn: Callable[[Any, Any], Any], inputs: Any, targets: Any,
        recording: Callable[[], contextlib.AbstractContextManager[list[Issued]]],
        *, split_backward: bool | None = None,
    ) -> dict[tuple[str, int], list[Issued]]:
        """step.plan with a batch: per (compute kind, stage), what its layers record inside ``recording()``
        (the step's ``in_layer.predicting`` block, every split's axes), in order; ``backward_input`` and
        ``backward_weight`` too with ``split_backward`` (None: under a pipeline, ``placement.axis``)."""
        ...


def own_prediction(spec: Any) -> Callable[..., dict[tuple[str, int], list[Issued]]] | None:
    """``spec``'s :class:`OwnPrediction` member, or None: the engine predicts for it."""
    return getattr(spec, "inner_collectives", None)


def prediction_keywords(predict: Callable[..., Any], split_backward: bool) -> dict[str, bool]:
    """The keywords to call a prediction of the in-layer collectives with: ``split_backward`` where it takes it.
    An own prediction written before that keyword (:class:`OwnPrediction`) takes none, and predicts what it did."""
    try:  # (its own signature: a functools.wraps wrapper forwarding **kwargs takes the keyword)
        parameters = inspect.signature(predict, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # (a callable without a signature Python can read)
        return {}
    takes = any((p.name == "split_backward" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
                or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return {"split_backward": split_backward} if takes else {}


PROTOCOLS: dict[str, type] = {
    PLACEMENT: PlacementRole, SHARDING: ShardingRole, REWRITE: RewriteRole, SPLIT: SplitRole,
}


def protocol_members(protocol: type) -> tuple[str, ...]:
    """The members a protocol states (attributes and methods), its bases' included, in order."""
    names: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        for name in (*getattr(cls, "__annotations__", {}), *vars(cls)):
            if not name.startswith("_"):
                names[name] = None
    return tuple(names)


def check_role(spec: Any) -> None:
    """Refuse a spec without a known role, or without a member of its role's protocol, naming it."""
    role = getattr(spec, "role", None)
    if role not in PROTOCOLS:
        raise TypeError(f"{spec!r} has role {role!r}; a transform's role is one of {ROLES}")
    protocol = PROTOCOLS[role]
    missing = [name for name in protocol_members(protocol) if not hasattr(spec, name)]
    if missing:
        raise TypeError(
            f"{type(spec).__name__} plays the role {role!r} but has no {', '.join(repr(m) for m in missing)}: a "
            f"{role} spec implements the engine's protocol {protocol.__name__}: the members the engine asks of it"
        )
