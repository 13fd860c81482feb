"""What passes between the layers of the call-recording split (``capture.py``): the carry.

The units a model's forward calls form *segments*: units that hand one hidden state straight from each
to the next (an encoder's layers), each receiving it in one argument (its *slot*). Units of one
container are one loop of forward and must do so; between two containers (an encoder's last layer, a
decoder's first) forward may make a new hidden state, and a bridge layer runs that code.

Within a segment the carry is a tuple of tensors: the hidden state, one entry per group of the units'
other tensor arguments (a mask, ``(cos, sin)``, an encoder's output), and the tensors of the layer input
``x`` (ids, mask, labels). Its layout is fixed by the example: a tensor-or-None argument travels as a
tensor or as :func:`absent_marker`, and a non-tensor argument is fixed at the example's value and
checked on every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor

from ..torch_api import is_fake
from .fx_split import FunctionalizeError
from .pytrees import is_model_output

# The layers the split makes of the code around the units (a unit may not take one of these names).
EMBED, HEAD, BRIDGE = "embed", "head", "bridge"


def absent_marker() -> Tensor:
    """What travels in the carry for an argument that is None in this call."""
    return torch.empty((0, 0, 0), dtype=torch.int8)


def is_absent(t: Tensor) -> bool:
    return is_absent_layout(t.shape, t.dtype)


def is_absent_layout(shape: Any, dtype: Any) -> bool:
    """Whether a tensor of this shape and dtype is :func:`absent_marker`'s: a None argument."""
    return dtype == torch.int8 and tuple(shape) == (0, 0, 0)



@dataclass
class UnitCall:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None



# --- where the hidden state travels -----------------------------------------------------------


Slot = tuple[str, int | str]  # ("arg", position) or ("kwarg", name)


def output_parts(out: Any) -> tuple[Any, ...] | None:
    """A unit's output as ``(hidden, *rest)``: a tuple or list as it is; a ``ModelOutput`` (what an
    encoder returns: ALBERT's, whose one shared layer runs as every layer, can be split no finer) as
    every one of its dataclass fields in order, the unset ones None, so that a field's place does not
    depend on which others a call set (``last_hidden_state`` first); None for anything else."""
    if isinstance(out, (tuple, list)):
        return tuple(out)
    if is_model_output(out) and dataclasses.is_dataclass(out):
        return tuple(getattr(out, f.name) for f in dataclasses.fields(out))
    return None


def hidden_of_output(path: str, out: Any) -> Tensor:
    """The hidden state unit ``path`` returned, in ``out``: the tensor, or its first element."""
    if isinstance(out, Tensor):
        return out
    # Tensors beyond [0] (Bloom's attention weights) pass on only where the later units of the segment
    # receive them (recording.carry_writes): the recording proved that nothing else reads them.
    parts = output_parts(out)
    if (
        parts and isinstance(parts[0], Tensor)
        and all(v is None or isinstance(v, Tensor) for v in parts[1:])
    ):
        return parts[0]
    raise FunctionalizeError(
        f"functionalize: unit {path!r} returns {_describe(out)}, but a unit passes one hidden state "
        "on: a tensor, or a tuple (or ModelOutput) of it and tensors or Nones. Turn off extra outputs "
        "(output_attentions=False, use_cache=False), or choose the blocks that return the hidden state as units."
    )


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class Segment:
    """Units that hand one hidden state straight from each to the next (an encoder's layers), each
    receiving it in argument ``slot``. Two segments (an encoder's layers, then a decoder's) have code
    between them that makes the next one's hidden state (the encoder's final norm, the decoder's
    embedding and masks): a bridge layer runs it."""

    start: int  # index of its first unit
    stop: int  # one past its last
    slot: Slot


def segments_of(paths: list[str], calls: list[UnitCall]) -> list[Segment]:
    """The units cut where the hidden state stops passing straight on, with the argument each segment's
    units receive it in. Units of one container (``encoder.layers``) are one loop, so forward must hand
    each the previous one's output: code changing it between two of them has no layer to run in and is
    refused. Between containers (``encoder.layers.1`` and ``decoder.layers.0``) it is a bridge."""
    n = len(calls)
    outputs = [hidden_of_output(paths[i], calls[i].output) for i in range(n)]
    receives: list[list[Slot]] = [[]] + [_slots_holding(calls[i], outputs[i - 1]) for i in range(1, n)]
    loops = _loops(paths)
    slots: dict[int, Slot] = {}  # per loop: where its units receive the hidden state
    for first, stop in loops:
        inner: list[Slot] = []
        for i in range(first + 1, stop):
            if not receives[i]:
                raise FunctionalizeError(
                    f"functionalize: unit {paths[i]!r} does not receive the output of {paths[i - 1]!r}: forward "
                    f"changes the hidden state between them. Make that code part of a unit (list units by "
                    f"path), or split at modules that pass their output straight on."
                )
            inner.append(receives[i][0])
        _refuse_mixed_slots(inner)
        slots[first] = inner[0] if inner else _lone_unit_slot(paths[first], calls[first], receives[first])
    segments: list[Segment] = []
    for first, stop in loops:
        joined = segments and first > 0 and slots[first] in receives[first]
        if joined and segments[-1].slot != slots[first]:
            _refuse_mixed_slots([segments[-1].slot, slots[first]])
        if joined:
            segments[-1] = Segment(segments[-1].start, stop, slots[first])
        else:
            segments.append(Segment(first, stop, slots[first]))
    return segments


