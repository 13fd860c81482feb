"""The roles a spec plays (engine/stack/roles.py) and the stack's rules on them (engine/stack/compose.py).

Every spec implements its role's protocol, and one that lacks a member is refused naming it. The
lowering asks the stack for *the* spec playing PLACEMENT or SHARDING; a second spec of one of those
roles, from a transform of another name, would be ignored silently. SPLIT specs stack one per axis
(tests/engine/test_splits_per_axis.py); REWRITE specs (mixed_precision, remat) stack, rebuilt in the
one stated order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

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
    rewrites_in_order,
)
from shardwise.engine.stack.roles import PROTOCOLS, check_role, protocol_members
from shardwise.engine.stack.splits import NO_SPLIT, splits_of
from shardwise.testing.models import mlp

TP_PLAN = {"0": sw.tp.Colwise(), "2": sw.tp.Rowwise()}


def _step() -> sw.Step:
    chain, _ = sw.functionalize(mlp([4, 8, 8, 3]))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(0.1))


@dataclass(frozen=True)
class _Other:
    """A transform of another name playing ``role`` (as a new one, say context_parallel, would):
    every other member of its role's protocol is a stub (``missing`` names those it leaves out)."""

    role: str
    axis: str = "cp"
    missing: tuple[str, ...] = ()
    name: ClassVar[str] = "other_transform"

    def __str__(self) -> str:
        return f"other_transform(role={self.role}, axis={self.axis!r})"

    def __getattr__(self, member: str) -> Any:  # only for the members the dataclass has not
        if member in protocol_members(PROTOCOLS[self.role]) and member not in self.missing:
            return lambda *args, **kwargs: None
        raise AttributeError(member)


def _shipped_specs() -> list[Any]:
    """One spec of every transform shardwise ships."""
    step = sw.remat(sw.mixed_precision(_step(), "compute=bf16"))
    step = sw.pipeline(sw.shard_params(sw.tensor_parallel(step, "tp", TP_PLAN), "dp"), "pp", "1f1b", 2)
    return list(step.transforms)


@pytest.mark.parametrize("spec", _shipped_specs(), ids=lambda spec: spec.name)
def test_every_shipped_spec_implements_its_role_protocol(spec: Any) -> None:
    members = protocol_members(PROTOCOLS[spec.role])
    assert {"name", "role"} <= set(members)
    assert [m for m in members if not hasattr(spec, m)] == []
    check_role(spec)


def test_the_stack_without_a_split_reads_no_split_and_a_split_reads_as_its_one_part() -> None:
    assert splits_of(_step().transforms) is NO_SPLIT and NO_SPLIT.axes == () and NO_SPLIT.name == "no split"
    split = sw.tensor_parallel(_step(), "tp", TP_PLAN)
    assert split.split.parts == (split.transforms[0],) and split.split.axes == ("tp",)
    assert split.split.name == "tensor_parallel"
    assert NO_SPLIT.local_view(split.chain, {}, None, None) == {}


@pytest.mark.parametrize("role", [PLACEMENT, SHARDING, SPLIT, REWRITE])
def test_a_spec_missing_a_member_of_its_role_is_refused_naming_it(role: str) -> None:
    members = [m for m in protocol_members(PROTOCOLS[role]) if m not in ("name", "role")]
    check_role(_Other(role))  # the stub with every member is fine
    for member in members:
        if member == "axis":
            continue  # a dataclass field of the stub
        with pytest.raises(
            TypeError,
            match=rf"_Other plays the role '{role}' but has no '{member}'.*protocol {PROTOCOLS[role].__name__}",
        ):
            check_role(_Other(role, missing=(member,)))
    with pytest.raises(TypeError, match="but has no 'rewrite'"):
        add(_step(), _Other(REWRITE if role == REWRITE else SPLIT, missing=("rewrite",)))


def test_a_spec_of_an_unknown_role_is_refused() -> None:
    with pytest.raises(TypeError, match=r"has role 'reorder'; a transform's role is one of"):
        check_stack((_Other(SPLIT), _OtherRole()))


@dataclass(frozen=True)
class _OtherRole:
    role: str = "reorder"
    name: ClassVar[str] = "reorder"


def test_a_rewrite_that_the_stated_order_does_not_place_is_refused() -> None:
    with pytest.raises(TypeError, match=r"REWRITE_ORDER .* does not say where .* add 'other_transform' to that table"):
        check_stack((_Other(REWRITE),))


def test_the_chain_is_rebuilt_in_the_stated_order_whatever_order_the_transforms_came_in() -> None:
    base = _step()
    orders = [
        sw.tensor_parallel(sw.remat(sw.mixed_precision(base, "compute=bf16")), "tp", TP_PLAN),
        sw.mixed_precision(sw.remat(sw.tensor_parallel(base, "tp", TP_PLAN)), "compute=bf16"),
        sw.remat(sw.tensor_parallel(sw.mixed_precision(base, "compute=bf16"), "tp", TP_PLAN), layers="0"),
    ]
    for step in orders:
        assert [s.name for s in rewrites_in_order(step.transforms)] == ["tensor_parallel", "remat", "mixed_precision"]


def test_once_roles_are_the_roles_find_is_asked_for() -> None:
    assert set(ONCE) == {PLACEMENT, SHARDING}  # SPLIT: one per axis


@pytest.mark.parametrize("axes", [("tp", "tp"), ("tp", "tq")], ids=["same axis", "different axes"])
def test_two_tensor_parallels_are_refused_naming_both(axes: tuple[str, str]) -> None:
    once = sw.tensor_parallel(_step(), axes[0], TP_PLAN)
    expected = (rf"tensor_parallel was applied twice .*axis='{axes[1]}'.*"
                rf"already tensor_parallel\(axis='{axes[0]}'.*apply tensor_parallel once")
    with pytest.raises(ValueError, match=expected):
        sw.tensor_parallel(once, axes[1], TP_PLAN)


@pytest.mark.parametrize("role, apply", [
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
