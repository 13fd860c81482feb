"""The tensor-parallel forward of each styled module, installed on a copy of the layer's module.

The layer code does not change: each styled module of a layer's module gets a
``forward`` attribute (a :class:`TPForward`, which pickles and deep-copies with
its module) that calls the class's own forward around the communication of
``comm.py``; the layer fn is a copy of the original one calling that module.
The original model, and the single-device step's layers, are untouched.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...engine.run.rng import default_generators
from ...engine.stack import in_layer
from ...engine.torch_api import data_dependent_errors
from . import partial, positions
from .comm import enter, gather_invariant, leave, scatter
from .failures import colwise_subclass_failed, region_failed, rowwise_width_message
from .following import quiet
from .head_arguments import HeadArguments
from .head_numbers import HeadCount
from .match import CONV1D, EMBEDDING, LINEAR, Install, is_head_count
from .product_views import HeadView
from .rank_flow import back_to_shared, flow, rank_stream, start_rank_stream
from .region_paths import Sides, bypass_message, bypasses_split, parameter_sides, summed_on_entry
from .region_probe import ReachedSplit, RegionProbe
from .sequence_gather import SequenceGather
from .split_watch import SplitWatch
from .styles import Colwise, Region, Rowwise, gathers
from .token_wise_experts import one_ops_in
from .weight_reads import block_views_of, check_product, follow_input, head_view_of, own_use, reads_watched


class TPForward:
    """A styled module's forward under tensor parallel: communication around the class's forward."""

    def __init__(
        self, module: nn.Module, axis: str, install: Install | None, block: tuple[bool, bool] | None,
        reduce: torch.dtype | None, path: str, slices_after: bool = False,
        head_counts: dict[str, tuple[str, int]] | None = None, in_block: str | None = None,
        per_head: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.module, self.axis, self.install, self.block, self.reduce = module, axis, install, block, reduce
        # A Region's parameters split by their heads (PerHead): (name in the module, path in the model).
        self.per_head = per_head
        self.in_block = in_block  # the sequence-parallel block around it, if its layer holds one: for errors
        # The last: its output stays a slice, which the head gathers (partial.py).
        self.slices_after = slices_after
        self.path = path  # in the model: what errors and the Plan call it
        # A Colwise outside any Region: the head counts its enclosing modules hold, whole (split_watch.py).
        self.head_counts = head_counts or {}
        # Its own head counts (a Linear subclass viewing its output per head by one): whole, unless a Region
        # divides them while it runs.
        self.own_counts = {a: v for a, v in vars(module).items() if type(v) is int and is_head_count(a)}
        self.hidden = _first_parameter(module)  # read once: inspect.signature costs ~10 us a call
        # The counts each rank divides by the axis size while the Region runs (owner, attribute, whole).
        self.locals: list[tuple[Any, str, int]] = []
        # The whole widths its local= names (_divided lists them first): a plain Colwise output cut at one
        # of them (divided) is cut into as many parts on a rank as on the whole (split_watch.py).
        self.local_widths: list[int] = []
        if install is not None and isinstance(install.style, Region):
            self.locals = _divided(module, install.style)
            self.local_widths = [whole for _, _, whole in self.locals[: len(install.style.local)]]
        # The counts set while the Region runs, per axis size: made once (an f-string per count a call adds up).
        self.divided_by: dict[int, list[int]] = {}
        # Random ops on per-rank values (a sequence-parallel block's slices, a Region's heads) draw a
        # stream of their own on each rank; elsewhere (the replicated residual stream) every rank the same.
        self.own_stream = block is not None or (install is not None and isinstance(install.style, Region))
        # The input shapes this block was followed for (positions.py): once each, the first step's
        # or the Plan's, before any update.
        self.followed: set[tuple[Any, ...]] = set()
        # A Region's paths from its input to its output were read (region_paths.py): once, on the
        # first forward that recorded a graph.
        self.paths_checked = False
        self.cuts_watched = False  # and how it cuts its Colwise outputs: on its first forward (split_watch.py)
        # A Region's first real call on each rank, run again whole and split on copies (region_probe.py).
        self.probe = RegionProbe(module) if install is not None and isinstance(install.style, Region) else None
        # The whole head counts a Region names (a config's too): where one equals the axis size a rank holds one
        # head, and a dim of size 1 before a Colwise output's features can be that head (split_watch.py).
        self.whole_heads: tuple[int, ...] = ()
        if install is not None and isinstance(install.style, Region):
            self.whole_heads = tuple(_whole_counts(module, install.style.heads))
        # Its arguments of one slice per head (Region(arguments=...)), cut to the rank's heads at each call.
        self.head_arguments = HeadArguments(
            module, path, install.style, lambda attr: _whole_count(module, attr)
        ) if install is not None and isinstance(install.style, Region) and install.style.arguments else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m, install = self.module, self.install
        if getattr(flow, "probing", False):  # reached from a Region probe's copy (region_probe.py)
            raise ReachedSplit(self.path)
        called = getattr(flow, "called", None)
        if called is not None:
            called.add(self.path)
        if self.block is not None and self.block[0]:  # the first sequence-parallel block: split the sequence
            args, kwargs = _map_hidden(m, self.hidden, args, kwargs, self._split_sequence)
        follow = self._follow(args, kwargs)
        with (
            rank_stream(self.axis, args, kwargs, sticky=self.block is not None) if self.own_stream
            else contextlib.nullcontext(),
            contextlib.nullcontext() if follow is None
            else positions.following(self.path, m, follow[1], in_layer.size(self.axis)),
            contextlib.nullcontext() if self.block is None else one_ops_in(self.path),
        ):
            if install is None:
                out = type(m).forward(m, *args, **kwargs)
            else:
                with contextlib.nullcontext() if isinstance(install.style, Region) else own_use(
                    m, _overridden(m, install.kind), install.style.fused if isinstance(install.style, Colwise) else 1
                ):
                    out = self._styled(install, args, kwargs)
        if follow is not None:
            self.followed.add(follow[0])
        if self.block is not None and self.block[1]:  # the last one: the whole sequence again
            out = _map_first(out, self._end_sequence)
        return out

    def _end_sequence(self, h: Tensor) -> Tensor:
        """The last block's output: left a slice for the head to gather, or gathered here."""
        if self.slices_after:
            return partial.hold_slice(h)
        return gather_invariant(h, self.axis, 1, self.path)

    def _split_sequence(self, h: Tensor) -> Tensor:
        """The first block's input cut to this rank's slice: the embedding's partial sums reduce-scattered,
        a whole value sliced (its gradient all-gathered either way)."""
        if partial.holds_values(h):
            return leave(h, self.axis, 1, self.path, self.reduce)
        return scatter(h, self.axis, 1, self.path)

    def _follow(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], Tensor] | None:
        """A sequence-parallel block's hidden states, to follow through this call (see positions.py)
        and the key it is done for; None when it is no block, or was followed for this input."""
        if self.block is None:
            return None
        hidden = args[0] if args else kwargs.get(self.hidden or "")
        if not isinstance(hidden, Tensor):
            return None
        key = (tuple(hidden.shape), hidden.dtype, self.module.training)
        return None if key in self.followed else (key, hidden)

    def _local_counts(self, n: int, unmarked: int, label: str) -> list[int]:
        """This rank's value of each count the Region divides over ``n`` ranks. A head count is marked as the
        rank's (head_numbers.py; judged by the first call's watch only, and set on every call, so that the
        attribute is the same on each: forward_state.py compares them); a ``local=`` width is not."""
        return [
            HeadCount(value // n, f"{label}.{attr} ({value // n}: divided by the Region)")
            if k >= unmarked and n > 1 else value // n
            for k, (_, attr, value) in enumerate(self.locals)
        ]

    def _styled(self, install: Install, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        m, style, axis, label = self.module, install.style, self.axis, install.path
        weight, bias = _tensor(m, "weight"), _tensor(m, "bias")
        if isinstance(style, Region):
            n = in_layer.size(axis)
            locals_ = self.divided_by.get(n)
            if locals_ is None:
                locals_ = self.divided_by[n] = self._local_counts(n, len(style.local), label)
            for (owner, attr, _), local in zip(self.locals, locals_, strict=True):
                setattr(owner, attr, local)
            # Its per-head arguments that entered with their gradient summed: (name, before, after entering) each.
            heads_entered: list[tuple[str, Tensor, Tensor]] = []
            _refuse_cross_attention(label, m, kwargs)
            if self.head_arguments is not None:
                args, kwargs = self._rank_heads(args, kwargs, label, heads_entered)
            read = self.paths_checked and self.cuts_watched and getattr(flow, "sides", None) is None
            if read and getattr(flow, "splits", None) is None:
                args, kwargs = _map_hidden(
                    m, self.hidden, args, kwargs, lambda h: enter(h, axis, install.seq_dim, label, self.reduce)
                )
                return self._run_region(style, label, args, kwargs)
            return self._read_region(install, args, kwargs, heads_entered)
        (x,) = args
        if isinstance(style, Colwise):
            gather: SequenceGather | None = None
            if install.enters and install.kind != EMBEDDING:
                # The last block's output, still a slice: gathered here, its gradient reduce-scattered.
                seq_dim = 1 if partial.holds_slice(x) else install.seq_dim
                gather = self._sequence_gather(x, seq_dim)
                x = _entered(x, axis, seq_dim, label, self.reduce)
            elif not install.enters and not getattr(flow, "regions", 0):
                raise ValueError(
                    f"tensor_parallel: Colwise() on {label!r} sits inside Region {install.region!r}, which this layer "
                    "never entered (no layer calls that module: each of its children is a layer of its own), so its "
                    "input's gradient would never be summed over the axis; put the Region on a module a layer calls "
                    f"(make {install.region!r} one unit of functionalize), or drop it and the Colwise enters the "
                    "region itself"
                )
            y = _conv1d(x, _require(weight), bias) if install.kind == CONV1D else self._colwise_forward(x, label)
            view: HeadView | None = None
            blocks: tuple[HeadView, ...] | None = None
            if _overridden(m, install.kind):  # (a Linear's or an Embedding's subclass)
                check_product(y, label, m, rowwise=False)
                view = head_view_of(y)  # viewed per head by its forward: the rank's heads along its heads_dim
                blocks = None if view is not None else block_views_of(y)  # or its blocks', returned apart
            # Its features follow the input's leading dims (the ids', an Embedding's): the last dim, or the heads
            # of a per-head view its forward made, which keeps those dims (weight_reads.py checks it, watched).
            features_at = x.dim() - (0 if install.kind == EMBEDDING else 1)
            gathered = gathers(style, install.kind == EMBEDDING)
            if gathered and view is not None and view.heads_dim != features_at:
                raise ValueError(
                    f"tensor_parallel: Colwise(output='replicated') on {label!r}, a {type(m).__name__} whose forward "
                    f"views its output per head and moves its heads to dim {view.heads_dim} of {y.dim()}: the output "
                    f"is gathered along its heads where they follow the input's leading dims (dim {features_at}), "
                    "on every call. Return the view with its heads there (move them in the module around it), or "
                    "leave the output split (output='sharded', with a Rowwise after it)"
                )
            flow.split_output, flow.split_by = not gathered, label
            flow.colwise_in_region = True  # (a Rowwise in the same Region then takes a split input)
            flow.split_width = None if gathered or not isinstance(y, Tensor) or not y.dim() else y.shape[-1]
            if install.enters and not gathered:  # per-rank values follow, up to their Rowwise (or the layer's end)
                start_rank_stream(axis, x.device)
            out = gather_invariant(y, axis, features_at, label) if gathered else y
            _path_ends(label, out)
            watch = getattr(flow, "watch", None)
            if watch is not None and not gathered:
                counts = {**self.head_counts, **{  # its own, where no Region divided them: whole
                    attr: (label, whole) for attr, whole in self.own_counts.items() if getattr(m, attr, None) == whole
                }} if view is not None or blocks else self.head_counts
                if blocks:  # q, k and v apart: each the rank's heads of its block, followed as a plain Colwise's
                    for part, part_view in zip(out, blocks, strict=True):
                        watch.watch(part, label, 1, counts, in_layer.size(axis), gather, part_view)
                else:
                    watch.watch(out, label, style.fused, counts, in_layer.size(axis), gather, view)
            own_loss = getattr(flow, "own_loss", None)
            if own_loss is not None and label in own_loss.heads and isinstance(out, Tensor):
                own_loss.watch(out)
            return out
        assert isinstance(style, Rowwise)
        flow.split_output = False
        if install.kind == EMBEDDING:
            looked_up = _vocab_lookup(m, x, axis, label)
            if install.to_sequence and partial.hold_values(looked_up):
                return looked_up  # summed where the first block reduce-scatters it (partial.py)
            summed = leave(looked_up, axis, None, label, self.reduce)
            _path_ends(label, summed)
            return summed
        assert weight is not None
        width = weight.shape[1] if install.kind == LINEAR else weight.shape[0]
        if x.shape[-1] != width:
            raise ValueError(rowwise_width_message(
                label, width, width * in_layer.size(axis), x.shape[-1], bool(getattr(flow, "regions", 0)),
                getattr(flow, "colwise_in_region", True),
            ))
        if install.kind == LINEAR and _overridden(m, LINEAR):
            follow_input(x)
            y = _without_bias(m, x)  # the class's own forward (FalconLinear's), its bias added after the sum
            check_product(y, label, m, rowwise=True)
            if bias is not None and reads_watched() and not in_layer.predicting_now():
                _check_bias_added(m, x, bias, label)
        else:
            y = F.linear(x, weight) if install.kind == LINEAR else _conv1d(x, weight, None)
        y = leave(y, axis, install.seq_dim, label, self.reduce)
        _path_ends(label, y)
        back_to_shared()  # the summed output is every rank's: so are the random ops on it
        return y if bias is None else y + bias

    def _colwise_forward(self, x: Tensor, label: str) -> Any:
        """A Colwise module's own forward on this rank's slice of its output features; where a subclass's
        (one overriding torch's) fails in torch on its shapes, said so: it sized something by the whole."""
        m = self.module
        try:
            return type(m).forward(m, x)
        except RuntimeError as err:
            if not _overridden(m, self.install.kind if self.install else None) or is_ours(err) or isinstance(
                err, data_dependent_errors()
            ):
                raise
            raise ValueError(colwise_subclass_failed(
                label, m, err, in_layer.size(self.axis), {a: getattr(m, a) for a in self.own_counts}
            )) from err

    def _rank_heads(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], label: str, entered: list[tuple[str, Tensor, Tensor]]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call with the Region's per-head arguments cut to this rank's heads (head_arguments.py); each that
        enters (its gradient summed) is listed in ``entered``: its name, the argument before and after."""
        assert self.head_arguments is not None
        hidden = args[0] if args else kwargs.get(self.hidden or "")
        batch = hidden.shape[0] if isinstance(hidden, Tensor) and hidden.dim() else None
        n, axis = in_layer.size(self.axis), self.axis

        def enter_argument(t: Tensor, name: str) -> Tensor:
            entered.append((name, t, enter(t, axis, None, label, self.reduce)))
            return entered[-1][2]

        with quiet(), positions.unfollowed():  # our own ops on a value the module takes whole: not the model's
            return self.head_arguments.cut(args, kwargs, n, in_layer.index(axis) if n > 1 else 0, batch, enter_argument)

    def _sequence_gather(self, x: Tensor, seq_dim: int | None) -> SequenceGather | None:
        """A Colwise outside any Region inside a sequence-parallel block gathers the block's slice itself
        (sequence_gather.py): what its layer's first call checks, and a failure of torch's is said by."""
        install = self.install
        assert install is not None
        n = in_layer.size(self.axis)
        if install.seq_dim is None or seq_dim is None or x.dim() <= seq_dim or n == 1:
            return None  # outside the blocks (a head gathering the last block's slice: partial.py), or whole
        gather = SequenceGather(install.path, self.in_block, seq_dim, x.shape[seq_dim], x.shape[seq_dim] * n, n)
        flow.gathered = gather
        return gather

    def _run_region(
        self, style: Region, label: str, args: tuple[Any, ...], kwargs: dict[str, Any], probe: bool = True
    ) -> Any:
        """The Region's module on its entered input, a failure of torch's explained (head counts)."""
        m = self.module
        flow.regions = getattr(flow, "regions", 0) + 1
        outer_colwise, flow.colwise_in_region = getattr(flow, "colwise_in_region", False), False
        if self.probe is not None and not self.probe.done:
            self.probe.keep_state(m)  # what its copies start from (a table this call caches was the rank's)
        try:
            out = type(m).forward(m, *args, **kwargs)
        except (RuntimeError, ValueError) as err:
            # A fake tensor's data-dependent op (a mixture of experts' routing) is no failure of the module:
            # the prediction runs it again on real stand-ins (predict.py).
            if is_ours(err) or isinstance(err, data_dependent_errors()):
                raise
            split = frozenset(name for name, _ in self.per_head)
            watch = getattr(flow, "watch", None)  # which Colwise outputs the failing op took, if watched
            fed = watch.failed_on if watch is not None else ()
            call = (args, kwargs, self.hidden)
            raise ValueError(region_failed(m, label, style, err, in_layer.size(self.axis), split, fed, call)) from err
        finally:
            flow.regions -= 1
            flow.colwise_in_region = outer_colwise
        if probe:
            self._probe(label, args, kwargs)
        return out

    def _probe(self, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Judge a Region's first real call on this rank by its values (region_probe.py), after the watches that
        name the line have judged it (their refusals say more)."""
        if self.probe is not None and not self.probe.done:
            self.probe.run(self.module, label, self.axis, args, kwargs, self.head_arguments)

    def _read_region(
        self, install: Install, args: tuple[Any, ...], kwargs: dict[str, Any],
        heads_entered: list[tuple[str, Tensor, Tensor]] | None = None,
    ) -> Any:
        """A Region's call that reads it as well: its paths (region_paths.py), until a call records a
        graph, how it cuts its Colwise outputs (split_watch.py), on its first call, and on which side
        of its split layers it uses its replicated parameters, while its layer asks (layer_rewrite.VaryFn); or one
        inside such a Region, whose split layers end that one's paths too."""
        style, label = install.style, install.path
        assert isinstance(style, Region)
        before: list[Tensor] = []
        entered: list[Tensor] = []

        def enter_region(h: Tensor) -> Tensor:
            before.append(h)
            entered.append(enter(h, self.axis, install.seq_dim, label, self.reduce))
            return entered[-1]

        args, kwargs = _map_hidden(self.module, self.hidden, args, kwargs, enter_region)
        outer_splits = getattr(flow, "splits", None)
        sides: Sides | None = getattr(flow, "sides", None)
        flow.splits = None if self.paths_checked and outer_splits is None and sides is None else []
        outer_watch = getattr(flow, "watch", None)
        flow.watch = outer_watch if self.cuts_watched else (outer_watch or SplitWatch())
        if not self.cuts_watched:
            n = in_layer.size(self.axis)
            flow.watch.widths.update(whole // n for whole in self.local_widths)
            flow.watch.one_head = flow.watch.one_head or n in self.whole_heads
            for name, path in self.per_head:  # each rank's heads' values, its heads along dim 0
                flow.watch.watch_per_head(functools.reduce(getattr, name.split("."), self.module), path, n)
        first = not self.cuts_watched
        self.cuts_watched = True
        try:
            flow.in_region = getattr(flow, "in_region", 0) + 1  # (its probe judges the values: head_host_calls.py)
            try:
                with flow.watch if flow.watch is not outer_watch else contextlib.nullcontext():
                    out = self._run_region(style, label, args, kwargs, probe=False)
            finally:
                flow.in_region -= 1
            if flow.watch is not outer_watch:
                flow.watch.finish()
        except BaseException:
            # Not watched to its end: a run on fake tensors that a data-dependent op stopped (a mixture of
            # experts' loop) runs again on real stand-ins (predict.py), and that run is watched instead.
            self.cuts_watched = self.cuts_watched and not first
            raise
        finally:
            splits, flow.splits = flow.splits, outer_splits
            flow.watch = outer_watch
        if splits is not None and outer_splits is not None:
            outer_splits.extend(splits)
        if splits is not None and not self.paths_checked:
            self._check_paths(out, entered, before, splits)
        # The outermost Region only (an inner one's split layers end the outer one's paths too). Under
        # sequence parallel every value in the block is a slice of the sequence: all stay summed.
        arguments_in = [after for _, _, after in heads_entered or ()]
        if sides is not None and splits is not None and outer_splits is None and install.seq_dim is None:
            with quiet(), positions.unfollowed():  # reading grad_fn is a tensor op to the followers
                whole, partial_ = parameter_sides(
                    out, [node for _, node in splits], [*before, *entered, *arguments_in], sides.names
                )
            sides.add(label, whole, partial_)
        # What the parameters of the layer get through a per-head argument was summed as it entered: whole, in a
        # sequence-parallel block too, where the layer then refuses one that acts on the slice as well (Sides.built).
        if sides is not None and splits is not None and outer_splits is None and heads_entered:
            with quiet(), positions.unfollowed():
                for argument, before_, after in heads_entered:
                    built = summed_on_entry([before_], sides.names)
                    sides.add(label, built, set())
                    if install.seq_dim is not None:
                        sides.built(built, argument, label, after)
        self._probe(label, args, kwargs)
        return out

    def _check_paths(
        self, out: Any, entered: list[Tensor], before: list[Tensor], splits: list[tuple[str, Any]]
    ) -> None:
        """Refuse a Region whose input reaches its output by a path no split layer ends (region_paths.py)."""
        with quiet(), positions.unfollowed():  # reading grad_fn is a tensor op to the followers
            found = bypasses_split(out, entered, [node for _, node in splits], before)
        if found is None:  # no graph recorded (no_grad, a frozen input): read on a later forward
            return
        self.paths_checked = True
        if found:
            assert self.install is not None
            raise ValueError(bypass_message(
                self.install.path, type(self.module).__name__, in_layer.size(self.axis), [n for n, _ in splits]
            ))


def _path_ends(label: str, out: Any) -> None:
    """Inside a Region reading its paths, a split layer's output (a Colwise's, a Rowwise's sum; each of a fused
    subclass's q, k and v returned apart) ends a path: its node is taken now, before an in-place op on the
    output moves its grad_fn downstream."""
    splits = getattr(flow, "splits", None)
    if splits is None:
        return
    for t in out if isinstance(out, (tuple, list)) else (out,):
        with quiet(), positions.unfollowed():  # reading grad_fn is a tensor op to the followers
            node = t.grad_fn if isinstance(t, Tensor) else None
        if node is not None:
            splits.append((label, node))




def _entered(x: Tensor, axis: str, seq_dim: int | None, label: str, reduce: torch.dtype | None) -> Tensor:
    """``enter(x, ...)`` once per input that a layer's Colwise modules share outside a Region (q, k and v
    of one hidden state, as torch's plans write them): one all-gather of the sequence in forward
    (sequence parallel) and one sum of the three gradients in backward, as a Region makes, where each
    module entering on its own moved them three times. Kept for the layer's call (layer_rewrite.VaryFn), and only
    while ``x`` is unchanged in place."""
    memo: dict[tuple[Any, ...], tuple[Tensor, int, Tensor]] | None = getattr(flow, "entered", None)
    key = (id(x), seq_dim, reduce)
    found = None if memo is None else memo.get(key)
    if found is not None and found[0] is x and found[1] == x._version:
        return found[2]
    out = enter(x, axis, seq_dim, label, reduce)
    if memo is not None:
        memo[key] = (x, x._version, out)
    return out


def _divided(module: nn.Module, style: Region) -> list[tuple[Any, str, int]]:
    """The counts a rank divides while the Region runs: its ``local`` ones, and the ``heads`` held by the
    module or a submodule. A forward that reshapes by its head count (``q.view(b, t, self.n_heads, -1)``)
    then makes this rank's heads of the whole width; left whole, it made twice as many heads of half
    the width at tp 2, a model of another attention, without an error. A head count in a config
    (Hugging Face's ``config.num_attention_heads``) is checked only: every layer shares that object,
    and the attention reads its per-layer copies."""
    found: list[tuple[Any, str, int]] = []
    for dotted in (*style.local, *(h for h in style.heads if h not in style.local)):
        *path, attr = dotted.split(".")
        owner: Any = module
        for part in path:
            owner = getattr(owner, part)
            if dotted not in style.local and not isinstance(owner, nn.Module):
                break
        else:
            if dotted not in style.local and isinstance(getattr(type(owner), attr, None), property):
                continue  # computed by the module (from what it holds): checked only, as a config's
            found.append((owner, attr, getattr(owner, attr)))
    return found


def _whole_counts(module: nn.Module, names: tuple[str, ...]) -> list[int]:
    """The head counts ``names`` read (read before any call divides them); a name that reads no int is skipped
    (the Region's own checks name it)."""
    found = []
    for dotted in names:
        try:
            found.append(_whole_count(module, dotted))
        except (AttributeError, TypeError, ValueError):
            continue
    return found


def _whole_count(module: nn.Module, dotted: str) -> int:
    """A head count the Region names, read before any call divides it (the layer's copy is whole)."""
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return int(value)


def is_ours(err: BaseException) -> bool:
    """Whether shardwise raised ``err`` (it names its own cause): only torch's get explained."""
    return type(err).__module__.startswith("shardwise") or str(err).startswith("tensor_parallel:")


def _overridden(m: nn.Module, kind: str | None) -> bool:
    """Whether a split module's class overrides torch's forward (a Linear or Embedding subclass's own), which
    weight_reads.py follows; Hugging Face's Conv1D is computed by _conv1d, its forward not run."""
    base: Any = {LINEAR: nn.Linear.forward, EMBEDDING: nn.Embedding.forward}.get(kind or "")
    return base is not None and type(m).forward is not base


def _without_bias(m: nn.Module, x: Tensor) -> Tensor:
    """A Rowwise Linear subclass's own forward on this rank's slice, its (replicated) bias left out: it is
    added once, after the partial outputs are summed."""
    bias = m._parameters.get("bias")
    if bias is None:
        return type(m).forward(m, x)
    m._parameters["bias"] = None
    try:
        return type(m).forward(m, x)
    except (TypeError, AttributeError) as err:  # Python's, on a bias the forward adds unconditionally
        raise ValueError(
            f"tensor_parallel: Rowwise() on a {type(m).__name__}, whose forward overrides nn.Linear's, failed when run "
            f"without its bias ({type(err).__name__}: {err}): each rank computes its partial output without the "
            "bias (replicated), and the bias is added once after the sum, so the forward must work with bias None "
            "(nn.Linear's and Hugging Face's FalconLinear's do); give it a plain nn.Linear, or leave it out of the "
            "plan (replicated, with its Colwise partner)"
        ) from err
    finally:
        m._parameters["bias"] = bias


def _check_bias_added(m: nn.Module, x: Tensor, bias: Tensor, label: str) -> None:
    """A Rowwise Linear subclass's bias is added once after the sum, as it is: its forward must add it so.
    On zeros its product is zeros, so its forward with the bias returns the bias itself, exactly, where it
    adds it unchanged (FalconLinear's ``input @ self.weight.T + self.bias``); EqualLinear's ``self.bias *
    lr_mul`` does not. Checked on the layer's first call, on real values."""
    # Off the graph, out of sight of the layer's watches (torch's function modes) and leaving the random
    # streams where they were (a dropout inside the forward): a question about the class, not the layer's.
    gens = default_generators(x.device)
    states = [g.get_state() for g in gens]
    try:
        with torch.no_grad(), torch._C.DisableTorchFunction():
            zeros = type(m).forward(m, torch.zeros_like(x))
    finally:
        for g, state in zip(gens, states, strict=True):
            g.set_state(state)
    if isinstance(zeros, Tensor) and zeros.shape[-1:] == bias.shape and torch.equal(zeros, bias.expand_as(zeros)):
        return
    raise ValueError(
        f"tensor_parallel: Rowwise() on {label!r}, a {type(m).__name__} whose forward overrides nn.Linear's: "
        "each rank runs it without its bias (replicated), which is added once after the partial outputs are "
        "summed, but its forward does not add its bias as it is (on zeros it returns something else than "
        "self.bias: a scaled bias, as StyleGAN's EqualLinear's self.bias * lr_mul), so that would be another "
        "model. Give it a plain nn.Linear (its bias scaled in the parameter itself), construct it with "
        "bias=False, or leave it out of the plan (replicated, with its Colwise partner)"
    )


def _tensor(m: nn.Module, name: str) -> Tensor | None:
    t = getattr(m, name, None)
    return t if isinstance(t, Tensor) else None


def _require(t: Tensor | None) -> Tensor:
    assert t is not None, "a styled Linear / Conv1D / Embedding has a weight"
    return t


def _conv1d(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Hugging Face's Conv1D (``x @ weight + bias``, weight ``(in, out)``) on a weight slice."""
    flat = x.reshape(-1, x.size(-1))
    y = torch.mm(flat, weight) if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


def _vocab_lookup(m: nn.Module, ids: Tensor, axis: str, label: str) -> Tensor:
    """This rank's rows of a vocabulary-split embedding: ids outside them look up zeros."""
    weight = _tensor(m, "weight")
    assert weight is not None
    rows = weight.shape[0]
    if not in_layer.predicting_now() and ids.numel() and bool(((ids < 0) | (ids >= rows * in_layer.size(axis))).any()):
        raise IndexError(
            f"tensor_parallel: {label!r} looks up ids outside its vocabulary of {rows * in_layer.size(axis)} "
            f"(from {int(ids.min())} to {int(ids.max())}); index out of range, as the whole Embedding would say"
        )
    start = in_layer.index(axis) * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    padding = getattr(m, "padding_idx", None)
    local_padding = padding - start if isinstance(padding, int) and start <= padding < start + rows else None
    y = F.embedding(local, weight, local_padding).masked_fill(outside.unsqueeze(-1), 0.0)
    if type(m).forward is nn.Embedding.forward:
        return y
    # A subclass's forward is not run here (it would look up the global ids): Hugging Face's scaled word
    # embeddings (Gemma's, BART's: the lookup times embed_scale) are linear in the lookup, so each rank's
    # part is scaled as the whole would be; any other forward would be dropped without an error.
    scale = getattr(m, "embed_scale", None)
    if type(m).__name__.endswith("ScaledWordEmbedding") and isinstance(scale, (Tensor, float, int)):
        return y * (scale.to(weight.dtype) if isinstance(scale, Tensor) else scale)
    raise ValueError(
        f"tensor_parallel: Rowwise() on {label!r} splits the vocabulary of {type(m).__name__}, whose forward "
        "overrides nn.Embedding's; the split lookup would not run it (another model without an error). Give it "
        "Colwise() (split on the hidden dim: its own forward runs), or leave it out of the plan"
    )


def _first_parameter(m: nn.Module) -> str | None:
    params = list(inspect.signature(type(m).forward).parameters)
    return params[1] if len(params) > 1 else None


def _map_hidden(
    m: nn.Module, name: str | None, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Tensor], Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Apply ``fn`` to the module's first argument (the hidden states, ``name``), positional or by name."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if name is None or name not in kwargs:
        raise ValueError(f"tensor_parallel: {type(m).__name__} was called without its hidden states {name!r}")
    return args, {**kwargs, name: fn(kwargs[name])}


def _map_first(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(out, Tensor):
        return fn(out)
    if type(out) is tuple and out and isinstance(out[0], Tensor):
        return (fn(out[0]), *out[1:])
    raise ValueError(f"tensor_parallel: a sequence-parallel block returned {type(out).__name__}, not its hidden states")


# The keyword a cross-attention takes its keys' and values' source by (Hugging Face's: BART, T5, Whisper, Marian,
# Pegasus take key_value_states; GPT-2's and BERT's decoders encoder_hidden_states).
_CROSS_SOURCES = ("key_value_states", "encoder_hidden_states")


def _refuse_cross_attention(label: str, module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse a Region on a cross-attention: its keys and values come from the encoder's output, an argument the
    Region does not enter, so that output's gradient through its split projections would not be summed over the
    ranks (the replica check refuses it where the ranks' gradients then differ; with the encoder's blocks
    sequence parallel they do not, and BART trained 5e-5 off one device without an error)."""
    for name in _CROSS_SOURCES:
        source = kwargs.get(name)
        if isinstance(source, Tensor) and source.requires_grad:
            raise ValueError(
                f"tensor_parallel: the Region on {label!r} ({type(module).__name__}) is a cross-attention: its keys "
                f"and values come from {name!r} (the encoder's output), which the Region does not enter, so that "
                "output's gradient through the split projections would not be summed over the ranks (the encoder "
                "would train on a part of it). Leave the cross-attention out of the plan (no Region, no styles on "
                "its projections: it runs replicated); its self-attention and the MLPs can stay split."
            )
