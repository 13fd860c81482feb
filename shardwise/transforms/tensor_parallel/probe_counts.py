"""The head counts of a Region probe's copy (region_probe.py), set on objects the copy alone holds.

A Region divides its counts while its module runs (modules.py sets each rank's on the count's owner); the probe's
whole copies need the whole counts. A count held by a module of the Region is set on that module's twin in the
copy. A ``local=`` count may be held by an object that is no module (``Region(local=("cfg.width",))``): each rank
thread's replica deep-copies one held in an attribute of the module (``self.cfg``), but one the module's class
holds (a class attribute), or any object ``copy.deepcopy`` gives back as itself, is one object for every rank
thread. Setting the whole count on it, even for the copies' run alone, would let another rank thread running its
real layer at that moment read the whole count. So the copy gets a shallow copy of every object on the count's
path that is no twin, its attribute pointed at it (in every twin that refers to the object), and the count is set
there: the probe changes nothing another thread can read. Where the path cannot be given a copy of its own (a
property computes the object, an object that copies as itself), the call is not judged, and says so.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from . import not_judged as gaps
from .styles import Region


def set_counts(module: nn.Module, twins: dict[int, nn.Module], n: int, kind: str) -> None:
    """Set every count the Regions in ``module`` divide on the copy ``twins`` (by the id of each submodule it
    copies): the rank's (``kind == "split"``) or the whole one; NotJudged where a count's owner cannot be
    the copy's own."""
    own: dict[int, Any] = {}  # the copy's own shallow copies, by the id of the object each copies
    for m in module.modules():
        forward: Any = vars(m).get("forward")
        install = getattr(forward, "install", None)
        if install is None or not isinstance(install.style, Region):
            continue
        for k, (owner, attr, whole) in enumerate(forward.locals):
            value = whole // n if kind == "split" else whole
            if isinstance(owner, nn.Module) and id(owner) in twins:
                object.__setattr__(twins[id(owner)], attr, value)
            elif k < len(install.style.local):  # (modules.py lists the local= ones first, each found)
                _set_on_own_path(twins[id(m)], install.style.local[k], value, twins, own)
            else:
                raise gaps.owner_shared(attr, owner)


def _set_on_own_path(
    root: nn.Module, dotted: str, value: int, twins: dict[int, nn.Module], own: dict[int, Any]
) -> None:
    """``root`` (a twin) reaching ``dotted`` through twins and objects of the copy's own, its count set there."""
    copies = {id(t) for t in twins.values()}
    *path, attr = dotted.split(".")
    holder: Any = root
    for part in path:
        found = getattr(holder, part)
        if id(found) in copies or id(found) in {id(o) for o in own.values()}:
            holder = found
            continue
        mine = own.get(id(found))
        if mine is None:
            mine = own[id(found)] = _own_copy(found, dotted)
            for t in twins.values():  # another submodule referring to the same object reads the copy's too
                for name in [name for name, v in vars(t).items() if v is found]:
                    object.__setattr__(t, name, mine)
        _set(holder, part, mine, dotted)
        holder = mine
    _set(holder, attr, value, dotted)


def _own_copy(found: Any, dotted: str) -> Any:
    try:
        mine = copy.copy(found)
    except Exception:
        raise gaps.owner_shared(dotted, found) from None
    if mine is found:
        raise gaps.owner_shared(dotted, found)
    return mine


def _set(holder: Any, name: str, value: Any, dotted: str) -> None:
    """``holder.name = value``, checked: read back as set (a property, a frozen or immutable object: not)."""
    try:
        if isinstance(holder, nn.Module):
            object.__setattr__(holder, name, value)  # a twin's own dict (a class attribute shadowed)
        else:
            setattr(holder, name, value)
    except Exception:
        raise gaps.owner_shared(dotted, holder) from None
    if getattr(holder, name, None) is not value:
        raise gaps.owner_shared(dotted, holder)
