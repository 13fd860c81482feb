"""Random ops that draw from a ``torch.Generator`` of the layer's own: refused under remat.

torch's checkpoint stashes the state of the *default* generators (the CPU's and the
device's) when a layer runs forward and restores it when backward recomputes the
layer, so dropout draws the same mask twice. A generator the layer passes itself
(``torch.rand(..., generator=g)``) is not restored: the recomputation draws the
next numbers of its stream, and the gradient is that of another forward. An op
called with such a generator is refused wherever remat would recompute it: under
plain checkpoint (``nothing_saveable``) by a dispatch mode around the layer's
forward, under a selective policy by the policy adapter, for the ops the policy
does not save. Layers remat runs as they are (``everything_saveable``) recompute
nothing and are not watched.

The same holds for a generator object of the layer's own outside torch (``random.Random()``,
``np.random.RandomState()``, ``np.random.default_rng()``; Python's ``random`` and numpy's global
generator are replayed, ``engine/model/host_random.py``): one that the layer's module holds as an
attribute and that its first forward under remat draws from is refused
(:func:`refusing_own_host_generators`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...engine.model import host_random

__all__ = ["RefuseOwnGenerators", "own_generator", "refuse_own_generator", "refusing_own_host_generators"]


def _is_default(gen: torch.Generator) -> bool:
    """Whether ``gen`` is a default generator, which checkpoint replays. The dispatcher hands a
    new Python object for the same generator, so they are compared by the C++ object."""
    key = _object_of(gen)
    if key == _object_of(torch.default_generator):
        return True
    device_module = getattr(torch, gen.device.type, None)  # torch.cuda, torch.xpu, ...
    return any(_object_of(d) == key for d in getattr(device_module, "default_generators", ()))


def _object_of(gen: torch.Generator) -> int:
    """The address of the C++ generator behind ``gen`` (torch's stubs do not declare ``_cdata``)."""
    return int(getattr(gen, "_cdata"))  # noqa: B009


def own_generator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    """The non-default generator an op is called with, if any (aten ops take it as ``generator=``)."""
    for value in (*kwargs.values(), *args):
        if isinstance(value, torch.Generator) and not _is_default(value):
            return value
    return None


def refuse_own_generator(
    layer: str, policy: Any, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, selective: bool = False,
) -> None:
    """Raise if ``op`` draws from a generator of the layer's own (its recomputation would differ).
    ``selective``: the policy chooses what to save, so saving this op's output is a fix too."""
    if own_generator(args, kwargs) is None:
        return
    name = f"layer {layer!r}" if layer else "a layer"
    save = ", use a policy that saves this op's output," if selective else ""
    raise ValueError(
        f"remat({policy!r}): {name} calls {op} with a torch.Generator of its own (generator=...). "
        "torch's checkpoint replays only the default generators, so the recomputation in backward "
        "would draw other random numbers than the forward did, and the gradient would not be the "
        "forward's. Draw from the default generator (drop generator=...; seed runs with "
        f"torch.manual_seed, the step seeds it for every compute){save} or leave the layer out of "
        "remat (remat(..., layers=[...]) without it)"
    )


class RefuseOwnGenerators(TorchDispatchMode):
    """Around a layer's forward under plain checkpoint: refuse every op drawing from an own generator."""

    def __init__(self, layer: str, policy: Any) -> None:
        super().__init__()
        self.layer, self.policy = layer, policy

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        refuse_own_generator(self.layer, self.policy, func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def refusing_own_host_generators(fn: Any, layer: str, policy: Any) -> Iterator[None]:
    """Around a layer's watched forward: refuse it if it drew from a ``random.Random`` or numpy generator
    object that its module holds (the calling thread's copy of it: :func:`_module_of`)."""
    module = _module_of(fn)
    owned = host_random.own_generators(module) if module is not None else []
    before = [host_random.state_of(g) for _, g in owned]
    yield
    drawn = [path for (path, g), state in zip(owned, before, strict=True)
             if not host_random.same_state(state, host_random.state_of(g))]
    if drawn:
        name = f"layer {layer!r}" if layer else "a layer"
        raise ValueError(
            f"remat({policy!r}): {name} draws from a random generator object of its own "
            f"({', '.join(p if p.startswith('global ') else f'{type(module).__name__}.{p}' for p in drawn)}). "
            "remat replays torch's generators, "
            "Python's random and numpy's global np.random in the recomputation, not a generator object a "
            "module holds: the recomputation would draw other numbers than the forward did, and the "
            "gradient would not be the forward's. Draw from the global ones (random.random(), "
            "np.random.rand(): the step seeds them for every compute) or from torch, or leave the layer "
            "out of remat (remat(..., layers=[...]) without it)"
        )


def _module_of(fn: Any) -> torch.nn.Module | None:
    """The module a layer function calls, following ``__wrapped__``: the calling thread's replica of it
    where it keeps one per thread (functionalize's layers: a rank thread draws from its own copy)."""
    seen = 0
    while fn is not None and seen < 64:
        replicas: Any = getattr(fn, "replicas", None)
        module = replicas.get().module if hasattr(replicas, "get") else getattr(fn, "module", None)
        if isinstance(module, torch.nn.Module):
            return module
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None
