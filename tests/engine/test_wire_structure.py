"""The header of a pipeline transfer the Plan could not predict: its count and structure, read back
as they were sent, and nothing but a pytree structure read from it."""

from __future__ import annotations

import pickle
import sys
from collections import OrderedDict
from typing import NamedTuple

import optree
import pytest
import torch

from shardwise.engine.run import wire_structure


class Pair(NamedTuple):
    first: torch.Tensor
    second: tuple[torch.Tensor, None]


def test_a_structure_comes_back_as_it_was_sent() -> None:
    t = torch.zeros(2)
    value = {"pair": Pair(t, (t, None)), "rest": [t, OrderedDict(a=t)]}
    leaves, spec = optree.tree_flatten(value)
    count, back = wire_structure.decode(wire_structure.encode(len(leaves), spec))
    assert count == len(leaves) == 4 and back == spec
    assert optree.tree_unflatten(back, leaves)["pair"].second[0] is t
    assert wire_structure.decode(wire_structure.encode(3, None)) == (3, None)


class _Runs:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("ran",))


def _header(body: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray((1).to_bytes(8, "little") + body), dtype=torch.uint8)


def test_a_header_naming_anything_but_a_container_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print, which is not a container"):
        wire_structure.decode(_header(pickle.dumps(_Runs())))
    # A class from a module this process has not imported is refused too: reading a header imports nothing.
    assert "antigravity" not in sys.modules
    with pytest.raises(pickle.UnpicklingError, match=r"antigravity\.fly, which is not a container"):
        wire_structure.decode(_header(b"cantigravity\nfly\n."))  # protocol 0: GLOBAL antigravity.fly
    assert "antigravity" not in sys.modules
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="fewer than its count"):
        wire_structure.decode(torch.zeros(3, dtype=torch.uint8))
