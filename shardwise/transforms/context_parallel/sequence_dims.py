"""Following the dims that hold the rank's positions through a layer's first call, at dispatch level.

Under context_parallel each rank holds a part of every sequence, and a layer is right on it only where it
computes each position from that position alone, outside the attentions the transform installed (which
exchange the rest). :class:`FollowSequence` tags the sequence dim of the layer's inputs (as the previous
layer's outputs held it: :func:`hand_over`; else by the part's length) and follows it
through every aten op (``sequence_rules.py``): pointwise ops, products over other dims, reshapes that fold
(batch, sequence) into rows and back, norms and softmax over other dims, indexing and lookups by ids that
hold positions. An op that moves or mixes along a tagged dim (a reduction over the tokens, a pad, roll,
slice or concatenation along them, a product contracting them, a convolution or scan over time), or one no
rule knows given a tagged tensor, is handed to ``refuse``, unless it runs inside an installed attention
(which it does not follow: its output holds the queries' positions), in transformers' mask making (whose
mask context_parallel replaces) or inside experts known to compute each token alone (``token_wise.py``:
their routing gathers and scatters the tokens; their output holds their input's positions).

Dispatch level rather than ``__torch_function__``: every public function (``torch.einsum``, ``x @ y``,
``F.pad``, ``F.interpolate``, ``torch.std``) arrives as one of a finite set of aten ops whose dims are
explicit arguments and whose pointwise ones are tagged ``torch.Tag.pointwise``, so one table covers them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ...engine.model.token_wise import computes_each_token_alone, implementation_named, token_wise_runner
from .sequence_rules import judge
from .sequence_tags import POOLED, Tags, tensors_in

_current = threading.local()  # .follower: the FollowSequence of this thread's watched call, if any
Refuse = Callable[[str, str], None]  # (what the op does, the aten op's name)


class FollowSequence(TorchDispatchMode):
    """Tags the dims that hold the part's positions and refuses ops that mix them (see the module docstring)."""

    def __init__(self, refuse: Refuse, quiet: Callable[[], bool], exempt: Callable[[], bool]) -> None:
        super().__init__()
        self.refuse, self.quiet, self.exempt = refuse, quiet, exempt
        self.tags: dict[int, tuple[weakref.ref[Tensor], Tags]] = {}
        self.opaque = 0  # how deep this thread is in a module known to compute each token alone

    def tag(self, t: Tensor, tags: Tags) -> None:
        if tags:
            self.tags[id(t)] = (weakref.ref(t), tags)
        else:
            self.tags.pop(id(t), None)

    def tags_of(self, t: Any) -> Tags:
        entry = self.tags.get(id(t)) if isinstance(t, Tensor) else None
        return entry[1] if entry is not None and entry[0]() is t else {}

    def follow_inputs(self, tree: Any, dim: int, local: int | None, handed: list[Tags] | None = None) -> None:
        """Tag the input leaves: as the previous layer's output leaves at their place in the tree were tagged
        (``handed``, see :func:`hand_over`), where that leaf was; else ``dim`` of each leaf whose ``dim`` is the
        part's length (the batch's leaves, which the cut cuts there; hidden states from an unknown producer)."""
        leaves = optree.tree_leaves(tree)
        for i, t in enumerate(leaves):
            if not isinstance(t, Tensor):
                continue
            if handed is not None and handed[i]:
                self.tag(t, handed[i])
            elif local is not None and local > 1 and t.dim() > dim and t.shape[dim] == local:
                self.tag(t, {dim: (1, local)})

    def pools(self, out: Any) -> bool:
        """Whether ``out`` (a layer's output) holds a mean over every element of a tensor that held positions."""
        return any(POOLED in self.tags_of(t) for t in optree.tree_leaves(out))

    def like(self, out: Any, q: Tensor) -> None:
        """``out`` (an installed attention's output) holds the positions its queries ``q`` hold."""
        tags = self.tags_of(q)
        if isinstance(out, Tensor) and tags and out.dim() == q.dim() and out.shape[:-1] == q.shape[:-1]:
            self.tag(out, tags)

    def token_wise(self, run: Callable[[], Any], x: Any, where: str) -> Any:
        """``run()``, a split's forward of a mixture-of-experts block that computes each token of ``x`` from its
        own row alone (expert_parallel's): not followed inside; its output holds ``x``'s positions."""
        self.opaque += 1
        try:
            out = run()
        finally:
            self.opaque -= 1
        _hold_like(self, out, x, where)
        return out

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError as err:
            if type(err) is not RuntimeError or self.opaque or self.quiet():
                raise
            held = next((t for t in tensors_in(args, kwargs) if any(d >= 0 for d in self.tags_of(t))), None)
            if held is None:
                raise
            # Still a RuntimeError (a model may catch it to fall back), now saying why the shapes may not fit.
            raise RuntimeError(
                f"{err}\n(context_parallel: aten.{func.overloadpacket.__name__} failed on a {list(held.shape)} "
                f"tensor whose dim {min(d for d in self.tags_of(held) if d >= 0)} holds this rank's part of the "
                "sequence only: an op sized by the whole sequence, such as a token-mixing Linear over the "
                "sequence dim, cannot run on a part; leave context_parallel out for this model)"
            ) from err
        if self.opaque or func.namespace != "aten" or self.quiet() or not any(
                self.tags_of(t) for t in tensors_in(args, kwargs)):
            return out
        verdict = judge(func, args, kwargs, out, self.tags_of)
        if verdict.why is not None and not self.exempt():
            self.refuse(verdict.why, func.overloadpacket.__name__)
        results = [t for t in optree.tree_leaves(out, none_is_leaf=True) if isinstance(t, Tensor)]
        for t, tags in zip(results, verdict.outs, strict=True):
            self.tag(t, tags)
            written = tags and t._base is not None and _writes(func) and any(t is a for a in args)
            if written:
                self._tag_base(t, tags, func)
        return out

    def _tag_base(self, view: Tensor, tags: Tags, func: Any) -> None:
        """An in-place write of positions into a view: the dims of its base with the view's strides hold them."""
        base = view._base
        assert base is not None
        found = dict(self.tags_of(base))
        for d, r in tags.items():
            dims = [e for e in range(base.dim()) if base.stride(e) == view.stride(d) and base.shape[e] > 1]
            if not dims:
                self.refuse(f"writes a tensor that holds the part's positions into a {list(view.shape)} view of a "
                            f"{list(base.shape)} tensor, whose dims it cannot follow", func.overloadpacket.__name__)
            found.setdefault(dims[0], r)
        self.tag(base, found)


