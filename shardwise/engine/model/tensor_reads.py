"""Which watched tensors the code outside the units reads, and where forward is when it does.

The call-recording split (``capture.py``) runs a module's forward with its units stubbed, in
``embed`` up to the last unit, ``head`` after it (and a ``bridge`` between an encoder's units and
a decoder's). Which parameters each needs, and whether
what a unit returns besides its hidden state is used, are questions about reads, not about
which submodules run: DeBERTa's encoder reads ``self.rel_embeddings.weight`` by attribute
(the embedding module never runs), and Bloom's model receives its blocks' attention weights
and drops them. A TorchFunctionMode sees every op with its tensor arguments, whether the tensor
came from a module call or an attribute.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import optree
from torch import Tensor
from torch.overrides import TorchFunctionMode

# Ops that read a tensor's layout, never its values: a stand-in of the same shape and dtype answers alike.
_LAYOUT_ONLY = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "element_size",
    "is_floating_point", "is_complex", "is_contiguous", "get_device", "data_ptr", "__len__",
})


# Ops that hand a tensor's values on without computing from them (a copy, a view, a cast): what they return is
# followed as the stand-in it came from, and only a use of it that computes is refused (the step's check of a
# first call's module state copies every tensor it is given, stand-ins among them).
_PASSES_ON = frozenset({
    "detach", "detach_", "clone", "alias", "view", "view_as", "expand", "expand_as", "contiguous", "to", "type",
    "float", "double", "half", "bfloat16", "requires_grad_", "copy_",
})


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


def reads_values(func: Any, out: Any) -> bool:
    """Whether ``func`` (which returned ``out``) used its tensor arguments' values: not a layout
    query (``.size()``, ``.shape``, ``.dtype``), but a getter that returns a tensor (``.T``) is."""
    name = _name(func)
    if name in _LAYOUT_ONLY:
        return False
    return name != "__get__" or any(isinstance(t, Tensor) for t in optree.tree_leaves(out))


def tensors_in(tree: Any) -> Iterator[Tensor]:
    return (t for t in optree.tree_leaves(tree, none_is_leaf=False) if isinstance(t, Tensor))


class ReadLog(TorchFunctionMode):
    """Records, per place in forward (``where()``; None: not watched now, as inside a unit), the
    labels of the watched tensors each op reads and the op's name.

    ``watch(t, label, layout=True)`` counts a layout query of ``t`` as a read too (for a value that
    should not be touched at all). ``watch(t, label, follow=True)`` also follows what ops compute
    from ``t``: an op reading such a value reads ``t`` where it runs (a table read before the units
    into a value the code after them uses: the head needs the table; the same for the code between
    two stacks of units, an encoder's and a decoder's)."""

    def __init__(self, where: Callable[[], Hashable | None]) -> None:
        super().__init__()
        self.where = where
        self.watched: dict[int, tuple[Tensor, str, bool, bool]] = {}
        self.derived: dict[int, tuple[Tensor, frozenset[str]]] = {}
        self.reads: dict[Hashable, list[tuple[str, str]]] = {}  # where -> [(label, op name)]

    def watch(self, t: Tensor, label: str, layout: bool = False, follow: bool = False) -> None:
        self.watched[id(t)] = (t, label, layout, follow)

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        where = self.where()
        if where is None:
            return out
        values = reads_values(func, out)
        sources: set[str] = set()
        for t in tensors_in((args, kwargs)):
            found = self.watched.get(id(t))
            if found is not None and found[0] is t and (values or found[2]):
                self.reads.setdefault(where, []).append((found[1], _name(func)))
                if found[3] and values:
                    sources.add(found[1])
            derived = self.derived.get(id(t))
            if derived is not None and derived[0] is t and values:
                sources |= derived[1]
        if sources:
            # Read here, and followed on: a later place reading what this computes reads them too.
            self.reads.setdefault(where, []).extend((label, _name(func)) for label in sorted(sources))
            for t in tensors_in(out):
                self.derived[id(t)] = (t, frozenset(sources))
        return out

    def passed(self, tree: Any, user: str) -> None:
        """A unit is handed ``tree``: a watched parameter among it is read where forward is (no torch op
        reads it on its way: DeBERTa's encoder hands ``rel_embeddings.weight`` itself to every layer where
        ``norm_rel_ebd="none"``, its default), and so is every one a value among it was computed from (the
        layer that records what a decoder's units receive must compute it: a bias made from a table
        before the encoder, handed to the decoder's layers)."""
        where = self.where()
        if where is None:
            return
        for t in tensors_in(tree):
            found = self.watched.get(id(t))
            if found is not None and found[0] is t and found[3]:
                self.reads.setdefault(where, []).append((found[1], user))
            derived = self.derived.get(id(t))
            if derived is not None and derived[0] is t:
                self.reads.setdefault(where, []).extend((label, user) for label in sorted(derived[1]))

    def labels(self, *places: Hashable) -> set[str]:
        return {label for p in places for label, _ in self.reads.get(p, [])}


class StandInGuard(TorchFunctionMode):
    """Refuses a use of a parameter's zero stand-in that could change the result.

    ``stand_ins`` maps each stand-in tensor to its parameter's name. What an op computes from a
    stand-in (or from such a value) is followed; once ``counts()`` is true, an op reading one
    raises ``refuse(parameter name, op name)`` (where that gives None, the value is followed on).
    ``embed`` counts every op (it must not read a stand-in at all); ``head`` counts from its last
    unit on (its replay of the code before the units is discarded, but nothing after the units may
    depend on it)."""

    def __init__(
        self, stand_ins: dict[str, Tensor], counts: Callable[[], bool],
        refuse: Callable[[str, str], Exception | None],
    ) -> None:
        super().__init__()
        self.counts, self.refuse = counts, refuse
        self.origin: dict[int, tuple[Tensor, str]] = {id(t): (t, name) for name, t in stand_ins.items()}

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not reads_values(func, out):
            return out
        sources = []
        for t in tensors_in((args, kwargs)):
            found = self.origin.get(id(t))
            if found is not None and found[0] is t:
                sources.append(found[1])
        if sources:
            passes_on = _name(func) in _PASSES_ON
            error = self.refuse(sources[0], _name(func)) if self.counts() and not passes_on else None
            if error is not None:
                raise error
            for t in tensors_in(out):
                self.origin[id(t)] = (t, sources[0])
        return out

    def mark(self, t: Tensor, name: str) -> None:
        """Follow ``t`` as a stand-in named ``name`` from now on: a value that is not what the module
        computes there (a unit's output that a replay passes through)."""
        self.origin[id(t)] = (t, name)

    def unmark(self, t: Tensor) -> None:
        """Stop following ``t`` itself (what was computed from it stays followed): its value is the
        module's again (a replay's copy of a changed input, the carried values put back into it)."""
        self.origin.pop(id(t), None)

    def check_returned(self, out: Any) -> None:
        """Refuse an output that is a stand-in or was computed from one, though no op after the
        counting began read it (the code before the units computed it, forward returned it as it is:
        an encoder's output beside decoder layers as units); ``refuse``'s op is ``"return"``."""
        for t in tensors_in(out):
            found = self.origin.get(id(t))
            error = self.refuse(found[1], "return") if found is not None and found[0] is t else None
            if error is not None:
                raise error
