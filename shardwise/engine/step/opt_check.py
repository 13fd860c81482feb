"""A TrainState's optimizer state must be laid out as the step's optimizer makes it on this rank.

Like its parameters (held_check.py), a state's optimizer state is the user's to change, and some
changes run on without an error and train something else: SGD's momentum cast to bfloat16 by hand
is rounded once and promoted back at the next update; a moment replaced by one of shape ``[1]``
broadcasts; a step count made a ``[1]`` tensor counts on. Others fail deep in the optimizer
(AdamW's foreach ops on moments of another dtype) naming nothing the user wrote. So the optimizer
state's tensors are compared, shape and dtype, with what the optimizer's ``init`` makes from this
rank's part of the parameters (its layers, ZeRO shards, tensor-parallel slices, in the master
dtype), run on meta tensors. A user's optimizer may make its state at its first update instead
(``init`` returns an empty tree): the state one update makes from init's, on meta tensors where the
update runs there, is accepted too. Each tensor's device is compared as well: a moment on another
device than its parameters fails deep in the update otherwise (``Tensor on device cpu is not on the
expected device meta!``). A leaf init makes as a meta tensor belongs on the device of this rank's
parameters; one it makes on a device (a step count kept on the host) belongs there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch

from ..optim.expected_state import expected_opt_states

__all__ = ["check_devices", "check_opt_state", "describe_change", "expected_opt_states", "first_non_tensor"]

_FIX = ("A TrainState's optimizer state is the step's own layout: change values in place (tensor.copy_), "
        "not the tensors; to cast it, reshard it or carry it to another step, go through sw.checkpoint.save / "
        "load, or start afresh with step.init(params, mesh)")


def check_opt_state(opt_state: Any, expected: list[Any], devices: frozenset[torch.device], known: bool = True) -> None:
    """Refuse ``state.opt_state`` unless it holds the tensors one of ``expected`` holds, in shape, dtype
    and device (``devices``: where this rank's parameters are); the message names the first difference
    from the one it is nearest (the same entries, else init's). ``known``: False where the optimizer's
    update could not be run on meta tensors (the message says so)."""
    problems = [_difference(opt_state, want, devices) for want in expected]
    found = [p for p in problems if p is not None]
    if len(found) == len(problems):
        near, error = max(found, key=lambda p: p[0])  # the first of the nearest
        if near < 2 and not known:
            raise type(error)(
                f"{error} (This optimizer's update could not run on meta tensors, so a state it makes at its "
                "first update is known to this step only once it returned one on this rank.)"
            ) from None
        raise error


def _leaves_by_path(tree: Any) -> dict[str, Any] | None:
    """Each leaf of ``tree`` by how a user writes it (``state.opt_state.momentum['0']['bias']``)."""
    try:
        accessors, leaves, _ = optree.tree_flatten_with_accessor(tree)
    except Exception:
        return None
    return {a.codify("state.opt_state"): leaf for a, leaf in zip(accessors, leaves, strict=True)}


def _difference(have: Any, want: Any, devices: frozenset[torch.device]) -> tuple[int, Exception] | None:
    """The first way ``have`` differs from ``want`` as an error to raise, with how near it came (0: another
    kind of state, 1: other entries, 2: the same entries), or None."""
    if type(have) is not type(want) and not (isinstance(have, Mapping) and isinstance(want, Mapping)):
        return 0, TypeError(
            f"state.opt_state is {_kind(have)}, but this step's optimizer keeps {_kind(want)} (as its init "
            f"makes it): a state of another optimizer, or one edited by hand. {_FIX}"
        )
    got, wanted = _leaves_by_path(have), _leaves_by_path(want)
    if got is None or wanted is None:
        return 0, TypeError(f"state.opt_state is {_kind(have)}, which cannot be read as a tree of tensors. {_FIX}")
    missing = [p for p in wanted if p not in got]
    if missing:
        return 1, ValueError(
            f"{missing[0]} is missing from the state{_more(missing)}: the optimizer's init makes it "
            f"({_text(wanted[missing[0]])}). {_FIX}"
        )
    extra = [p for p in got if p not in wanted]
    if extra:
        return 1, ValueError(
            f"{extra[0]} is in the state{_more(extra)}, but the optimizer's init makes no such "
            f"entry on this rank. {_FIX}"
        )
    for path, like in wanted.items():
        leaf = got[path]
        if not isinstance(like, torch.Tensor):
            if type(leaf) is not type(like):
                return 2, TypeError(f"{path} is {_kind(leaf)}, but the optimizer's init makes {_kind(like)}. {_FIX}")
            continue
        if not isinstance(leaf, torch.Tensor):
            return 2, TypeError(
                f"{path} is {_kind(leaf)}, but the step keeps it as a tensor, {_text(like)} (as the optimizer's "
                f"init makes it; a number goes in as torch.tensor(n, dtype={like.dtype})). {_FIX}"
            )
        if leaf.shape != like.shape or leaf.dtype != like.dtype:
            return 2, ValueError(
                f"{path} is {_text(leaf)}, but the step keeps it as {_text(like)}: as the optimizer's init makes "
                f"it on this rank (from its part of the parameters, in their master dtype). {_FIX}"
            )
        problem = _device_problem(path, leaf, like.device, devices)
        if problem is not None:
            return 2, problem
    return None


def check_devices(opt_state: Any, devices: frozenset[torch.device]) -> None:
    """Refuse a tensor of ``state.opt_state`` on no device of this rank's parameters (a scalar, such as a
    step count, may be on the host too): what is checked of a state whose layout is not predicted."""
    leaves = _leaves_by_path(opt_state) or {}
    for path, leaf in leaves.items():
        host_scalar = isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and leaf.device.type == "cpu"
        if isinstance(leaf, torch.Tensor) and leaf.device not in devices and not host_scalar:
            raise ValueError(_device_text(path, leaf, devices))


def first_non_tensor(opt_state: Any) -> str:
    """The first leaf of ``opt_state`` that is not a tensor (by path), in words."""
    for path, leaf in (_leaves_by_path(opt_state) or {"state.opt_state": opt_state}).items():
        if not isinstance(leaf, torch.Tensor):
            return f"{path} is {_kind(leaf)}"
    return "state.opt_state cannot be read as a tree of tensors"


def describe_change(before: Any, after: Any) -> str:
    """The first leaf (by path) whose shape, dtype or device one update changed, or an entry it added or
    dropped, in words (``before`` and ``after``: trees of tensors or their likes, see state_check._like)."""
    was, now = _leaves_by_path(before) or {}, _leaves_by_path(after) or {}
    for path in [p for p in was if p not in now] + [p for p in now if p not in was]:
        return f"{path} is {'in the state' if path in was else 'missing from the state'}, but the update made " + (
            "no such entry" if path in was else f"it ({_text(now[path])})")
    for path, leaf in was.items():
        new = now[path]
        if isinstance(leaf, torch.Tensor) and isinstance(new, torch.Tensor):
            if (leaf.shape, leaf.dtype, leaf.device) != (new.shape, new.dtype, new.device):
                return (f"{path} is {_text(leaf)} on {leaf.device}, but the update made {_text(new)} on "
                        f"{new.device} of it")
        elif type(leaf) is not type(new):
            return f"{path} is {_kind(leaf)}, but the update made {_kind(new)} of it"
    return "its layout changed"


def _device_problem(path: str, leaf: torch.Tensor, want: torch.device,
                    devices: frozenset[torch.device]) -> Exception | None:
    if want.type != "meta":  # made on a device by init itself (a step count on the host)
        if leaf.device == want:
            return None
        return ValueError(f"{path} is on {leaf.device}, but the optimizer's init makes it on {want}. {_FIX}")
    if leaf.device in devices:
        return None
    return ValueError(_device_text(path, leaf, devices))


def _device_text(path: str, leaf: torch.Tensor, devices: frozenset[torch.device]) -> str:
    where = " or ".join(sorted(map(str, devices))) or "the parameters' device"
    return (f"{path} is {_text(leaf)} on {leaf.device}, but the step keeps it on {where}, where this rank's "
            f"parameters are: the update would fail on it naming no entry. Move it back "
            f"(tensor.to('{sorted(map(str, devices))[0] if devices else 'cpu'}')), or, to move a whole state "
            "to another device, save it with sw.checkpoint.save and load it with the step on that device "
            "(sw.checkpoint.load).")


def _more(paths: list[str]) -> str:
    return f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor, {_text(value)}"
    name = type(value).__name__
    fields = getattr(value, "_fields", None)
    return f"{'an' if name[:1] in 'AEIOUaeiou' else 'a'} {name}" + (f"({', '.join(fields)})" if fields else "")


def _text(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return _kind(t)
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
