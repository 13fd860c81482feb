"""A Region's first call on each rank, judged by its values: the split module against the whole one.

A Region's module runs on each rank with its local head count (the Region divides ``self.n_head``; ``q.size(1)``
is the rank's). A per-head value the forward computes from that count through plain Python (ALiBi's
``get_slopes(self.n_head)``: ``math.log2`` and a list over ``range(n)``; ``q / math.sqrt(self.n_head)``;
``torch.tensor(list(range(h)))``) is the rank's count's, not the whole's: every rank computes another model's
attention and the step trains it without an error. head_numbers.py marks the count and refuses the forms it can
follow (naming the line); a number that leaves Python's arithmetic for ``math.*``, ``range`` or ``float`` is out
of its sight. This probe judges what the numbers did instead of following them.

How: after the Region's first real call on a rank, two copies of its module run the call's (entered) input
again, in float64, off the graph and out of sight of the layer's watches. The SPLIT copy holds the rank's
parameters and local head counts, as the call did; the WHOLE copy holds whole head counts and whole parameters
built from the rank's own: each split tensor tiled tp times along its split dim (block by block for a
``Colwise(fused=N)``), so that every rank's slice of it is this rank's (``TensorSplit.local`` of the tiled tensor
gives the rank's tensor back). In the whole copy the features at this rank's place are then exactly what the
whole module computes for this rank's heads from their true weights (a head's features depend on its own
weights and the replicated ones only: what a Region's split assumes). The input of each Rowwise call is
compared: the split copy's against this rank's slice of the whole copy's (its last dim, as the Rowwise weight's
input features are cut), at 1e-9 of the slice's largest magnitude (float64 rounding of the same products in
another blocking; a per-head value from the wrong count is off by far more). A Rowwise's output feeds what
follows in both copies alike (the whole copy's, which the split copy cannot compute alone), so a later Rowwise
input is compared on the same values. In a sequence-parallel block
it hands on this rank's slice of the sequence, as the real one's reduce-scatter does (Bloom's attention adds
it to the residual's slice it takes as an argument: whole, the copies failed on the shapes).

Tiled weights hide an op across the heads (a mean, max or population variance over the heads dim is the same
over this rank's heads repeated as over them alone): a third copy, whole, holds this rank's weights at its own
place and the others' scaled by 2 (its Rowwise outputs the whole copy's, as in the split copy), and the rank's
slice of its Rowwise input must equal the split copy's too. Heads computed each from its own weights do not see
the scale; a rank that computes across heads does (generically on every rank: each scales the others' places).

Why tiled and not the whole weights: a rank holds only its slices (each rank's shard is cut from the whole
parameters at the step's start and trained alone), and gathering them would put a collective into the first
step that the Plan does not show. The tiled copy needs no collective, so no rank waits on another. It holds
this rank's weights at every place, so a module that computes each head from its own weights gives the same
features at each: every place's slice is compared, and every rank judges alike. A count misused alike on every
rank (``get_slopes(n)``, ``1 / math.sqrt(n)``) and a table numbered from 0 on each rank
(``torch.tensor(list(range(h)))``, which matches the whole at place 0 only) are refused on every rank, none left
waiting in a collective its peers never reach.

A Region's arguments of one slice per head (``Region(arguments={"alibi": HeadsAlong(...)})``: ALiBi's bias, cut to
the rank's heads at each call, head_arguments.py) are what the split copy takes, as the call did; the whole copies
take them tiled back to all heads, the rank's heads at every place, as they hold the rank's weights; and the
first-sample cut takes a folded one's first sample's rows, and leaves one with its heads on dim 0 whole.

The copies start from each submodule's attributes as they were before the judged call (a table that call
cached on the module, ``self.slopes = get_slopes(self.n_head)`` on the first call, was built from the rank's
count: read by the whole copy, it failed on the shapes and left the call unjudged); shallow, so a cache filled
in place (a dict) is still the call's (a gap). The copies run without the modules' own forward hooks (a
user's hook sees the step's calls only) and in eval mode, so dropout (modules, and
``F.dropout(..., training=self.training)``) draws nothing;
the random generators are put back after them. The counts a copy holds are set on objects that copy alone holds
(probe_counts.py: a count's owner every rank thread shares is never changed, even for the copies' run).

Not judged (a gap, the call is left as it ran), and said so: a :class:`RegionNotJudged` warning (not_judged.py),
once per module class and cause in the process (the threads backend's ranks share one), naming the Region, the cause,
what goes unchecked and what to do. The causes: a Region whose copies still draw random numbers in eval mode
(model code calling ``torch.rand`` itself: the two copies draw different shapes, so nothing compares), one with a
Colwise whose output is gathered or a vocabulary-split Embedding inside (the split copy cannot compute those
alone), one called with an object that may hold state (a key/value cache, which the copies would update) or with
tensor subclasses, one whose copies cannot run alone (another transform's rewrite that keeps the module itself and
reaches the rank's split modules: context parallel's attention under cp x tp, judged under tensor_parallel alone;
a collective, run under no_mesh() so that nothing is sent; an argument already laid out by the rank's heads; code
that refuses float64), a count held where the copies cannot be given their own, and copies that do not fit in
memory (``torch.OutOfMemoryError`` or ``MemoryError``: not retried on the whole input, the copies freed and, where
CUDA is initialised, its cache emptied before the step goes on). Not said, as nothing is left unchecked: tp size 1,
and the Plan's prediction on fake tensors (the step's first real call is judged). Also not judged, and not seen:
values mixed across heads of a PerHead parameter (the per-head watch judges those), and a forward that behaves
otherwise in training mode. Cost: three float64 runs
of the Region's module on its first call on each rank, on the batch's first sample (the call's tensors as long
as its first one's dim 0 cut to one row; the whole input where that run fails: an argument laid out otherwise than
by the batch, as a (batch * heads, ...) bias the Region does not cut); later calls pay one attribute check
(:attr:`RegionProbe.done`), and each split module's call one thread-local read (refusing to run inside a probe).
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from ...collectives.mesh_context import no_mesh
from ...engine.layout.state_layout import TensorSplit
from ...engine.run.rng import default_generators
from ...engine.stack import in_layer
from . import not_judged as gaps
from .comm import sequence_dim
from .following import quiet
from .head_arguments import HeadArguments
from .match import CONV1D, EMBEDDING, param_split
from .not_judged import NotJudged, say_not_judged
from .positions import unfollowed
from .probe_counts import set_counts
from .rank_flow import flow
from .styles import Colwise, Region, Rowwise, gathers

# A module's own forward hooks (torch.nn.Module's dicts): emptied in the copies.
_FORWARD_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
RTOL = 1e-9  # of the whole slice's largest magnitude, in float64 (see the module docstring)
_NO_MESH = "needs a mesh: call it inside `with mesh:`"  # what a collective raises under no_mesh()
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class RegionProbe:
    """What a Region's probe needs from the rewrite (its tensors' whole shapes), and whether it ran."""

    def __init__(self, module: nn.Module) -> None:
        # The layer's copy still shares the model's (whole) tensors here: their shapes are the whole's.
        self.whole_shapes = {
            name: tuple(t.shape)
            for name, t in (*module.named_parameters(remove_duplicate=False),
                            *module.named_buffers(remove_duplicate=False))
        }
        self.done = False  # this thread's (rank's) copy has judged its first real call
        # Each submodule's attributes before the call the probe judges: what the copies start from (a table the
        # call cached on the module, self._slopes = ..., was built from the rank's count).
        self.before: dict[int, dict[str, Any]] = {}

    def keep_state(self, module: nn.Module) -> None:
        """Remember the attributes of ``module`` and its submodules before a call the probe may judge (the
        first real one): the copies start from them, not from what the call left (shallow: a cache filled in
        place is still the call's)."""
        if not self.done:
            self.before = {id(m): dict(vars(m)) for m in module.modules()}

    def run(
        self, module: nn.Module, label: str, axis: str, args: tuple[Any, ...], kwargs: dict[str, Any],
        arguments: HeadArguments | None = None,
    ) -> None:
        """Judge the call ``module(*args, **kwargs)`` just made (the Region ``label`` on this rank, its input
        entered); refuse when it computed other values than the whole module for this rank's heads, and say so
        (:class:`RegionNotJudged`, once per module class and cause) where it cannot be judged. ``arguments``: the
        Region's arguments of one slice per head, cut to the rank's heads in ``args`` / ``kwargs`` (the whole
        copies take them tiled back: head_arguments.py)."""
        if in_layer.predicting_now():
            return  # fake tensors (the Plan): the step's first real call is judged
        leaves: list[Any] = optree.tree_leaves((args, kwargs), none_is_leaf=True)  # type: ignore[arg-type]
        tensors = [*(t for t in leaves if isinstance(t, Tensor)), *module.parameters(), *module.buffers()]
        if any(t.is_meta or isinstance(t, FakeTensor) for t in tensors):
            return  # not real values (yet): a later call is judged
        self.done = True
        n, index = in_layer.size(axis), in_layer.index(axis)
        if n == 1:
            return  # nothing is split: the call is the whole module's
        try:
            found = _judge(module, self.whole_shapes, self.before, n, index, args, kwargs, leaves, tensors, arguments)
        except NotJudged as gap:
            say_not_judged(label, type(module).__name__, gap.cause, gap.reason, gap.advice, type(module))
            return
        if found is not None:
            raise ValueError(_message(label, type(module).__name__, axis, n, index, *found))


def _judge(
    module: nn.Module, whole_shapes: dict[str, tuple[int, ...]], before: dict[int, dict[str, Any]], n: int,
    index: int, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], tensors: list[Tensor],
    arguments: HeadArguments | None = None,
) -> tuple[str, bool] | None:
    """What the copies found (see _compare), or NotJudged naming why they could not judge."""
    subclassed = sorted({type(t).__name__ for t in tensors if type(t) not in (Tensor, nn.Parameter)})
    if subclassed:
        raise gaps.subclassed(subclassed)
    stateful = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, (Tensor, *_PLAIN))})
    if stateful:
        raise gaps.stateful(stateful)  # a key/value cache: the copies would change it
    styled = _styled_modules(module)
    # On the batch's first sample where the copies run on it (a head's values do not depend on the batch's
    # size; the copies' time and memory are 1/batch of the call's), else on the whole input.
    cuts = [True, False] if _batch(args, kwargs) > 1 else [False]
    for k, one_sample in enumerate(cuts):
        try:
            return _compare(module, styled, whole_shapes, before, n, index, args, kwargs, one_sample, arguments)
        except NotJudged:
            raise
        except (torch.OutOfMemoryError, MemoryError) as err:
            failed = gaps.first_line(err)
            break  # (the whole input needs more): the copies' references go with the exception
        except ReachedSplit as err:
            raise gaps.reached_split(str(err)) from None
        except Exception as err:
            if k + 1 < len(cuts):
                continue  # an argument not cut with the batch (a (batch * heads, ...) bias): the whole input
            # Another transform's rewrite reaching a collective (run under no_mesh: none is sent), code that refuses
            # float64: what the copies cannot compute says nothing of the Region's values (the single-device module
            # runs).
            raise (gaps.reached_collective(err) if _NO_MESH in str(err) else gaps.failed(err)) from None
    gaps.give_back_memory()
    raise gaps.out_of_memory(failed, sum(t.nbytes for t in leaves if isinstance(t, Tensor)))


