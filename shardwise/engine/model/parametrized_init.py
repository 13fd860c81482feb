"""A meta-built parametrized tensor's originals, made as the eager module holds them.

``torch.nn.utils.parametrize`` (``weight_norm``, ``orthogonal``, a parametrization of one's own) keeps a
tensor as its originals (``conv.parametrizations.weight.original0`` and ``original1``: weight_norm's g and v),
made when the parametrization is registered, from the tensor the module's constructor made (its
``reset_parameters()``), by the parametrizations' ``right_inverse``. An initializer that writes
``module.weight`` later writes a tensor computed from the originals, not them (transformers' Wav2Vec2
``_init_weights`` on its positional convolution), so the eager module keeps what the constructor made. Made one
at a time on a meta build, an original was handed to the initializer beside its still-meta sibling, and
weight_norm failed inside torch ("v_in is on meta and g_in is on cpu"). Here the unparametrized tensor is made by
the host class's own ``reset_parameters()`` (run on stand-ins of the host's tensors, seeded from the tensor's
path, so g and v come from one draw), and each original is its part of the first parametrization's
``right_inverse`` of it (a parametrization registered on top of another is appended as it is, as torch does).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .fx_split import FunctionalizeError

_LIST = "parametrizations"  # where torch keeps a module's ParametrizationLists


def parametrized_original(root: nn.Module, path: str) -> tuple[str, str, int | None] | None:
    """For the path of an original of a parametrized tensor (``a.b.parametrizations.weight.original1``): the
    host module's path, the tensor's name and the original's index (None for a lone ``original``); else None."""
    parts = path.split(".")
    if len(parts) < 3 or parts[-3] != _LIST or not parts[-1].startswith("original"):
        return None
    host_path, name, leaf = ".".join(parts[:-3]), parts[-2], parts[-1]
    host = root.get_submodule(host_path)
    if not parametrize.is_parametrized(host, name):
        return None
    return host_path, name, None if leaf == "original" else int(leaf[len("original"):])


class _Unparametrized:
    """The host module as its class is without parametrizations, for its ``reset_parameters()``: its own
    tensors are real stand-ins (the unparametrized one among them), its methods bound to this, anything else
    read from the host."""

    def __init__(self, host: nn.Module, cls: type, tensors: dict[str, Tensor]) -> None:
        self.__dict__.update(tensors, _host=host, _cls=cls)

    def __getattr__(self, attr: str) -> Any:
        found = inspect.getattr_static(self._cls, attr, None)
        if inspect.isfunction(found):
            return types.MethodType(found, self)
        return getattr(self._host, attr)


def make_original(
    root: nn.Module, host_path: str, name: str, index: int | None, device: torch.device,
    seeding: contextlib.AbstractContextManager[Any],
) -> Tensor:
    """The original ``index`` of ``host_path``'s parametrized ``name``, as the eager module has it."""
    host = root.get_submodule(host_path)
    cls = parametrize.type_before_parametrizations(host)
    reset = inspect.getattr_static(cls, "reset_parameters", None)
    where = f"{host_path}.{name}" if host_path else name
    if not inspect.isfunction(reset):
        raise FunctionalizeError(
            f"{where!r} is parametrized ({', '.join(type(p).__name__ for p in getattr(host, _LIST)[name])}), and "
            f"its {cls.__name__} has no reset_parameters() to make the tensor its originals are made from on a "
            "model built on the meta device; build the model eagerly, or start from stored weights "
            "(sw.checkpoint.init_from_pretrained, init_from_state_dict or init_from_dcp)"
        )
    with torch.no_grad():
        shapes = {n: t for n, t in [*host._parameters.items(), *host._buffers.items()] if t is not None}
        for n in getattr(host, _LIST):
            shapes[n] = getattr(host, n)  # (computed on the meta originals: its shape and dtype)
        tensors = {n: torch.zeros(t.shape, dtype=t.dtype, device=device) for n, t in shapes.items()}
        with seeding:
            reset(_Unparametrized(host, cls, tensors))
        value: Any = tensors[name]
        # torch registers the first parametrization through its right_inverse and appends any later one as it is
        # (the originals stay the first's of the constructor's tensor): only the first's right_inverse applies.
        inverse = getattr(getattr(host, _LIST)[name][0], "right_inverse", None)
        if inverse is not None:
            value = inverse(value)
    if index is None:
        return value.detach()
    return value[index].detach()
