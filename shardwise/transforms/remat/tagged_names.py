"""Which names the remat'd layers tag, against the names ``save_only_these_names`` was given.

A name that no ``checkpoint_name`` call tags (a typo, a tag in a layer left out of remat) saves
nothing: the layers would run as plain checkpointing, slower than the policy asked, without a word.
The names exist only when the layers run, so a :class:`TaggedNames` shared by every layer of one
remat hears the names its policy is asked about during each layer's forwards with gradients, and once
every remat'd layer has run one, refuses a given name none of them tagged, naming those they tag.
A name tagged in only some of the layers counts (the policy saves it where it is tagged).

Where no process runs every remat'd layer (a pipeline over rank processes: each runs its stage's) no
process hears them all, and nothing is checked there; on one device, under data, tensor, expert or
context parallel, and in a pipeline over rank threads (which share the layers) the check runs.

>>> from shardwise.policies import save_only_these_names
>>> names = TaggedNames(frozenset({"attn_out"}), frozenset({"a", "b"}), save_only_these_names("attn_out"))
>>> names.tag("attn_out"); names.ran_layer("a"); names.ran_layer("b")
>>> typo = TaggedNames(frozenset({"atn_out"}), frozenset({"a"}), save_only_these_names("atn_out"))
>>> typo.tag("attn_out"); typo.ran_layer("a")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: remat(save_only_these_names('atn_out')): no remat'd layer tags 'atn_out' ...
"""

from __future__ import annotations

import threading
from typing import Any


class TaggedNames:
    """The names heard in the forwards of ``layers`` (one remat's), checked against ``wanted`` once
    every layer has run; ``policy`` names the policy in the refusal."""

    def __init__(self, wanted: frozenset[str], layers: frozenset[str], policy: Any) -> None:
        self.wanted, self.layers, self.policy = wanted, layers, policy
        self.heard: set[str] = set()
        self.ran: set[str] = set()
        self.checked = False
        self.refusal: str | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a rank process gets the chain pickled: not the lock
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    def tag(self, name: str) -> None:
        """A ``checkpoint_name(x, name)`` call ran in one of the layers."""
        self.heard.add(name)

    def ran_layer(self, layer: str) -> None:
        """``layer`` ran a forward with gradients: once every layer has, refuse a name none tagged (on
        this call and every later one, so every rank thread that runs a layer again stops too)."""
        if not self.checked:
            with self._lock:
                if not self.checked:
                    self.ran.add(layer)
                    if self.ran >= self.layers:
                        self.refusal = self._refusal()
                        self.checked = True
        if self.refusal is not None:
            raise ValueError(self.refusal)

    def _refusal(self) -> str | None:
        missing = sorted(self.wanted - self.heard)
        if not missing:
            return None
        given = ", ".join(repr(n) for n in missing)
        layers = sorted(self.layers)
        shown = layers if len(layers) <= 6 else [*layers[:6], f"... ({len(layers)} layers)"]
        if self.heard:
            there = f"the names they tag are {', '.join(repr(n) for n in sorted(self.heard))}"
        else:
            there = ("no layer tags any name: tag a value in the layer's forward with "
                     "sw.policies.checkpoint_name(x, name)")
        return (
            f"remat({self.policy!r}): no remat'd layer tags {given} (layers {shown}, in their forwards with "
            f"gradients), so the policy would save nothing under {'it' if len(missing) == 1 else 'them'} and "
            f"those layers would run as plain checkpointing; {there}. Give the names the layers tag, tag the "
            "values under these names, or pass nothing_saveable for plain checkpointing"
        )