def _styled_modules(module: nn.Module) -> dict[str, Any]:
    """The tensor-parallel forwards installed in the Region's module, by submodule path; NotJudged when one cannot
    be computed by a rank alone (a gathered Colwise, a vocabulary-split Embedding)."""
    found = {}
    for sub, m in module.named_modules():
        forward = vars(m).get("forward")
        install = getattr(forward, "install", None)
        if install is None:
            continue
        style = install.style
        if isinstance(style, Region):
            continue  # this one (run plainly in the copies), or one nested in it
        if install.kind == EMBEDDING:
            # Rowwise splits the vocabulary; Colwise the features (T5's relative_attention_bias: its heads).
            split = "vocabulary" if isinstance(style, Rowwise) else "feature"
            raise gaps.gathered(install.path, f"a {split}-split Embedding")
        if isinstance(style, Colwise) and gathers(style, False):
            raise gaps.gathered(install.path, "a Colwise whose output is gathered")
        found[sub] = forward
    return found


def _batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The call's first tensor's dim 0 (the hidden states' batch), 0 where there is none."""
    leaves: list[Any] = optree.tree_leaves((args, kwargs), none_is_leaf=True)  # type: ignore[arg-type]
    first = next((t for t in leaves if isinstance(t, Tensor)), None)
    return 0 if first is None or first.dim() == 0 else first.shape[0]


def _one_sample(
    args: tuple[Any, ...], kwargs: dict[str, Any], arguments: HeadArguments | None = None
) -> tuple[Any, Any]:
    """The call's tensors as long as its batch along dim 0 cut to the first sample (inside the probe's hidden
    block: a sequence-parallel watch would take the cut for the model's); the Region's per-head arguments by
    their layout (a folded one's first sample's rows; one with its heads on dim 0 whole)."""
    batch = _batch(args, kwargs)
    own = set() if arguments is None else arguments.located(args, kwargs)
    cut: Any = optree.tree_map(
        lambda t: t[:1] if isinstance(t, Tensor) and id(t) not in own and t.dim() and t.shape[0] == batch else t,
        (args, kwargs), none_is_leaf=True,  # type: ignore[arg-type]
    )
    if arguments is None:
        return cut[0], cut[1]
    heads_cut = arguments.first_sample(tuple(cut[0]), dict(cut[1]), batch)
    return heads_cut[0], heads_cut[1]


def _compare(
    module: nn.Module, styled: dict[str, Any], whole_shapes: dict[str, tuple[int, ...]],
    before: dict[int, dict[str, Any]], n: int, index: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    one_sample: bool, arguments: HeadArguments | None = None,
) -> tuple[str, bool] | None:
    """Run the whole, split and mixed copies; what differed, in words, and whether the features depend on the
    other heads (an op across heads), or None."""
    leaves: list[Any] = optree.tree_leaves((args, kwargs), none_is_leaf=True)  # type: ignore[arg-type]
    device = next((t.device for t in leaves if isinstance(t, Tensor)), torch.device("cpu"))
    whole_calls: list[tuple[str, Tensor, Tensor]] = []
    split_calls: list[tuple[str, Tensor]] = []
    mixed_calls: list[tuple[str, Tensor]] = []
    with _hidden(device) as drew, no_mesh(), _probing():
        source = _one_sample(args, kwargs, arguments) if one_sample else (args, kwargs)
        inputs: Any = optree.tree_map(_upcast, source, none_is_leaf=True)  # type: ignore[arg-type]
        # The whole copies take the per-head arguments tiled back: the rank's heads at every place, as its weights.
        whole_inputs: Any = inputs if arguments is None else arguments.tiled(tuple(inputs[0]), dict(inputs[1]), n)
        # Whole, split, and whole with the heads at the other places scaled (this rank's at its own as they are):
        # an op across the heads (a mean, max or variance over the heads dim) gives the same on tiled weights,
        # not on these. One copy at a time: each is freed (no cycle left) before the next is made.
        for kind, calls in (("whole", whole_calls), ("split", split_calls), ("mixed", mixed_calls)):
            copied = _copy(module, styled, whole_shapes, before, n, kind, calls,
                           None if kind == "whole" else whole_calls, index)
            given = inputs if kind == "split" else whole_inputs
            try:
                copied(*given[0], **given[1])
            finally:
                for m in copied.modules():
                    vars(m).pop("forward", None)  # its _ProbeForward holds it: a cycle only the collector frees
    if drew:
        raise gaps.drew()  # random numbers drawn in eval mode: the copies' draws do not compare
    if len(split_calls) != len(whole_calls):
        return (f"its Rowwise modules were called {len(split_calls)} times on the rank and {len(whole_calls)} times "
                "in the whole module"), False
    for k, ((path, got), (_, want, _)) in enumerate(zip(split_calls, whole_calls, strict=True)):
        dim = want.dim() - 1
        if got.shape[:-1] != want.shape[:-1] or got.shape[-1] * n != want.shape[-1]:
            return (f"the input of Rowwise {path!r} (its call {k + 1}) has shape {list(got.shape)} on the rank and "
                    f"{list(want.shape)} in the whole module"), False
        # Every place's slice, this rank's first: the whole copy holds this rank's weights at every place, so a
        # module computing each head from its own weights gives the same features at each. Judging them all
        # makes every rank refuse alike (a table numbered from 0 on each rank matches the whole at place 0
        # only): no rank goes on to a collective its peers never reach.
        for place in (index, *(p for p in range(n) if p != index)):
            mine = TensorSplit("", dim, n).local(want, place)
            scale = float(mine.abs().nan_to_num(0.0, 0.0, 0.0).max()) if mine.numel() else 0.0
            if not torch.allclose(got, mine, rtol=0.0, atol=RTOL * scale, equal_nan=True):
                err = float((got - mine).abs().nan_to_num(float("inf")).max())
                heads = "this rank's heads" if place == index else f"the heads rank {place} holds (its weights tiled)"
                return (f"the input of Rowwise {path!r} (its call {k + 1}), the rank's heads' features, differs from "
                        f"the whole module's for {heads} by up to {err:.3g} (relative "
                        f"{err / max(scale, 1e-300):.3g}, allowed {RTOL:g} in float64)"), False
    if len(mixed_calls) != len(split_calls):
        return (f"its Rowwise modules were called {len(mixed_calls)} times in the whole module when only the OTHER "
                f"heads' weights change, {len(split_calls)} times on the rank"), True
    for k, ((path, got), (_, other)) in enumerate(zip(split_calls, mixed_calls, strict=True)):
        ours = TensorSplit("", other.dim() - 1, n).local(other, index) if other.shape == (
            *got.shape[:-1], got.shape[-1] * n) else None
        scale = float(got.abs().nan_to_num(0.0, 0.0, 0.0).max()) if got.numel() else 0.0
        if ours is None or not torch.allclose(got, ours, rtol=0.0, atol=RTOL * scale, equal_nan=True):
            err = float("inf") if ours is None else float((got - ours).abs().nan_to_num(float("inf")).max())
            return (f"the input of Rowwise {path!r} (its call {k + 1}), the rank's heads' features, changes by up "
                    f"to {err:.3g} (relative {err / max(scale, 1e-300):.3g}) when only the OTHER heads' weights "
                    "change (this rank's heads' weights tiled, the others' scaled by 2): the module computes "
                    "across heads (a mean, max or variance over the heads dim, a norm over all heads' features), "
                    "which each rank computes over its own heads alone"), True
    return None


def _copy(
    module: nn.Module, styled: dict[str, Any], whole_shapes: dict[str, tuple[int, ...]],
    before: dict[int, dict[str, Any]], n: int, kind: str, calls: list[Any],
    whole_calls: list[tuple[str, Tensor, Tensor]] | None = None, index: int = 0,
) -> nn.Module:
    """A copy of the Region's module (each submodule a shallow copy with dicts of its own: the layer's copy and
    its tensors untouched), in eval mode, its tensors float64 copies (tiled to the whole where split, for the
    whole copy; for the ``mixed`` one, with whole counts, the places but ``index`` scaled by 2), its divided head
    counts as ``kind`` says (on objects the copy alone holds: probe_counts.py), and its styled modules computing
    without communication (each Rowwise recording its input)."""
    twins: dict[int, nn.Module] = {}
    forwards = {id(f) for f in styled.values()}

    def twin(m: nn.Module, prefix: str) -> nn.Module:
        t = twins[id(m)] = copy.copy(m)
        kept = before.get(id(m))
        if kept is not None:  # its attributes as the judged call found them (not what that call cached)
            vars(t).clear()
            vars(t).update(kept)
        vars(t).pop("forward", None)  # a split's installed forward (this Region's, a nested one's, a guard)
        for hooks in _FORWARD_HOOKS:  # the user's hooks see the real calls only (not float64 runs at whole shapes)
            if hooks in vars(t):
                setattr(t, hooks, OrderedDict())
        t.training = False
        forward = vars(m).get("forward")
        install = getattr(forward, "install", None) if id(forward) in forwards else None

        def blocks(name: str) -> int:  # a fused Colwise's weight and bias: its blocks cut apart
            split = None if install is None else param_split(install.style, install.kind, name, m)
            return 1 if split is None else split[1]

        params: dict[str, Any] = {
            k: None if v is None else _tensor(v, whole_shapes.get(prefix + k), n, kind, blocks(k), index)
            for k, v in m._parameters.items()
        }
        t._parameters = params
        t._buffers = {k: None if v is None else _tensor(v, whole_shapes.get(prefix + k), n, kind, 1, index)
                      for k, v in m._buffers.items()}
        if install is not None:
            t.forward = _ProbeForward(t, install, kind, calls, whole_calls, n, index)
        return t

    for path, m in module.named_modules():  # (a submodule under two names: one twin, named by its first)
        twin(m, f"{path}." if path else "")
    for m in module.modules():
        twins[id(m)]._modules = {k: None if v is None else twins[id(v)] for k, v in m._modules.items()}
    set_counts(module, twins, n, kind)
    return twins[id(module)]


def _tensor(t: Tensor, whole: tuple[int, ...] | None, n: int, kind: str, blocks: int, index: int) -> Tensor:
    """A float64 copy of ``t`` (this rank's), for the whole copy tiled to the ``whole`` shape along the one dim
    the split cut (block by block for a fused projection); for the mixed copy, a float tensor's places but
    ``index`` scaled by 2 (exact in binary)."""
    local = _upcast(t)
    if kind == "split" or whole is None or tuple(t.shape) == whole:
        return local
    dims = [d for d, (a, b) in enumerate(zip(t.shape, whole, strict=True)) if a != b]
    if len(t.shape) != len(whole) or len(dims) != 1 or t.shape[dims[0]] * n != whole[dims[0]]:
        raise gaps.unrelated(f"a tensor of shape {list(t.shape)} is no 1/{n} of {list(whole)}")
    scales = [1.0 if kind == "whole" or p == index or not local.is_floating_point() else 2.0 for p in range(n)]
    return _tile(local, n, dims[0], blocks, scales)


def _tile(local: Tensor, n: int, d: int, blocks: int, scales: list[float]) -> Tensor:
    """The tensor whose rank ``p``'s slice (``TensorSplit(dim=d, parts=n, blocks=blocks).local``) is ``local``
    times ``scales[p]``."""
    return torch.cat([torch.cat([b * s for s in scales], d) for b in local.chunk(blocks, d)], d)


class _ProbeForward:
    """A styled module's forward in a probe copy: a Colwise computes its (whole or split) slice; a Rowwise
    records its input and returns its product (the whole copy's, in the split copy: not computable alone), in a
    sequence-parallel block the rank's slice of its sequence, as the real one's reduce-scatter hands on (what
    follows adds it to the rank's slice of the residual: Bloom's attention takes it as an argument)."""

    def __init__(self, m: nn.Module, install: Any, kind: str, calls: list[Any],
                 whole_calls: list[tuple[str, Tensor, Tensor]] | None, n: int, index: int) -> None:
        self.m, self.install, self.kind, self.calls, self.whole_calls = m, install, kind, calls, whole_calls
        self.n, self.index = n, index

    def __call__(self, x: Tensor) -> Tensor:
        m, install = self.m, self.install
        if isinstance(install.style, Rowwise) and self.whole_calls is not None:
            k = len(self.calls)
            self.calls.append((install.path, x))
            if k < len(self.whole_calls) and self.whole_calls[k][0] == install.path:
                return self.whole_calls[k][2]
            return self._handed_on(_product(m, install.kind, x))  # counted apart: the comparison says they differ
        y = _product(m, install.kind, x)
        if isinstance(install.style, Rowwise):
            y = self._handed_on(y)
            self.calls.append((install.path, x, y))
        return y

    def _handed_on(self, y: Tensor) -> Tensor:
        """A Rowwise's product as the real one hands it on: whole, or in a sequence-parallel block this rank's
        slice of the sequence (comm.leave's reduce-scatter, without the sum: the copies compute it whole)."""
        if self.install.seq_dim is None:
            return y
        return TensorSplit("", sequence_dim(y, self.install.seq_dim, self.install.path), self.n).local(y, self.index)


def _product(m: nn.Module, kind: str | None, x: Tensor) -> Tensor:
    weight, bias = m._parameters["weight"], m._parameters.get("bias")
    assert weight is not None, "a styled Linear / Conv1D has a weight"
    if kind == CONV1D:  # Hugging Face's Conv1D sizes its output by its whole nf: computed from the weight
        flat = x.reshape(-1, x.size(-1))
        y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
        return y.view(*x.shape[:-1], weight.shape[1])
    if type(m).forward is nn.Linear.forward:
        return F.linear(x, weight, bias)
    out: Tensor = type(m).forward(m, x)
    return out


def _upcast(t: Any) -> Any:
    if not isinstance(t, Tensor):
        return t
    t = t.detach()
    if t.is_floating_point():
        return t.to(torch.float64, copy=True)
    if t.is_complex():
        return t.to(torch.complex128, copy=True)
    return t.clone()


@contextlib.contextmanager
def _hidden(device: torch.device) -> Iterator[list[str]]:
    """Off the graph, out of sight of the layer's watches (torch function and dispatch modes: a selective
    recomputation's cache would count the copies' ops), the random streams put back after; yields a list that
    names the generators the copies drew from, filled on the way out (a state that moved: no per-op cost)."""
    gens = default_generators(device)
    states = [g.get_state() for g in gens]
    drew: list[str] = []
    try:
        with torch.no_grad(), quiet(), unfollowed(), torch._C.DisableTorchFunction(), _disable_current_modes():
            yield drew
    finally:
        for g, state in zip(gens, states, strict=True):
            if not torch.equal(g.get_state(), state):
                drew.append(str(g.device))
            g.set_state(state)


class ReachedSplit(Exception):
    """A probe copy called one of the rank's own split modules (through a reference another transform keeps):
    the copies cannot compute the Region alone."""


@contextlib.contextmanager
def _probing() -> Iterator[None]:
    """While the copies run, the rank's installed forwards refuse to run (modules.TPForward: ReachedSplit)."""
    flow.probing = True
    try:
        yield
    finally:
        flow.probing = False


def _message(label: str, cls: str, axis: str, n: int, index: int, found: str, across: bool) -> str:
    if across:
        return (
            f"tensor_parallel: Region {label!r} (a {cls}) computes its heads' values on rank {index} of axis "
            f"{axis!r} from the other heads' values too (its first call, run again in float64 on copies: {found}). "
            f"Each of the {n} ranks holds 1/{n} of the heads, so an op across the heads dim sees this rank's "
            "alone and the step would train another model. Keep each head's computation within the head, or "
            "leave this module's projections out of the plan (replicated)"
        )
    return (
        f"tensor_parallel: Region {label!r} (a {cls}) computes other values on rank {index} of axis {axis!r} than "
        f"the whole module computes for that rank's heads (its first call, run again in float64 on copies: "
        f"{found}). Each of the {n} ranks holds 1/{n} of the heads, and the Region divides the head counts it names "
        "while the module runs; the likely cause is a per-head value computed in forward from the rank's count "
        "through Python (math.log2 / math.sqrt / range / float / .tolist(): ALiBi's get_slopes(self.n_head), "
        "q / math.sqrt(self.n_head), torch.tensor(list(range(h)))), which gives each rank the values of a model "
        f"with {n} times fewer heads, or the first heads' values, and the step would train another model. Compute "
        "per-head tables at init as a buffer or parameter and mark it sw.tp.PerHead() in the plan (each rank then "
        "gets its heads' rows), or keep the whole count in an attribute the Region does not divide "
        "(self.total_heads = n_head at init) and compute from it"
    )
