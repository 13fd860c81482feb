"""The tensor-parallel forward of each styled module, installed on a copy of the layer's module.

The layer code does not change: each styled module of a layer's module gets a
``forward`` attribute (a :class:`TPForward`, which pickles and deep-copies with
its module) that calls the class's own forward around the communication of
``comm.py``; the layer fn is a copy of the original one calling that module.
The original model, and the single-device step's layers, are untouched.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...engine.model.chain import Layer
from ...engine.model.module_call import ThreadReplicas, kept_in_copies
from ...engine.model.reuse import reuse_key
from ...engine.run.rng import default_generators, mix
from ...engine.stack import in_layer
from ...engine.torch_api import data_dependent_errors
from . import partial, positions
from .comm import enter, gather_invariant, leave, scatter, vary
from .failures import region_failed, rowwise_width_message
from .following import quiet, set_current
from .match import CONV1D, EMBEDDING, LINEAR, Install, LayerPlan, is_head_count, param_split
from .own_loss import OwnLossCheck, OwnLossWatch, refuse_own_loss
from .owned_only import OwnedOnly
from .region_paths import Sides, bypass_message, bypasses_split, parameter_sides
from .sequence_gather import SequenceGather
from .split_watch import SplitWatch
from .styles import Colwise, Region, Rowwise, gathers
from .token_wise_experts import TokenWiseExperts, experts_in_blocks, one_ops_in
from .weight_reads import WeightReads, check_product, follow_input, head_view_of, own_use, reads_watched


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m, install = self.module, self.install
        called = getattr(_flow, "called", None)
        if called is not None:
            called.add(self.path)
        if self.block is not None and self.block[0]:  # the first sequence-parallel block: split the sequence
            args, kwargs = _map_hidden(m, self.hidden, args, kwargs, self._split_sequence)
        follow = self._follow(args, kwargs)
        with (
            _rank_stream(self.axis, args, kwargs, sticky=self.block is not None) if self.own_stream
            else contextlib.nullcontext(),
            contextlib.nullcontext() if follow is None
            else positions.following(self.path, m, follow[1], in_layer.size(self.axis)),
            contextlib.nullcontext() if self.block is None else one_ops_in(self.path),
        ):
            if install is None:
                out = type(m).forward(m, *args, **kwargs)
            else:
                with contextlib.nullcontext() if isinstance(install.style, Region) else own_use(
                    m, _overridden(m, install.kind)
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

    def _styled(self, install: Install, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        m, style, axis, label = self.module, install.style, self.axis, install.path
        weight, bias = _tensor(m, "weight"), _tensor(m, "bias")
        if isinstance(style, Region):
            n = in_layer.size(axis)
            for owner, attr, value in self.locals:
                setattr(owner, attr, value // n)
            read = self.paths_checked and self.cuts_watched and getattr(_flow, "sides", None) is None
            if read and getattr(_flow, "splits", None) is None:
                args, kwargs = _map_hidden(
                    m, self.hidden, args, kwargs, lambda h: enter(h, axis, install.seq_dim, label, self.reduce)
                )
                return self._run_region(style, label, args, kwargs)
            return self._read_region(install, args, kwargs)
        (x,) = args
        if isinstance(style, Colwise):
            gather: SequenceGather | None = None
            if install.enters and install.kind != EMBEDDING:
                # The last block's output, still a slice: gathered here, its gradient reduce-scattered.
                seq_dim = 1 if partial.holds_slice(x) else install.seq_dim
                gather = self._sequence_gather(x, seq_dim)
                x = _entered(x, axis, seq_dim, label, self.reduce)
            elif not install.enters and not getattr(_flow, "regions", 0):
                raise ValueError(
                    f"tensor_parallel: Colwise() on {label!r} sits inside Region {install.region!r}, which this layer "
                    "never entered (no layer calls that module: each of its children is a layer of its own), so its "
                    "input's gradient would never be summed over the axis; put the Region on a module a layer calls "
                    f"(make {install.region!r} one unit of functionalize), or drop it and the Colwise enters the "
                    "region itself"
                )
            y = _conv1d(x, _require(weight), bias) if install.kind == CONV1D else type(m).forward(m, x)
            factors: tuple[int, ...] | None = None
            if _overridden(m, install.kind):  # (a Linear's or an Embedding's subclass)
                check_product(y, label, m, rowwise=False)
                factors = head_view_of(y)  # viewed per head by its forward: the rank's heads along that dim
            # Its features follow the input's leading dims (the ids', an Embedding's): the last dim, or the heads
            # of a per-head view its forward made, which keeps those dims (weight_reads.py checks it, watched).
            features_at = x.dim() - (0 if install.kind == EMBEDDING else 1)
            gathered = gathers(style, install.kind == EMBEDDING)
            _flow.split_output, _flow.split_by = not gathered, label
            if install.enters and not gathered:  # per-rank values follow, up to their Rowwise (or the layer's end)
                _start_rank_stream(axis, y.device)
            out = gather_invariant(y, axis, features_at, label) if gathered else y
            _path_ends(label, out)
            watch = getattr(_flow, "watch", None)
            if watch is not None and not gathered:
                counts = {**self.head_counts, **{  # its own, where no Region divided them: whole
                    attr: (label, whole) for attr, whole in self.own_counts.items() if getattr(m, attr, None) == whole
                }} if factors else self.head_counts
                watch.watch(out, label, style.fused, counts, in_layer.size(axis), gather, factors)
            own_loss = getattr(_flow, "own_loss", None)
            if own_loss is not None and label in own_loss.heads:
                own_loss.watch(out)
            return out
        assert isinstance(style, Rowwise)
        _flow.split_output = False
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
                label, width, width * in_layer.size(axis), x.shape[-1], bool(getattr(_flow, "regions", 0))
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
        _back_to_shared()  # the summed output is every rank's: so are the random ops on it
        return y if bias is None else y + bias

    def _sequence_gather(self, x: Tensor, seq_dim: int | None) -> SequenceGather | None:
        """A Colwise outside any Region inside a sequence-parallel block gathers the block's slice itself
        (sequence_gather.py): what its layer's first call checks, and a failure of torch's is said by."""
        install = self.install
        assert install is not None
        n = in_layer.size(self.axis)
        if install.seq_dim is None or seq_dim is None or x.dim() <= seq_dim or n == 1:
            return None  # outside the blocks (a head gathering the last block's slice: partial.py), or whole
        gather = SequenceGather(install.path, self.in_block, seq_dim, x.shape[seq_dim], x.shape[seq_dim] * n, n)
        _flow.gathered = gather
        return gather

    def _run_region(self, style: Region, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The Region's module on its entered input, a failure of torch's explained (head counts)."""
        m = self.module
        _flow.regions = getattr(_flow, "regions", 0) + 1
        try:
            return type(m).forward(m, *args, **kwargs)
        except (RuntimeError, ValueError) as err:
            # A fake tensor's data-dependent op (a mixture of experts' routing) is no failure of the module:
            # the prediction runs it again on real stand-ins (predict.py).
            if _is_ours(err) or isinstance(err, data_dependent_errors()):
                raise
            split = frozenset(name for name, _ in self.per_head)
            watch = getattr(_flow, "watch", None)  # which Colwise outputs the failing op took, if watched
            fed = watch.failed_on if watch is not None else ()
            raise ValueError(region_failed(m, label, style, err, in_layer.size(self.axis), split, fed)) from err
        finally:
            _flow.regions -= 1

    def _read_region(self, install: Install, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A Region's call that reads it as well: its paths (region_paths.py), until a call records a
        graph, how it cuts its Colwise outputs (split_watch.py), on its first call, and on which side
        of its split layers it uses its replicated parameters, while its layer asks (VaryFn); or one
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
        outer_splits = getattr(_flow, "splits", None)
        sides: Sides | None = getattr(_flow, "sides", None)
        _flow.splits = None if self.paths_checked and outer_splits is None and sides is None else []
        outer_watch = getattr(_flow, "watch", None)
        _flow.watch = outer_watch if self.cuts_watched else (outer_watch or SplitWatch())
        if not self.cuts_watched:
            n = in_layer.size(self.axis)
            _flow.watch.widths.update(whole // n for whole in self.local_widths)
            for name, path in self.per_head:  # each rank's heads' values, its heads along dim 0
                _flow.watch.watch_per_head(functools.reduce(getattr, name.split("."), self.module), path, n)
        first = not self.cuts_watched
        self.cuts_watched = True
        try:
            with _flow.watch if _flow.watch is not outer_watch else contextlib.nullcontext():
                out = self._run_region(style, label, args, kwargs)
            if _flow.watch is not outer_watch:
                _flow.watch.finish()
        except BaseException:
            # Not watched to its end: a run on fake tensors that a data-dependent op stopped (a mixture of
            # experts' loop) runs again on real stand-ins (predict.py), and that run is watched instead.
            self.cuts_watched = self.cuts_watched and not first
            raise
        finally:
            splits, _flow.splits = _flow.splits, outer_splits
            _flow.watch = outer_watch
        if splits is not None and outer_splits is not None:
            outer_splits.extend(splits)
        if splits is not None and not self.paths_checked:
            self._check_paths(out, entered, before, splits)
        # The outermost Region only (an inner one's split layers end the outer one's paths too). Under
        # sequence parallel every value in the block is a slice of the sequence: all stay summed.
        if sides is not None and splits is not None and outer_splits is None and install.seq_dim is None:
            with quiet(), positions.unfollowed():  # reading grad_fn is a tensor op to the followers
                whole, partial_ = parameter_sides(out, [node for _, node in splits], [*before, *entered], sides.names)
            sides.add(label, whole, partial_)
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


def _path_ends(label: str, t: Tensor) -> None:
    """Inside a Region reading its paths, a split layer's output (a Colwise's, a Rowwise's sum) ends a
    path: its node is taken now, before an in-place op on the output moves its grad_fn downstream."""
    splits = getattr(_flow, "splits", None)
    if splits is None:
        return
    with quiet(), positions.unfollowed():  # reading grad_fn is a tensor op to the followers
        node = t.grad_fn
    if node is not None:
        splits.append((label, node))


# What this rank's layers have run, per thread (rank): .regions, how many Regions it is inside;
# .split_output, whether the last split module it ran left its output split (a sharded Colwise);
# .splits, while a Region reads its paths, the split layers' outputs it ran (label, grad_fn node);
# .sides, while a layer asks where its Regions use their replicated parameters (VaryFn), the answers.
_flow = threading.local()


def _entered(x: Tensor, axis: str, seq_dim: int | None, label: str, reduce: torch.dtype | None) -> Tensor:
    """``enter(x, ...)`` once per input that a layer's Colwise modules share outside a Region (q, k and v
    of one hidden state, as torch's plans write them): one all-gather of the sequence in forward
    (sequence parallel) and one sum of the three gradients in backward, as a Region makes, where each
    module entering on its own moved them three times. Kept for the layer's call (VaryFn), and only
    while ``x`` is unchanged in place."""
    memo: dict[tuple[Any, ...], tuple[Tensor, int, Tensor]] | None = getattr(_flow, "entered", None)
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


def _is_ours(err: BaseException) -> bool:
    """Whether shardwise raised ``err`` (it names its own cause): only torch's get explained."""
    return type(err).__module__.startswith("shardwise") or str(err).startswith("tensor_parallel:")


def split_by() -> str:
    """The module that left the output split (see output_is_split), for errors."""
    return str(getattr(_flow, "split_by", "a Colwise"))


def output_is_split() -> bool:
    """Whether the last split module this rank ran left its output split (the logits of a head)."""
    return bool(getattr(_flow, "split_output", False))


def forget_split_output() -> None:
    """The end of a forward (the loss): nothing is split any more."""
    _flow.split_output = False


# -- random streams: per rank on per-rank values, shared on replicated ones ------------------------
_streams = threading.local()  # .saved: the shared streams' state while this rank draws its own


@contextlib.contextmanager
def _rank_stream(axis: str, args: tuple[Any, ...], kwargs: dict[str, Any], sticky: bool) -> Iterator[None]:
    """Inside the block the default generators draw this rank's own stream (see _start_rank_stream),
    until a Rowwise sums the region's output (then the shared stream goes on, as on every rank:
    dropout on the replicated residual stream agrees); ``sticky`` (a sequence-parallel block, whose
    values are all per-rank) keeps the rank's stream to the end of the block."""
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    if not _start_rank_stream(axis, tensors[0].device if tensors else torch.device("cpu"), sticky):
        yield  # predicting, or already inside a stream of this rank's
        return
    try:
        yield
    finally:
        _back_to_shared(force=True)


def _start_rank_stream(axis: str, device: torch.device, sticky: bool = False) -> bool:
    """From here this rank draws its own stream, seeded from one draw of the shared one (so the shared
    streams stay alike on every rank, and a recomputation, from the state torch's checkpoint restores,
    replays both), until _back_to_shared. Alone (not sticky) it is what a Colwise that entered the
    region itself begins, with no Region around it to say where per-rank values begin: a Rowwise
    ends it, or the end of the layer (VaryFn). False when it did not begin one (predicting, or one
    already runs)."""
    if in_layer.predicting_now() or getattr(_streams, "saved", None) is not None:
        return False
    gens = default_generators(device)
    base = int(torch.empty((), dtype=torch.int64).random_().item())
    _streams.saved, _streams.gens, _streams.sticky = [g.get_state() for g in gens], gens, sticky
    for i, g in enumerate(gens):
        g.manual_seed(mix(base, in_layer.index(axis), i))
    return True


def _back_to_shared(force: bool = False) -> None:
    """The shared streams again, where this rank left them (after a Rowwise sums a region's output)."""
    saved = getattr(_streams, "saved", None)
    if saved is None or (_streams.sticky and not force):
        return
    for g, state in zip(_streams.gens, saved, strict=True):
        g.set_state(state)
    _streams.saved = None


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
        # Its split parameters (local name, path in the model, the module and style splitting it): read only
        # by their own module's forward, which the layer's first call on each rank checks (weight_reads.py).
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

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        tensors, sides = self._varied(tensors)
        outer_sides = getattr(_flow, "sides", None)
        _flow.sides = sides if sides is not None and sides.names else None
        outer = getattr(_flow, "called", None)
        called: set[str] = set()
        _flow.called = called
        follower = partial.Follower(self.axis, self.reduce, self.label) if self.follows else None
        outer_follower = set_current(follower)
        own_loss = _flow.own_loss = self._own_loss_watch()
        reads = self._reads_watch(tensors)
        watch = self._cut_watch()
        outer_watch = getattr(_flow, "watch", None)
        if watch is not None:
            _flow.watch = watch
            for local, path in self.per_head:
                watch.watch_per_head(tensors[local], path, in_layer.size(self.axis))
        outer_gathered, _flow.gathered = getattr(_flow, "gathered", None), None
        outer_entered, _flow.entered = getattr(_flow, "entered", None), {}
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
            short = None if watch is None or _is_ours(err) else watch.short_cut_message(err)
            if short is None:
                raise
            raise ValueError(short) from err
        except RuntimeError as err:  # torch's, on shapes that do not fit: explained if split
            gathered: SequenceGather | None = getattr(_flow, "gathered", None)
            if gathered is not None and not _is_ours(err) and gathered.explains(err):
                raise ValueError(gathered.message(f"failed ({type(err).__name__}: {err})")) from err
            if not output_is_split() or _is_ours(err) or isinstance(err, data_dependent_errors()):
                raise  # a fake run's data-dependent op: run again on real stand-ins (predict.py)
            raise ValueError(f"tensor_parallel: {_unsummed(err, self.axis)}") from err
        finally:
            if not finished:  # watched on the next call (a fake run stopped by a data-dependent op: predict.py)
                self._unmark(watch is not None, own_loss is not None, reads is not None)
            _flow.gathered = outer_gathered
            _flow.entered = outer_entered
            _flow.called = outer
            _flow.sides = outer_sides
            _flow.own_loss = None
            _flow.watch = outer_watch
            set_current(outer_follower)
            _back_to_shared(force=True)  # a per-rank stream a Colwise began ends with its layer
        if sides is not None and sides.names:  # decided before this forward's backward asks
            sides.mixed()
            self.whole = frozenset(sides.whole)
        missed = sorted(self.must_run - called)
        if missed:
            raise ValueError(
                f"tensor_parallel: this layer computed without calling {missed} as modules (torch.fx traced through "
                "them, or they did not run), so their split parameters were used without their communication; "
                "make each a leaf of the split (a unit of functionalize, or a torch.nn module), or leave it whole"
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
        return WeightReads(self.label, [(tensors[k], path, by) for k, path, by in self.split if k in tensors])

    def _unmark(self, cuts: bool, own_loss: bool, reads: bool = False) -> None:
        """This call's first-call checks were not done to their end: the next call does them."""
        for check, marked in (("cuts_checked", cuts), ("own_loss_checked", own_loss), ("reads_checked", reads)):
            checked = getattr(_flow, check, None)
            if marked and checked is not None:
                checked.discard(self)

    def _first_call(self, check: str) -> bool:
        """Whether this is the layer's first call on this rank for ``check`` (marked as done from now on)."""
        checked = getattr(_flow, check, None)
        if checked is None:
            checked = weakref.WeakSet()
            setattr(_flow, check, checked)
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
            with _rank_stream(self.axis, (x,), {}, sticky=True):
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
    """The layer's parameters its Colwise / Rowwise modules split: (local name, path in the model, the module
    and style), each under the name the layer feeds it by (a tied one's first, as match.py names it)."""
    first = {id(t): n for n, t in root.named_parameters()}
    found: dict[str, tuple[str, str, str]] = {}
    for install in plan.installs:
        if not isinstance(install.style, (Colwise, Rowwise)):
            continue
        module = root.get_submodule(install.subpath)
        for name, t in module.named_parameters(recurse=False):
            local = prefix + first.get(id(t), f"{install.subpath}.{name}".lstrip("."))
            if local in names and param_split(install.style, install.kind, name, module) is not None:
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