def hand_over(follower: FollowSequence | None, out: Any) -> None:
    """Record on this thread how the dims of a watched layer's output leaves hold positions (marks beside the dims
    dropped: the next layer follows its own ops), for the next layer's watch; None (an unwatched call) forgets."""
    if follower is None:
        _current.handed = None
        return
    leaves = optree.tree_leaves(out)
    tags = [{d: r for d, r in follower.tags_of(t).items() if d >= 0} for t in leaves]
    _current.handed = (_shapes(leaves), tags)


def handed(tree: Any) -> list[Tags] | None:
    """The tags :func:`hand_over` recorded, if ``tree``'s leaves are shaped as the recorded output's (the previous
    layer's output, handed over on this thread); None where the producer is not known."""
    record = getattr(_current, "handed", None)
    if record is None:
        return None
    shapes, tags = record
    return tags if _shapes(optree.tree_leaves(tree)) == shapes else None


def _shapes(leaves: list[Any]) -> tuple[Any, ...]:
    return tuple(tuple(t.shape) if isinstance(t, Tensor) else type(t) for t in leaves)


def _writes(func: Any) -> bool:
    return torch.Tag.inplace in func.tags or func.overloadpacket.__name__.endswith("_")


@contextmanager
def following(follower: FollowSequence) -> Iterator[FollowSequence]:
    """``follower`` watching this thread's ops, and seeing which modules known to compute each token alone run."""
    outer = getattr(_current, "follower", None)
    _current.follower = follower
    _hook_modules(+1)
    try:
        with follower, token_wise_runner(follower.token_wise):
            yield follower
    finally:
        _hook_modules(-1)
        _current.follower = outer


def current() -> FollowSequence | None:
    follower: FollowSequence | None = getattr(_current, "follower", None)
    return follower


# Global module hooks, installed while some thread follows a call (a module's own hooks would miss the copies
# each thread rank makes of it): they mark the calls of experts known to compute each token alone.
_lock = threading.Lock()
_hooks: list[Any] = []
_users = 0


def _hook_modules(change: int) -> None:
    global _users
    with _lock:
        _users += change
        if _users == 1 and not _hooks:
            _hooks.extend([nn.modules.module.register_module_forward_pre_hook(_enter),
                           nn.modules.module.register_module_forward_hook(_leave)])
        elif _users == 0:
            for hook in _hooks:
                hook.remove()
            _hooks.clear()


_TOKEN_WISE: dict[tuple[type, Any], bool] = {}


def _token_wise(module: nn.Module) -> bool:
    key = (type(module), implementation_named(module))
    if key not in _TOKEN_WISE:
        _TOKEN_WISE[key] = computes_each_token_alone(module)
    return _TOKEN_WISE[key]


def _enter(module: nn.Module, args: tuple[Any, ...]) -> None:
    follower = current()
    if follower is not None and _token_wise(module):
        follower.opaque += 1


def _leave(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
    follower = current()
    if follower is None or not _token_wise(module):
        return
    follower.opaque -= 1
    if not follower.opaque:
        _hold_like(follower, out, args[0] if args else None, type(module).__name__)


def _hold_like(follower: FollowSequence, out: Any, x: Any, where: str) -> None:
    """``out``, the rows of tokens a token-wise module returned for ``x``: tagged as ``x``."""
    tags = follower.tags_of(x)
    if not tags:
        return
    assert isinstance(x, Tensor)
    lead = max(tags) + 1
    first = out[0] if type(out) is tuple and out else out
    if not isinstance(first, Tensor) or tuple(first.shape[:lead]) != tuple(x.shape[:lead]):
        shape = list(first.shape) if isinstance(first, Tensor) else type(first).__name__
        follower.refuse(f"runs {where}, known to compute each token alone, which returns {shape} for tokens "
                        f"{list(x.shape[:lead])}", where)
    follower.tag(first, tags)
