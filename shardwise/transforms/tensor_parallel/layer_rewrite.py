"""The tensor-parallel layer functions: a layer whose modules are styled runs a copy of its module with each
styled module's forward replaced (:class:`~.modules.TPForward`), under the first-call watches (:class:`VaryFn`);
a layer between split layers is guarded (:class:`GuardFn`). :func:`rewrite_layer` and :func:`guard_layer` make them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor, nn

from ...engine.model.chain import Layer
from ...engine.model.module_call import ThreadReplicas, kept_in_copies
from ...engine.model.reuse import reuse_key
from ...engine.stack import in_layer
from ...engine.torch_api import data_dependent_errors
from . import partial, positions
from .comm import vary
from .following import quiet, set_current
from .match import EMBEDDING, Install, LayerPlan, is_gain, is_head_count, param_split
from .modules import TPForward, is_ours
from .own_loss import OwnLossCheck, OwnLossWatch, refuse_own_loss
from .owned_only import OwnedOnly
from .rank_flow import back_to_shared, flow, output_is_split, rank_stream, split_by
from .region_paths import Sides
from .sequence_gather import SequenceGather
from .split_watch import SplitWatch
from .styles import Colwise, Rowwise
from .token_wise_experts import TokenWiseExperts, experts_in_blocks
from .weight_reads import WeightReads


class VaryFn:
    """A layer fn whose replicated parameters used on per-rank values have their gradients summed
    over the axis (``vary``), around the layer fn calling the tensor-parallel module.

    ``names`` are the candidates: the unsplit parameters inside a Region (or a sequence-parallel
    block). Inside a Region, one used only after its split layers (a norm after the Rowwise's sum, a
    projection on a gathered Colwise output) acts on whole values, and its gradient is whole already:
    the first forward that records a graph asks the Regions (Sides) and those are left unsummed, that
    forward's backward included (vary asks in backward), and every later call.
    """

    def __init__(
        self, fn: Callable[[dict[str, Tensor], Any], Any], axis: str, names: frozenset[str], reduce: torch.dtype | None,
        must_run: frozenset[str] = frozenset(), plan: LayerPlan | None = None, own_loss: OwnLossCheck | None = None,
        split: tuple[tuple[str, str, str], ...] = (),
    ) -> None:
        self.fn, self.axis, self.names, self.reduce, self.must_run = fn, axis, names, reduce, must_run
        # Its split parameters and their modules' 0-d gains (local name, path in the model, the module and style
        # splitting it): read only by their own module's forward, which the layer's first call on each rank
        # checks (weight_reads.py).
        self.split = split
        self.own_loss = own_loss  # where it holds heads that leave the logits split (own_loss.py)
        # The ends of the sequence-parallel region this layer holds (partial.py), from the LayerPlan.
        self.follows = plan is not None and plan.follows
        self.partial_out = plan is not None and plan.partial_out
        self.partial_in = plan is not None and plan.partial_in
        self.slices_in = plan is not None and plan.slices_in
        self.slices_out = plan is not None and plan.slices_out
        self.label = "" if plan is None else plan.layer
        # Colwise modules entering the region themselves (no Region watches how their outputs are cut):
        # the layer's first call on each rank watches them (split_watch.py).
        self.watch_cuts = plan is not None and any(
            i.enters and isinstance(i.style, Colwise) and i.kind != EMBEDDING for i in plan.installs
        )
        # Its PerHead parameters (local name, path): followed along their heads through the layer's first
        # call, wherever the layer uses them (the Region around them follows them too, as it binds them).
        self.per_head = () if plan is None else tuple((local, path) for _, _, path, local in plan.per_head)
        self.watch_cuts = self.watch_cuts or bool(self.per_head)
        # Its PerHead buffers and frozen parameters, whole in the layer: (local name, head count) each.
        self.cut_whole = () if plan is None else tuple((local, count) for local, _, _, count in plan.cut_whole)
        self._reuse_key: Any = None
        # The candidates used on whole values only, once a forward has read them (None before): every
        # rank reads the same graph, so every rank's thread writes the same set.
        self.whole: frozenset[str] | None = None

    def set_reuse_key(self, key: Any) -> None:
        self._reuse_key = key

    def reuse_key(self) -> Any:
        """Equal for layers rewritten alike from layers that compute alike (engine/model/reuse.py)."""
        return self._reuse_key

    def summed(self, name: str) -> bool:
        """Whether ``name``'s gradient is summed over the axis (asked in backward)."""
        return self.whole is None or name not in self.whole

    def _varied(self, tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], Sides | None]:
        """``tensors`` with the candidates' gradients summed over the axis, and, until a forward has read
        where they are used, the Sides to read it into."""
        if not self.names:
            return tensors, None
        if self.whole is not None:
            summed = self.names - self.whole
            return {k: vary(t, self.axis, k, self.reduce) if k in summed else t for k, t in tensors.items()}, None
        sides = Sides()
        out = dict(tensors)
        for k, t in tensors.items():
            if k in self.names:
                out[k] = vary(t, self.axis, k, self.reduce, summed=functools.partial(self.summed, k))
                with quiet(), positions.unfollowed():  # reading grad_fn is a tensor op to the followers
                    node = out[k].grad_fn
                if node is not None:
                    sides.names[node] = k
        return out, sides

    def _rank_rows(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` with each PerHead buffer (or frozen parameter) cut to this rank's heads along dim 0,
        the rows a PerHead parameter's shard holds: the same values, never trained, so exact."""
        if not self.cut_whole:
            return tensors
        n, index = in_layer.size(self.axis), in_layer.index(self.axis)
        out = dict(tensors)
        for local, count in self.cut_whole:
            out[local] = tensors[local].narrow(0, index * (count // n), count // n)
        return out

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        tensors = self._rank_rows(tensors)
        tensors, sides = self._varied(tensors)
        outer_sides = getattr(flow, "sides", None)
        flow.sides = sides if sides is not None and sides.names else None
        outer = getattr(flow, "called", None)
        called: set[str] = set()
        flow.called = called
        follower = partial.Follower(self.axis, self.reduce, self.label) if self.follows else None
        outer_follower = set_current(follower)
        own_loss = flow.own_loss = self._own_loss_watch()
        reads = self._reads_watch(tensors)
        watch = self._cut_watch()
        outer_watch = getattr(flow, "watch", None)
        if watch is not None:
            flow.watch = watch
            for local, path in self.per_head:
                watch.watch_per_head(tensors[local], path, in_layer.size(self.axis))
        outer_gathered, flow.gathered = getattr(flow, "gathered", None), None
        outer_entered, flow.entered = getattr(flow, "entered", None), {}
        finished = False
        try:
            with (
                reads if reads is not None else contextlib.nullcontext(),
                own_loss if own_loss is not None else contextlib.nullcontext(),
                watch if watch is not None else contextlib.nullcontext(),
            ):
                out = self._run(tensors, x, follower)
            if watch is not None:
                watch.finish()
            finished = True
        except ValueError as err:  # Python's own on a cut it did not expect ("not enough values to unpack")
            short = None if watch is None or is_ours(err) else watch.short_cut_message(err)
            if short is None:
                raise
            raise ValueError(short) from err
        except RuntimeError as err:  # torch's, on shapes that do not fit: explained if split
            gathered: SequenceGather | None = getattr(flow, "gathered", None)
            if gathered is not None and not is_ours(err) and gathered.explains(err):
                raise ValueError(gathered.message(f"failed ({type(err).__name__}: {err})")) from err
            view = None if watch is None or is_ours(err) else watch.failed_view_message(err)
            if view is not None:  # a view of a Colwise output by whole counts, with no Region to divide them
                raise ValueError(view) from err
            if not output_is_split() or is_ours(err) or isinstance(err, data_dependent_errors()):
                raise  # a fake run's data-dependent op: run again on real stand-ins (predict.py)
            raise ValueError(f"tensor_parallel: {_unsummed(err, self.axis)}") from err
        finally:
            if not finished:  # watched on the next call (a fake run stopped by a data-dependent op: predict.py)
                self._unmark(watch is not None, own_loss is not None, reads is not None)
            flow.gathered = outer_gathered
            flow.entered = outer_entered
            flow.called = outer
            flow.sides = outer_sides
            flow.own_loss = None
            flow.watch = outer_watch
            set_current(outer_follower)
            back_to_shared(force=True)  # a per-rank stream a Colwise began ends with its layer
        if sides is not None and sides.names:  # decided before this forward's backward asks
            sides.mixed()
            with quiet(), positions.unfollowed():  # reading grad_fn is a tensor op to the followers
                sides.on_slice(out, x, self.label)
            self.whole = frozenset(sides.whole)
        missed = sorted(self.must_run - called)
        if missed:
            raise ValueError(
                f"tensor_parallel: this layer computed without calling {missed} as modules (torch.fx traced through "
                "them, or they did not run), so their split parameters were used without their communication; "
                "make each a leaf of the split (a unit of functionalize, or a torch.nn module), or leave it whole "
                "(a module that only holds a tied weight and never runs, as T5's and BART's 'shared', cannot take "
                "a style: leave the embeddings and the head whole there)"
            )
        return out

    def _run(self, tensors: dict[str, Tensor], x: Any, follower: partial.Follower | None) -> Any:
        if follower is None:
            return self.fn(tensors, x)
        first = next((t for t in optree.tree_leaves(x, none_is_leaf=True) if isinstance(t, Tensor)), None)
        if first is not None and self.partial_in:  # the embedding's partial sums, from the layer before
            partial.hold_values(first)
        if first is not None and self.slices_in:  # the last block's output, a slice of the sequence
            partial.hold_slice(first)
        with follower:
            out = self.fn(tensors, x)
        return follower.finish(out, self.partial_out, self.slices_out)

    def _cut_watch(self) -> SplitWatch | None:
        """A watch of how the module cuts the outputs of Colwise modules outside any Region, and of how it uses
        its PerHead parameters, on this layer's first call on this rank (the Plan's prediction, or the first
        step, before any update)."""
        return SplitWatch() if self.watch_cuts and self._first_call("cuts_checked") else None

    def _own_loss_watch(self) -> OwnLossWatch | None:
        """A watch for a loss the model computes on its split logits (own_loss.py), on this layer's first
        call on this rank (the Plan's prediction, or the first step, before any update)."""
        return self.own_loss.watch() if self.own_loss is not None and self._first_call("own_loss_checked") else None

    def _reads_watch(self, tensors: dict[str, Tensor]) -> WeightReads | None:
        """A watch for model code reading a split parameter outside its module's forward (weight_reads.py), on
        this layer's first call on this rank (the Plan's prediction, or the first step, before any update)."""
        if not self.split or not self._first_call("reads_checked"):
            return None
        found = [(tensors[k], path, by, is_gain(path.rsplit(".", 1)[-1])) for k, path, by in self.split if k in tensors]
        return WeightReads(self.label, [(t, path, by) for t, path, by, gain in found if not gain],
                           [(t, path, by) for t, path, by, gain in found if gain])

    def _unmark(self, cuts: bool, own_loss: bool, reads: bool = False) -> None:
        """This call's first-call checks were not done to their end: the next call does them."""
        for check, marked in (("cuts_checked", cuts), ("own_loss_checked", own_loss), ("reads_checked", reads)):
            checked = getattr(flow, check, None)
            if marked and checked is not None:
                checked.discard(self)

    def _first_call(self, check: str) -> bool:
        """Whether this is the layer's first call on this rank for ``check`` (marked as done from now on)."""
        checked = getattr(flow, check, None)
        if checked is None:
            checked = weakref.WeakSet()
            setattr(flow, check, checked)
        if self in checked:
            return False
        checked.add(self)
        return True

    def __repr__(self) -> str:
        return f"tensor_parallel({self.fn!r})"


def _unsummed(err: BaseException, axis: str) -> str:
    """A module failed on the output a sharded Colwise left split: no Rowwise took it."""
    return (
        f"Colwise() on {split_by()!r} left its output split over {axis!r} (output='sharded') and "
        f"no Rowwise() took it, so the module after it failed ({type(err).__name__}: {err}); give "
        "that module Rowwise() in the plan (both in one Region), or the Colwise output='replicated' (outside "
        "the sequence-parallel blocks)"
    )


class GuardFn:
    """A layer fn tensor parallel leaves as it is, which names a likely cause when it fails on a value a
    Colwise left split (its output="sharded" reaching a module that is not a Rowwise). A layer that
    sits between a layer of sharded Colwise modules and the layer of their Rowwise (``between``:
    decided from the chain's order, so a recomputation decides alike) acts on per-rank values and
    draws this rank's random stream."""

    def __init__(
        self, fn: Callable[[dict[str, Tensor], Any], Any], layer: str, axis: str, between: bool = False
    ) -> None:
        self.fn, self.layer, self.axis, self.between = fn, layer, axis, between

    def reuse_key(self) -> Any:
        """Equal for guarded layers that compute alike (engine/model/reuse.py); its name is for errors."""
        inner = reuse_key(self.fn)
        return None if inner is None else (GuardFn, self.axis, self.between, inner)

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        if self.between:
            with rank_stream(self.axis, (x,), {}, sticky=True):
                return self._call(tensors, x)
        return self._call(tensors, x)

    def _call(self, tensors: dict[str, Tensor], x: Any) -> Any:
        if not output_is_split():
            return self.fn(tensors, x)
        try:
            return self.fn(tensors, x)
        except RuntimeError as err:  # what torch raises on shapes that do not fit (not its control flow)
            if isinstance(err, data_dependent_errors()):
                raise  # a fake run's data-dependent op: run again on real stand-ins (predict.py)
            message = f"tensor_parallel: layer {self.layer!r}: {_unsummed(err, self.axis)}"
            raise ValueError(message) from err

    def __repr__(self) -> str:
        return repr(self.fn)


def guard_layer(layer: Layer, axis: str, between: bool) -> Layer:
    """``layer`` as it is, naming the likely cause when it fails on a split value (see GuardFn)."""
    return Layer(layer.name, GuardFn(layer.fn, layer.name, axis, between), layer.param_names, layer.buffers, layer.ties,
                 layer.frozen)


def rewrite_layer(
    layer: Layer, plan: LayerPlan, axis: str, reduce: torch.dtype | None, logits_heads: tuple[str, ...] = (),
    aux_loss: str | None = None,
) -> Layer:
    """``layer`` calling a copy of its module with the tensor-parallel forwards installed; sums
    travel in ``reduce`` (None: the values' own dtype). ``logits_heads``: the layer's Colwise modules
    that leave the logits split for the loss, if any (the copy then refuses to compute its own loss).
    ``aux_loss``: the step's router_aux_loss, if any (refused with experts in a sequence-parallel block)."""
    fn = layer.fn
    replicas = fn.replicas  # type: ignore[attr-defined]
    module = replicas.module
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    copied = copy.deepcopy(module, memo={**kept_in_copies(module), **{id(t): t for _, t in named}})
    blocks = {sub: (first, last) for sub, _path, first, last in plan.blocks}
    installs = {i.subpath: i for i in plan.installs}
    for subpath in sorted(set(blocks) | set(installs)):
        target = copied.get_submodule(subpath)
        path = (
            installs[subpath].path if subpath in installs else next(p for sub, p, _, _ in plan.blocks if sub == subpath)
        )
        block = blocks.get(subpath)
        install = installs.get(subpath)
        target.forward = TPForward(
            target, axis, install, block, reduce, path,
            slices_after=plan.slices_after and block is not None and block[1],
            head_counts=_enclosing_head_counts(copied, install) if install is not None else None,
            in_block=next((p for _, p, _, _ in plan.blocks if path.startswith(p + ".")), None),
            per_head=tuple((name, where) for sub, name, where, _ in plan.per_head if sub == subpath),
        )
    for subpath, path, in_block in experts_in_blocks(copied, [(sub, p) for sub, p, _, _ in plan.blocks]):
        if aux_loss is not None:
            raise ValueError(
                f"tensor_parallel(sequence_parallel=...) under {aux_loss}: inside sequence-parallel block {in_block!r} "
                f"the mixture of experts around {path!r} routes only this rank's slice of the sequence, so its "
                "routing statistics would be the slice's and the aux loss another than the whole sequence's; leave "
                f"{in_block!r} out of sequence_parallel, or the aux loss out"
            )
        if subpath not in installs:  # (a style on the experts is refused where the plan is matched)
            target = copied.get_submodule(subpath)
            target.forward = TokenWiseExperts(target, path, in_block)
    owners: dict[str, dict[str, str]] = {}
    for subpath, attr, refusal in plan.owned_only:
        owners.setdefault(subpath, {})[attr] = refusal
    for subpath, refusals in owners.items():
        owner = copied.get_submodule(subpath)
        owner.forward = OwnedOnly(owner, refusals)
    own_loss = None
    if logits_heads:
        refuse_own_loss(copied, axis, logits_heads)
        own_loss = OwnLossCheck.of(copied, axis, logits_heads)
    new_fn = copy.copy(fn)
    new_fn.replicas = ThreadReplicas(copied, replicas.prefix)  # type: ignore[attr-defined]
    must_run = frozenset(i.path for i in plan.installs if i.must_run)
    vary_fn = VaryFn(new_fn, axis, frozenset(plan.vary), reduce, must_run, plan, own_loss,
                     _split_parameters(module, replicas.prefix, plan, layer.param_names))
    vary_fn.set_reuse_key(_rewrite_key(layer.name, fn, plan, axis, reduce))
    return Layer(layer.name, vary_fn, layer.param_names, layer.buffers, layer.ties, layer.frozen)


def _split_parameters(
    root: nn.Module, prefix: str, plan: LayerPlan, names: Any
) -> tuple[tuple[str, str, str], ...]:
    """The layer's parameters its Colwise / Rowwise modules split, and their 0-d gains: (local name, path in the
    model, the module and style), each under the name the layer feeds it by (a tied one's first, as match.py names
    it)."""
    first = {id(t): n for n, t in root.named_parameters()}
    found: dict[str, tuple[str, str, str]] = {}
    for install in plan.installs:
        if not isinstance(install.style, (Colwise, Rowwise)):
            continue
        module = root.get_submodule(install.subpath)
        for name, t in module.named_parameters(recurse=False):
            local = prefix + first.get(id(t), f"{install.subpath}.{name}".lstrip("."))
            # A 0-d gain beside the weight (match.py sums its gradient over the axis) is watched as they are.
            if local in names and (param_split(install.style, install.kind, name, module) is not None or is_gain(name)):
                path = f"{install.path}.{name}".lstrip(".")
                found.setdefault(local, (local, path, f"{install.path!r} ({install.style}, a {type(module).__name__})"))
    return tuple(found.values())


def _enclosing_head_counts(root: nn.Module, install: Install) -> dict[str, tuple[str, int]]:
    """The head counts (attribute -> (module path, value)) the modules enclosing a Colwise outside any
    Region hold, innermost first: nothing divides them, so a per-head view by one is refused."""
    if not (install.enters and isinstance(install.style, Colwise) and install.kind != EMBEDDING):
        return {}
    found: dict[str, tuple[str, int]] = {}
    sub, path = install.subpath.split("."), install.path.split(".")
    for up in range(1, len(sub) + 1):
        owner = root.get_submodule(".".join(sub[:-up]))
        where = ".".join(path[:-up]) or "<the layer's module>"
        for attr, value in vars(owner).items():
            if type(value) is int and is_head_count(attr) and attr not in found:
                found[attr] = (where, value)
    return found


def _rewrite_key(name: str, fn: Any, plan: LayerPlan, axis: str, reduce: torch.dtype | None) -> Any:
    """What decides a rewritten layer's computation, its names relative to the layer (so that the
    blocks of a stack, rewritten alike, compute alike: engine/model/reuse.py); None when the layer
    fn does not say what it computes, or a style cannot be compared."""
    inner = reuse_key(fn)
    if inner is None:
        return None
    prefix = name + "."
    installs = tuple(sorted(
        (i.subpath, i.style, i.kind, i.seq_dim, i.enters, i.region and i.region.removeprefix(prefix), i.must_run,
         i.to_sequence)
        for i in plan.installs
    ))
    blocks = tuple(sorted((sub, first, last) for sub, _path, first, last in plan.blocks))
    ends = (plan.partial_in, plan.partial_out, plan.slices_after, plan.slices_out, plan.slices_in)
    owned_only = tuple(sorted((sub, attr) for sub, attr, _ in plan.owned_only))
    per_head = tuple(sorted((sub, name) for sub, name, _, _ in plan.per_head))
    key = (VaryFn, axis, reduce, installs, blocks, tuple(sorted(v.removeprefix(prefix) for v in plan.vary)), ends,
           owned_only, per_head, inner)
    try:
        hash(key)
    except TypeError:
        return None
    return key