def _loops(paths: list[str]) -> list[tuple[int, int]]:
    """(first, stop) index ranges of consecutive units in one container: the loops of forward."""
    loops: list[tuple[int, int]] = []
    for i, path in enumerate(paths):
        if loops and path.rpartition(".")[0] == paths[i - 1].rpartition(".")[0]:
            loops[-1] = (loops[-1][0], i + 1)
        else:
            loops.append((i, i + 1))
    return loops


def _slots_holding(call: UnitCall, value: Tensor) -> list[Slot]:
    found: list[Slot] = [("arg", j) for j, a in enumerate(call.args) if a is value]
    return found + [("kwarg", k) for k, v in call.kwargs.items() if v is value]


def _refuse_mixed_slots(slots: list[Slot]) -> None:
    if slots and any(s != slots[0] for s in slots):
        raise FunctionalizeError(
            f"functionalize: the units receive their hidden state in different arguments ({slots}); "
            "choose units of one kind."
        )


def _lone_unit_slot(path: str, call: UnitCall, receives: list[Slot]) -> Slot:
    """Where a unit alone in its container receives its hidden state: its first argument, or
    ``hidden_states=``, or where it receives the previous unit's output."""
    if call.args:
        return ("arg", 0)
    if "hidden_states" in call.kwargs:
        return ("kwarg", "hidden_states")
    if receives:
        return receives[0]
    raise FunctionalizeError(
        f"functionalize: cannot tell which argument of {path!r} is its input; list two units or more"
    )


def without_hidden(call: UnitCall, slot: Slot) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kind, where = slot
    if kind == "arg":
        return tuple(a for j, a in enumerate(call.args) if j != where), dict(call.kwargs)
    return call.args, {k: v for k, v in call.kwargs.items() if k != where}


