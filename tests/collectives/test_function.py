"""shardwise's autograd Functions keep ``forward``'s signature (shardwise/collectives/function.py): torch's
``apply`` then binds each call's arguments without building it again (8 us a call)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import torch

import shardwise
from shardwise.collectives.function import QuickApplyFunction


def _package_functions() -> list[type]:
    for info in pkgutil.walk_packages(shardwise.__path__, "shardwise."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found, todo = [], [torch.autograd.Function]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("shardwise.") and cls is not QuickApplyFunction:
            found.append(cls)
    return found


def test_every_autograd_function_of_the_package_keeps_its_forwards_signature() -> None:
    functions = _package_functions()
    assert len(functions) >= 16, functions  # the collectives' eight, and those of the engine and transforms
    plain = [f"{cls.__module__}.{cls.__qualname__}" for cls in functions if not issubclass(cls, QuickApplyFunction)]
    assert not plain, f"derive these from shardwise.collectives.function.QuickApplyFunction: {plain}"
    for cls in functions:
        forward = cls.__dict__["forward"].__func__
        fresh = types.FunctionType(forward.__code__, forward.__globals__, forward.__name__, forward.__defaults__,
                                   forward.__closure__)
        fresh.__kwdefaults__, fresh.__annotations__ = forward.__kwdefaults__, forward.__annotations__
        assert vars(forward)["__signature__"] == inspect.signature(fresh), cls


def test_a_subclass_binds_its_defaults_as_torch_does() -> None:
    class Scale(QuickApplyFunction):
        @staticmethod
        def forward(x: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
            return x * factor

        @staticmethod
        def setup_context(ctx: object, inputs: tuple[object, ...], output: object) -> None:
            ctx.factor = inputs[1]  # type: ignore[attr-defined]  # the default, bound by apply

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            return g * ctx.factor, None  # type: ignore[attr-defined]

    x = torch.ones(2, requires_grad=True)
    Scale.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 3.0))
    assert torch.equal(Scale.apply(x, 2.0), torch.full((2,), 2.0))
