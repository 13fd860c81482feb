"""Composition rules: which transform stacks are accepted, and what each transform does when
another is there. Stated once, here, over the stack of frozen specs a Step carries.

A transform appends its spec to ``step.transforms`` through :func:`add`, which
checks the whole new stack. Each spec has a ``name`` (the transform's), a
``role`` (what the engine's lowering asks of it) and a text form, and implements
its role's protocol (``engine/stack/roles.py``: a spec lacking a member is refused,
naming it). The rules:

* Every transform is applied at most once: a second ``remat`` (also with
  ``mixed_precision`` between the two), ``mixed_precision``, ``shard_params``
  or ``pipeline`` is refused. Apply it once, with the options you want.
* A stack holds at most one spec of each of the roles PLACEMENT and SHARDING, whatever the
  transforms' names: the lowering asks the stack for *the* spec of such a role (:func:`find`), so a
  second one would be ignored. REWRITE specs (mixed_precision and remat) stack: each rewrites the chain.
* One split per axis: SPLIT specs stack when each goes over a mesh axis of its own (no other
  transform's either), and the engine asks them as one split (``stack/splits.py``: their cuts merged,
  their batch cuts in order, every axis's replicas checked). At most one of them brings its own
  prediction of the in-layer collectives (the engine runs one predictor, which records them all).
  Which splits may share a stack yet is :data:`NOT_YET_TOGETHER`'s to say.
* ``shard_params`` and ``pipeline`` go over different mesh axes, in either
  order: the lowering is the same (the pipeline decides which layers a rank
  holds and when they compute; ZeRO shards that rank's layers over its axis).
* Under a pipeline, ZeRO does not reshard after forward by default: a stage's
  units are gathered before their first compute of the step and kept to their
  last (torchtitan's rule for PP: per-micro-batch all-gathers would cost more
  than they save). ``reshard_after_forward=True`` given explicitly frees a
  unit after every forward not followed by another forward, and after every
  compute the next one does not share, and gathers it again (FSDP2's reshard
  per micro-batch: least memory, most traffic). ``prefetch`` gathers the units
  of the next computes on this rank early, as without a pipeline.
* HSDP, ``shard_params(axis, replicate=r)``: ``r`` is a second data-parallel axis of the same
  mesh, over which every index holds the same shards; it is none of the other axes (not
  ``axis``, the pipeline's or a split's). Everything ZeRO does over ``axis`` stays as it is
  (stages, gathers, buckets, prefetch, accumulation, the pipeline's and the splits' rules above
  and below): the batch is cut over ``r`` before ``axis``, and each gradient shard is all-reduced
  over ``r`` after its reduce-scatter over ``axis``, in the reduce dtype, before the update.
* Under a pipeline, ``shard_params(accumulation=k)`` is refused: the
  pipeline's micro-batches are the accumulation (use ``microbatches=``).
* ``tensor_parallel`` goes over its own mesh axis, not shard_params' nor the
  pipeline's: 2-D is ``Mesh(dp=2, tp=2)`` with ZeRO sharding each rank's
  tensor-parallel slices over ``dp``; 3-D adds ``pp``, whose stages hold those
  slices. Its layers are rewritten first (innermost): remat then recomputes a
  layer's collectives with its forward, and the precision casts go around them,
  so its sums travel in each layer's reduce dtype and its gathers in the
  compute dtype.
* ``expert_parallel`` goes over its own mesh axis, which is also a batch axis: the batch is cut
  over shard_params' axis, then over ``ep``; a replicated parameter's gradient is summed over ``ep``
  inside the layers (the mean, with the loss seeded by 1 / (dp x ep)), then ZeRO reduces over ``dp``
  as usual, sharding each rank's local parameters (its experts among them) over ``dp``. It is a SPLIT
  like tensor_parallel. With ``tensor_parallel`` over another axis the experts are split over ``ep`` and
  attention over ``tp`` (tensor_parallel rewrites first; expert_parallel finds the MoE blocks through
  its layer wrapper and installs its forward on them; every tp rank routes the same tokens, so the
  experts are replicated over ``tp``). Under a
  pipeline each stage's MoE blocks route their micro-batch's tokens over ``ep`` (a stage's ranks on
  ``ep`` run the same schedule, so their all-to-alls pair up; each compute lists its own).
  mixed_precision and remat go around its layers as around tensor_parallel's (its gradient sums travel
  in the reduce dtype).
* ``context_parallel`` goes over its own mesh axis, which cuts the *sequence* of every batch leaf
  (after shard_params' cut of the batch over ``dp``): each part is a share, the loss seeded by
  1 / (dp x cp); every parameter is replicated over ``cp`` and its gradient summed over ``cp`` inside
  the layers, then ZeRO reduces over ``dp`` as usual. Under a pipeline each stage's layers cut their
  micro-batch's sequence over ``cp`` (a stage's ranks on ``cp`` run the same schedule, so their ring
  sends pair up; each compute lists its own). With ``tensor_parallel`` over another axis each tp
  rank's heads attend over ``cp`` (tensor_parallel rewrites first; context_parallel's attention
  forward runs inside tensor_parallel's Region on the module). With ``expert_parallel`` over another
  axis each rank routes the tokens of its batch share's sequence part (the batch cut over ``ep``, the
  sequence over ``cp``; each finds its modules through the other's layer wrapper).
* ``mixed_precision`` and ``remat`` rewrite layer functions, in any order with
  the others, and the result does not depend on the order: the layers are
  rebuilt from the chain train_step got, remat innermost and the precision
  casts around it (a checkpointed layer then keeps its compute-dtype input,
  not the input before the cast). Under ``mixed_precision`` ZeRO gathers
  parameters in the compute dtype and reduces gradients in the reduce dtype.
  :data:`REWRITE_ORDER` states that order once; a rewriting transform it does not
  place is refused.
* ``router_aux_loss`` rewrites outermost (after the casts): each layer carries its MoE blocks' routing
  statistics beside its output to the loss, which sums the counts over every axis that cuts the batch
  (``in_layer.batch_sum``) so the aux loss is the whole batch's, counted once. The Plan lists those
  sums after the loss, predicted on fake tensors as a split's collectives are, also under
  ``shard_params`` alone (:func:`sums_over_batch`); alone, or under a pipeline, the batch is not cut over
  ranks and nothing is summed. Several splits rebuild innermost, tensor_parallel first (:data:`SPLIT_ORDER`).
* A model that computes something over the whole batch it is called on (``engine/model/whole_batch.py``)
  is refused under a transform that calls it on a part of the batch: a PLACEMENT of more than one
  micro-batch, a SHARDING (each rank's share, accumulation's micro-batches), a SPLIT with ``cuts_batch``.
  Three causes: a layer that normalises with its batch's own statistics (BatchNorm in training mode or
  without running statistics: each part would be normalised with its own; GroupNorm or LayerNorm
  instead), a layer known to read other rows for a token's output (Doge's MoE router), and a loss that
  adds a term of its batch (Hugging Face's ``output_router_logits=True``: each
  part's aux loss; router_aux_loss instead). The second is also refused under a transform that
  ``adds_batch_loss`` (router_aux_loss, which adds it again): router_aux_loss on the model without its
  own is the aux loss of the whole batch. A transform that gives every rank the whole batch (a
  tensor_parallel alone, a pipeline of one micro-batch) accepts both.
* An optimizer whose update is handed pieces of parameters says it is elementwise
  (``stack/elementwise.py``): ZeRO hands it one flat 1-D shard per layer, at every stage; a split
  that cuts parameters (tensor_parallel, expert_parallel) its slices of them. A user's optimizer
  that does not declare ``elementwise = True`` is refused there, when the transform is applied:
  a per-tensor rule (a norm, a shape) would read the piece and train another step silently.
  sw.optim's optimizers are elementwise; a pipeline, context parallel and one device hand it
  whole parameters, and take any optimizer.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Protocol, TypeVar

from ..model.chain import Chain
from ..model.embedding_options import option_fix
from ..model.whole_batch import BATCH_STATISTICS, FREQUENCIES, LOSS_TERM, ROWS_MIXED, WholeBatch, over_whole_batch
from .elementwise import check_optimizer
from .roles import PLACEMENT, REWRITE, ROLES, SHARDING, SPLIT, check_role, own_prediction

__all__ = [
    "NOT_YET_TOGETHER", "ONCE", "PLACEMENT", "REWRITE", "REWRITE_ORDER", "ROLES", "SHARDING", "SPLIT", "SPLIT_ORDER",
    "add", "check_stack", "cutting_the_batch", "describe", "find", "refuse_frequencies", "reshard_after_forward",
    "rewrites_in_order",
]


class Stacked(Protocol):
    """What the rules need of a step (engine/step/step.py's Step): its stack and its chains."""

    @property
    def transforms(self) -> tuple[Any, ...]: ...

    @property
    def base_chain(self) -> Chain: ...

    @property
    def optimizer(self) -> Any: ...


S = TypeVar("S", bound=Stacked)

_REBUILDS = (REWRITE, SPLIT)  # the roles whose specs rebuild the chain
# The order add() rebuilds the chain in, innermost first, whatever order the transforms were applied
# in (the rules above): the split's layers (remat then recomputes their collectives with their
# forward, and the casts go around them), remat's checkpoints, mixed_precision's casts around both.
# A rebuilding spec is placed by its role (SPLIT) or, for REWRITE specs, by its transform's name.
REWRITE_ORDER = (SPLIT, "remat", "mixed_precision", "router_aux_loss")
# Several splits (one per axis) rebuild in this order of their names, innermost first, then the others
# in the order they were applied: tensor_parallel installs its forwards in the layers' modules, which a
# split that wraps the layer functions (a gradient sum around each) would hide from it.
SPLIT_ORDER = ("tensor_parallel",)
# The roles the engine looks up with find(), which returns one spec: a second would be ignored.
ONCE = (PLACEMENT, SHARDING)
# Splits that cannot share a stack yet, and why, by their names (one split per axis holds for the rest):
# a pair named here is refused with its message ({a} and {b}: the two names). None today: each split
# rewrites a layer by wrapping its function (tensor_parallel's guard and gradient sums,
# expert_parallel's and context_parallel's gradient sums), and each of expert_parallel and
# context_parallel finds its modules (the MoE, the attention) through another's wrapper, following its
# ``fn``; context_parallel installs its attention forward beneath tensor_parallel's Region.
NOT_YET_TOGETHER: dict[frozenset[str], str] = {}


def _check_whole_batch_losses(stack: tuple[Any, ...]) -> None:
    """A loss term over the whole batch (the router aux loss: a product of two batch means) cannot be
    computed one micro-batch at a time: each micro-batch's term would be over its own tokens, another
    loss than the single-device step's, so micro-batches are refused unless the spec was told that
    mean of per-micro-batch terms is the loss wanted (``per_microbatch``)."""
    whole = [s for s in stack if s.name == "router_aux_loss" and not s.per_microbatch]
    cutting = [
        s for s in stack if getattr(s, "microbatches", 1) > 1 or getattr(s, "accumulation", 1) > 1
    ]
    if whole and cutting:
        raise ValueError(
            f"{whole[0]} with micro-batches ({describe(stack)}): the aux loss is a product of two means over "
            "the whole batch, which no micro-batch knows before it runs, so each micro-batch's would be over "
            "its own tokens and the step would train another loss than the single-device step's, without an "
            f"error. Pass sw.router_aux_loss(step, {whole[0].coef!r}, per_microbatch=True) for that mean of "
            "per-micro-batch losses (Hugging Face's under gradient accumulation), or use one micro-batch"
        )


def sums_over_batch(stack: tuple[Any, ...]) -> bool:
    """Whether a transform of the stack adds a loss term of the whole batch (``adds_batch_loss``: the
    router aux loss), whose loss sums statistics over the batch's axes (``in_layer.batch_sum``): collectives
    the Plan predicts on fake tensors as it does a split's, also where the stack has no split (ZeRO alone)."""
    return any(getattr(spec, "adds_batch_loss", False) for spec in stack)


def describe(stack: tuple[Any, ...]) -> str:
    return " -> ".join(str(s) for s in stack) or "(no transform)"


def check_stack(stack: tuple[Any, ...]) -> None:
    """Refuse a stack that cannot work, naming the transforms and the fix."""
    seen: dict[str, Any] = {}
    for spec in stack:
        check_role(spec)
        if spec.role == REWRITE and spec.name not in REWRITE_ORDER:
            raise TypeError(
                f"{spec} rewrites layers, but compose.REWRITE_ORDER {REWRITE_ORDER} does not say where its rewrite "
                f"goes among the others: add {spec.name!r} to that table of the engine's stack rules"
            )
        if spec.name in seen:
            raise ValueError(
                f"{spec.name} was applied twice (the stack is {describe(stack)}; already {seen[spec.name]}); "
                f"apply {spec.name} once, with the options you want"
            )
        seen[spec.name] = spec
    _check_once_roles(stack)
    _check_axes(stack)
    split = [s for s in stack if s.role == SPLIT]
    _check_splits(stack, split)
    placement = [s for s in stack if s.role == PLACEMENT]
    sharding = [s for s in stack if s.role == SHARDING]
    _check_whole_batch_losses(stack)
    replicate = sharding[0].replicate if sharding else None
    for other in (*placement, *split):
        if replicate is not None and other.axis == replicate:
            raise ValueError(
                f"shard_params(replicate={replicate!r}) and {other.name} both use axis {replicate!r} "
                f"({describe(stack)}); HSDP replicates the shards over an axis of its own: e.g. "
                f"sw.Mesh(node=2, dp=2, {'pp' if other.role == PLACEMENT else 'tp'}=2) with "
                f"shard_params(..., 'dp', replicate='node')"
            )
    if placement and sharding:
        pipe, zero = placement[0], sharding[0]
        if pipe.axis == zero.axis:
            raise ValueError(
                f"shard_params and pipeline both use axis {zero.axis!r} ({describe(stack)}); give them different "
                "axes of one mesh, e.g. sw.Mesh(dp=2, pp=2) with shard_params(..., 'dp') and pipeline(..., 'pp')"
            )
        if zero.accumulation != 1:
            raise ValueError(
                f"shard_params(accumulation={zero.accumulation}) with pipeline ({describe(stack)}): the pipeline's "
                "micro-batches are the accumulation; drop accumulation and set pipeline(..., microbatches=...)"
            )


def _check_axes(stack: tuple[Any, ...]) -> None:
    """Refuse two transforms over one mesh axis where a split is one of them (one split per axis)."""
    for i, spec in enumerate(stack):
        for other in stack[i + 1:]:
            if SPLIT in (spec.role, other.role) and getattr(spec, "axis", None) is not None and (
                getattr(other, "axis", None) == spec.axis
            ):
                split, rest = (spec, other) if spec.role == SPLIT else (other, spec)
                raise ValueError(
                    f"{split.name} and {rest.name} both use axis {split.axis!r} ({describe(stack)}); one split per "
                    f"axis: give them different axes of one mesh, e.g. sw.Mesh(dp=2, tp=2) with "
                    "shard_params(..., 'dp') and tensor_parallel(..., 'tp')"
                )


def _check_splits(stack: tuple[Any, ...], splits: list[Any]) -> None:
    """Refuse splits that cannot share a stack yet, and two that bring their own in-layer prediction."""
    for i, a in enumerate(splits):
        for b in splits[i + 1:]:
            why = NOT_YET_TOGETHER.get(frozenset({a.name, b.name}))
            if why is not None:
                first, second = sorted((a.name, b.name))
                raise ValueError(
                    f"{why.format(a=first, b=second)} ({describe(stack)}); apply one of them (the other's axis can "
                    "go to shard_params)"
                )
    own = [s.name for s in splits if own_prediction(s) is not None]
    if len(own) > 1:
        raise ValueError(
            f"{' and '.join(own)} each bring their own prediction of their layers' collectives ({describe(stack)}), "
            "but a step runs one predictor for all its splits: apply one of them"
        )


def _check_once_roles(stack: tuple[Any, ...]) -> None:
    """Refuse a second spec of a role in :data:`ONCE`, naming both transforms."""
    first: dict[str, Any] = {}
    for spec in stack:
        if spec.role not in ONCE:
            continue
        if spec.role in first:
            raise ValueError(
                f"{spec} and {first[spec.role]} both play the role {spec.role!r} "
                f"(the stack is {describe(stack)}); the engine lowers one {spec.role} transform "
                f"per step and would ignore the second: apply only one of them"
            )
        first[spec.role] = spec


# Rebuilt chains by source chain, then by the rewriting specs in order: a rebuild is a pure function
# of those, and an expensive one on a large model (tensor parallel copies the module structure of
# every layer: seconds for 80 decoder layers), which every transform added after a rewriting one
# would otherwise repeat, and a search repeats for every candidate sharing those rewrites.
_REBUILT: weakref.WeakKeyDictionary[Chain, dict[tuple[Any, ...], Chain]] = weakref.WeakKeyDictionary()


def _rebuilt(source: Chain, stack: tuple[Any, ...]) -> Chain:
    ordered = tuple(rewrites_in_order(stack))
    try:
        known = _REBUILT.setdefault(source, {})
        found = known.get(ordered)
    except TypeError:  # a spec that cannot be a key (unhashable): rebuild without the cache
        known, found = None, None
    if found is not None:
        return found
    chain = source
    for rewrite in ordered:
        # A split reads the other rewrites (mixed_precision's reduce dtype applies to its sums), and
        # only them: the cache's key is those rewrites, so a split shown the whole stack could build
        # from a placement or a sharding spec and be handed back for a stack with another one.
        chain = rewrite.rewrite(chain, ordered) if rewrite.role == SPLIT else rewrite.rewrite(chain)
    if known is not None:
        known[ordered] = chain
    return chain


def add(step: S, spec: Any, **fields: Any) -> S:
    """``step`` with ``spec`` appended to its stack, once the new stack passes :func:`check_stack`
    (and with ``fields`` replaced); a rewriting spec rebuilds the layers from the source chain."""
    stack = (*step.transforms, spec)
    check_stack(stack)
    _check_whole_batch(step.base_chain, stack)
    check_optimizer(stack, step.optimizer)
    new = dataclasses.replace(step, transforms=stack, **fields)  # type: ignore[type-var]
    if spec.role not in _REBUILDS:
        return new
    chain = _rebuilt(step.base_chain, stack)
    return dataclasses.replace(new, chain=chain, source_chain=step.base_chain)  # type: ignore[type-var]


def _check_whole_batch(chain: Chain, stack: tuple[Any, ...]) -> None:
    """Refuse a model that computes something over the whole batch it is called on (engine/model/
    whole_batch.py: a layer normalising with its batch's statistics, a loss adding a term of its batch)
    under a transform that calls it on a part of the batch (:func:`cutting_the_batch`), and a model
    adding its routers' aux loss under one that ``adds_batch_loss`` the same term again (router_aux_loss)."""
    cutting = cutting_the_batch(stack)
    adding = [s.name for s in stack if getattr(s, "adds_batch_loss", False)]
    if not cutting and not adding:
        return
    found = over_whole_batch(chain)
    statistics = [w for w in found if w.cause == BATCH_STATISTICS]
    loss_terms = [w for w in found if w.cause == LOSS_TERM]
    if loss_terms and (cutting or adding):
        _refuse_loss_term(loss_terms[0], cutting[0][0] if cutting else None, adding)
    if statistics and cutting:
        _refuse_batch_statistics(statistics, cutting[0][1])
    mixing = [w for w in found if w.cause == ROWS_MIXED]
    if mixing and cutting:
        _refuse_rows_mixed(mixing[0], cutting[0][1])
    counted = [w for w in found if w.cause == FREQUENCIES]
    if counted and cutting:
        refuse_frequencies(counted[0], cutting[0][1])


def cutting_the_batch(stack: tuple[Any, ...]) -> list[tuple[str, str]]:
    """(name, words) of each transform of ``stack`` that calls the model on a part of the batch: a pipeline
    of more than one micro-batch (one micro-batch is the whole batch), a sharding (data parallel: each rank
    its share, and accumulation's micro-batches), a split that ``cuts_batch`` (a share, or a part of every
    sequence, per rank)."""
    cutting = []
    for s in stack:
        if s.role == PLACEMENT and s.microbatches > 1:
            cutting.append((s.name, f"{s.name} with {s.microbatches} micro-batches"))
        elif s.role == SHARDING:
            over = f"over axis {s.axis!r}" + (f" and {s.replicate!r}" if s.replicate is not None else "")
            extra = f", accumulation={s.accumulation}" if s.accumulation > 1 else ""
            cutting.append((s.name, f"{s.name} (data parallel {over}{extra})"))
        elif getattr(s, "cuts_batch", False):
            cutting.append((s.name, f"{s.name} over axis {s.axis!r}"))
    return cutting


def _refuse_loss_term(found: WholeBatch, cutting: str | None, adding: list[str]) -> None:
    if cutting is not None:
        why = (
            f"under {cutting} each rank (or micro-batch) calls it on a part of the batch, so the step would train "
            "on the mean of the parts' aux losses, another loss than the single-device step's (the aux loss is not "
            "linear in the batch)"
        )
    else:
        why = f"{adding[0]} adds the same loss again, so it would be counted twice"
    raise ValueError(
        f"{found} adds its routers' load-balancing loss to the loss it returns (output_router_logits=True): {why}. "
        "Set config.output_router_logits = False before functionalize and apply sw.router_aux_loss(step, coef) "
        "first, which counts the aux loss over the whole batch on every mesh (or just False, where your loss_fn "
        "reads only the logits and the model's own loss is never used)"
    )


def _refuse_batch_statistics(found: list[WholeBatch], cutting: str) -> None:
    others = ", ".join([repr(w.path) for w in found[1:4]] + (["..."] if len(found) > 4 else []))
    more = f" (and {len(found) - 1} more: {others})" if len(found) > 1 else ""
    raise ValueError(
        f"{found[0]}{more} normalises over the batch dimension with the mean and "
        f"variance of the batch it is called on, and under {cutting} each rank (or micro-batch) calls it on a "
        "part of the batch: each part would be normalised with its own statistics, so the step would compute "
        "another loss and update than the single-device step, without an error. Use a per-sample normalisation "
        "(nn.GroupNorm, nn.LayerNorm) instead, or run without cutting the batch (one device, tensor_parallel "
        "alone, a pipeline with microbatches=1); a BatchNorm in eval mode with running statistics normalises "
        "with those and is accepted"
    )


def _refuse_rows_mixed(found: WholeBatch, cutting: str) -> None:
    raise ValueError(
        f"{found}. Under {cutting} each rank (or micro-batch) calls the model on a part of the batch, so what it "
        "reads of other rows would come from that part's rows alone, not from the whole batch as on one device: "
        "another model, trained without an error. Run it without cutting the batch (one device, tensor_parallel "
        "alone, a pipeline with microbatches=1)"
    )


def refuse_frequencies(found: WholeBatch, cutting: str) -> None:
    """Refuse ``found`` (cause FREQUENCIES) under the transform ``cutting`` names: here when the transform is
    added, or at a step's first call of the layer where functionalize saw no call (engine/run/frequency_watch.py)."""
    raise ValueError(
        f"{found} divides each row's gradient by how often the batch it is called on looks the row up, and under "
        f"{cutting} each rank (or micro-batch) calls it on a part of the batch: each part would divide by its own "
        "counts, so the step would compute another update than the single-device step, without an error. "
        f"Instead: {option_fix('scale_grad_by_freq')}; or run without cutting the batch (one device, a pipeline "
        "with microbatches=1)"
    )


def rewrites_in_order(stack: tuple[Any, ...]) -> list[Any]:
    """The specs of ``stack`` that rebuild the chain, in :data:`REWRITE_ORDER` (innermost first)."""
    rebuilding = [s for s in stack if s.role in _REBUILDS]

    def place(spec: Any) -> tuple[int, int]:
        if spec.role != SPLIT:
            return REWRITE_ORDER.index(spec.name), 0
        named = SPLIT_ORDER.index(spec.name) if spec.name in SPLIT_ORDER else len(SPLIT_ORDER)
        return REWRITE_ORDER.index(SPLIT), named

    return sorted(rebuilding, key=place)  # stable: the rest in the order applied


def find(stack: tuple[Any, ...], role: str) -> Any:
    """The spec playing ``role`` in the stack, or None (check_stack allows one per role in ONCE)."""
    for spec in stack:
        if spec.role == role:
            return spec
    return None


def reshard_after_forward(sharding: Any, pipelined: bool) -> bool:
    """The rule above: an explicit choice wins; by default, reshard alone, keep under a pipeline."""
    if sharding.reshard_after_forward is not None:
        return bool(sharding.reshard_after_forward)
    return not pipelined
