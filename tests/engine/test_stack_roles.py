"""A stack holds one spec of each role the engine lowers once (engine/stack/compose.py).

The lowering asks the stack for *the* spec playing PLACEMENT, SHARDING or SPLIT; a second spec
of one of those roles, from a transform of another name, would be ignored silently. Only
REWRITE specs (mixed_precision, remat) stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch.nn.functional as F

import shardwise as sw
from shardwise.engine.stack.compose import (
    ONCE,
    PLACEMENT,
    REWRITE,
    SHARDING,
    SPLIT,
    add,
    check_stack,
)
from shardwise.testing.models import mlp

TP_PLAN = {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}


def _step() -> sw.Step:
    chain, _ = sw.functionalize(mlp([4, 8, 8, 3]))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))


@dataclass(frozen=True)
class _Other:
    """A transform of another name playing ``role`` (as a new one, say context_parallel, would)."""

    role: str
    axis: str = "cp"
    name: ClassVar[str] = "other_transform"

    def __str__(self) -> str:
        return f"other_transform(role={self.role}, axis={self.axis!r})"


def test_once_roles_are_the_roles_find_is_asked_for() -> None:
    assert set(ONCE) == {PLACEMENT, SHARDING, SPLIT}


@pytest.mark.parametrize("axes", [("tp", "tp"), ("tp", "tq")], ids=["same axis", "different axes"])
def test_two_tensor_parallels_are_refused_naming_both(axes: tuple[str, str]) -> None:
    once = sw.tensor_parallel(_step(), axes[0], TP_PLAN)
    expected = (rf"tensor_parallel was applied twice .*axis='{axes[1]}'.*"
                rf"already tensor_parallel\(axis='{axes[0]}'.*apply tensor_parallel once")
    with pytest.raises(ValueError, match=expected):
        sw.tensor_parallel(once, axes[1], TP_PLAN)


@pytest.mark.parametrize("role, apply", [
    (SPLIT, lambda s: sw.tensor_parallel(s, "tp", TP_PLAN)),
    (SHARDING, lambda s: sw.shard_params(s, "dp")),
    (PLACEMENT, lambda s: sw.pipeline(s, "pp", "1f1b", 2)),
])
def test_a_second_spec_of_a_once_role_under_another_name_is_refused(
    role: str, apply: Callable[[sw.Step], sw.Step]
) -> None:
    first = apply(_step())
    expected = (rf"other_transform\(role={role}, axis='cp'\) and {first.transforms[0].name}\(.* "
                rf"both play the role '{role}' .* would ignore the second: apply only one")
    with pytest.raises(ValueError, match=expected):
        add(first, _Other(role))
    with pytest.raises(ValueError, match=f"both play the role '{role}'"):  # in either order
        check_stack((_Other(role), *first.transforms))


def test_rewrites_still_stack() -> None:
    step = sw.remat(sw.mixed_precision(_step(), "compute=bf16"))
    assert [s.role for s in step.transforms] == [REWRITE, REWRITE]
    check_stack((*step.transforms, _Other(SPLIT)))  # one of a once role beside them is fine