def with_hidden(
    hidden: Tensor, slot: Slot, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kind, where = slot
    if kind == "arg":
        assert isinstance(where, int)
        return (*args[:where], hidden, *args[where:]), kwargs
    return args, {**kwargs, str(where): hidden}


# --- the static layout of the carry ------------------------------------------------------------

_CONSTANT_TYPES = (bool, int, float, str, type(None), torch.Size)  # (a Size: a tuple of ints, BEiT's resolution)


@dataclass(frozen=True)
class _Leaves:
    """A pytree whose tensor-or-None leaves travel in the carry and whose other leaves are fixed."""

    spec: optree.PyTreeSpec
    constants: tuple[Any, ...]  # per leaf: the fixed value, or _TRAVELS
    where: tuple[int, ...]  # per leaf: index into the carry, or -1 for a constant

    def rebuild(self, carry: Sequence[Tensor]) -> Any:
        leaves = [
            c if i < 0 else (None if is_absent(carry[i]) else carry[i])
            for c, i in zip(self.constants, self.where, strict=True)
        ]
        return optree.tree_unflatten(self.spec, leaves)

    def check(self, what: str, tree: Any) -> list[Any]:
        """The leaves of ``tree``, refusing a structure or constant other than the example's."""
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        if spec != self.spec:
            raise FunctionalizeError(
                f"functionalize: {what} has structure {spec}, but the split was recorded on an example "
                f"with {self.spec}. Pass functionalize(..., example_input=) an input like your batches."
            )
        for c, i, leaf in zip(self.constants, self.where, leaves, strict=True):
            if i < 0 and not (type(leaf) is type(c) and leaf == c):
                raise FunctionalizeError(
                    f"functionalize: {what} has {leaf!r} where the example had {c!r}; the split fixes "
                    "non-tensor arguments at the example's values. Pass example_input= an input like your batches."
                )
        return leaves


_TRAVELS = object()


class Layout:
    """Carry = (hidden, one entry per group of unit arguments, the tensors of the input): the value
    passed between the layers of one segment of units (``paths``, ``calls``: its units)."""

    def __init__(self, paths: list[str], calls: list[UnitCall], slot: Slot, x: Any) -> None:
        self.paths = paths
        self.slot = slot
        groups: dict[Any, int] = {}  # ("tensor", id) or ("none", leaf path) -> group
        self.group_of = groups
        self.group_slots: list[list[tuple[int, int]]] = []  # per group: (unit, leaf) slots
        self.absent: list[bool] = []  # per group: None in the example (an attention mask the model skipped)
        self.units: list[_Leaves] = []
        for u, call in enumerate(calls):
            rest: Any = without_hidden(call, slot)
            leaves, spec = optree.tree_flatten(rest, none_is_leaf=True)
            paths_of = optree.tree_paths(rest, none_is_leaf=True)
            constants, where = [], []
            for j, leaf in enumerate(leaves):
                if isinstance(leaf, Tensor) or leaf is None:
                    key = ("tensor", id(leaf)) if isinstance(leaf, Tensor) else ("none", paths_of[j])
                    if key not in groups:
                        groups[key] = len(self.group_slots)
                        self.group_slots.append([])
                        self.absent.append(leaf is None)
                    self.group_slots[groups[key]].append((u, j))
                    constants.append(_TRAVELS)
                    where.append(1 + groups[key])
                else:
                    _check_constant(paths[u], paths_of[j], leaf)
                    constants.append(leaf)
                    where.append(-1)
            self.units.append(_Leaves(spec, tuple(constants), tuple(where)))
        start = 1 + len(self.group_slots)
        leaves, spec = optree.tree_flatten(x, none_is_leaf=True)
        constants, where = [], []
        for leaf in leaves:
            if isinstance(leaf, Tensor) or leaf is None:
                constants.append(_TRAVELS)
                where.append(start + len([w for w in where if w >= 0]))
            else:
                constants.append(leaf)
                where.append(-1)
        self.inputs = _Leaves(spec, tuple(constants), tuple(where))

    def carry(self, hidden: Tensor, calls: list[UnitCall], x: Any) -> tuple[Tensor, ...]:
        unit_leaves = [
            self.units[u].check(f"the arguments of unit {self.paths[u]!r}", without_hidden(call, self.slot))
            for u, call in enumerate(calls)
        ]
        entries = [hidden]
        # On fake tensors (a pipeline predicting what its stages pass on) a model cannot read data, so
        # it builds what it may skip on real inputs (Hugging Face's sdpa attention skips an all-causal
        # mask). Such a value follows the example: absent where the example had none, as on real inputs
        # like it. One made of the real batch alone (plan/predict.py: first_output) was decided by its
        # data, as the run decides: it stays.
        predicting = is_fake(hidden)
        for g, slots in enumerate(self.group_slots):
            values = [unit_leaves[u][j] for u, j in slots]
            first = values[0]
            if any(v is not first for v in values[1:]):
                (u0, _), (u1, _) = slots[0], slots[next(k for k, v in enumerate(values) if v is not first)]
                raise FunctionalizeError(
                    f"functionalize: units {self.paths[u0]!r} and {self.paths[u1]!r} shared an argument in the "
                    "example input but get different values now; pass example_input= an input like your batches."
                )
            follows_example = predicting and self.absent[g] and is_fake(first)
            entries.append(absent_marker() if first is None or follows_example else _as_tensor(first))
        input_leaves = self.inputs.check("the layer input", x)
        for leaf, i in zip(input_leaves, self.inputs.where, strict=True):
            if i >= 0:
                entries.append(absent_marker() if leaf is None else leaf)
        return tuple(entries)


def _as_tensor(value: Any) -> Tensor:
    assert isinstance(value, Tensor)
    return value


def _check_constant(unit: str, path: tuple[Any, ...], value: Any) -> None:
    if isinstance(value, _CONSTANT_TYPES):
        return
    where = "".join(f"[{k!r}]" for k in path)
    hint = (
        " It is a key/value cache: turn the cache off (use_cache=False)."
        if "cache" in type(value).__name__.lower()
        else " An object the model hands its units (Gemma-3n's shared key/value states) cannot be passed "
        "between layers: functionalize with units=None (one layer: no pipeline, ZeRO-3 gathers it whole), "
        "or with units that do not receive it."
    )
    raise FunctionalizeError(
        f"functionalize: unit {unit!r} receives a {type(value).__name__} at arguments{where}; only "
        f"tensors and plain constants can cross a layer boundary.{hint}"
    )

