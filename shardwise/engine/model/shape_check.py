"""functionalize's example check for a module built on the meta device: on fake tensors.

A meta-built module is split on a stand-in whose parameters are zeros (see ``materialize``), so
comparing the module's and the chain's values on the example would compare zeros with zeros,
at the price of a real forward of the whole model (minutes and host memory the model's size at
70B parameters, where every zero weight is made dense for its matmul). On fake tensors the same
two runs cost no arithmetic and no memory, and still prove what the check is for: the chain
runs end to end on the example, returns the module's output structure with the same shapes and
dtypes, and no layer writes into its buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
from torch import Tensor, nn
from torch.func import functional_call

from ..torch_api import fake_tensors, version_of
from .chain import Chain
from .functional_frequencies import keep, layer_paths, watching
from .fx_split import FunctionalizeError
from .module_call import call_arguments
from .pytrees import register_output_types
from .reuse import LayerMemo, reusing_forwards


def check_shapes_against_module(
    module: nn.Module, chain: Chain, params: dict[str, dict[str, Tensor]], x: Any,
    check_output: Callable[[str, Any, bool], None], units: Sequence[nn.Module] = (),
) -> None:
    """Run ``module`` and ``chain`` on fake copies of ``x``; refuse any other structure, shape or
    dtype, and a layer that writes into one of its buffers. ``check_output(layer, y, last)``
    sees every layer's output (functionalize refuses one a pipeline could not pass on).

    Identical blocks run once (``engine/model/reuse.py``): in the module, the ``units`` (the
    split's blocks); in the chain, layers whose functions say they compute alike. A block like
    one checked, on an input like its, gives an output like its: checking it again proves nothing."""
    with fake_tensors() as fake:
        fake_x = optree.tree_map(fake, x)
        tensors = {n: fake(t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
        args, kwargs = call_arguments(module, fake_x)
        with reusing_forwards(units):
            expected = register_output_types(functional_call(module, tensors, args, kwargs, strict=True))
        got = fake_x
        memo = LayerMemo()
        for i, layer in enumerate(chain):
            buffers = {n: fake(b) for n, b in layer.buffers.items()}
            versions = {n: version_of(b) for n, b in buffers.items()}
            local = {n: fake(t) for n, t in chain.layer_params(params, layer).items()}
            key = memo.key(layer.fn, {**local, **buffers}, got, layer.name)
            found = memo.lookup(key, got)
            if found is not None:  # a unit like one checked before, on an input like its
                got = found[0]
            else:
                # Which of its modules call F.embedding(..., scale_grad_by_freq=True) (functional_frequencies.py;
                # a layer reused from the memo is seen at a step's first call, engine/run/frequency_watch.py).
                with watching(layer_paths(layer), layer.name) as calls:
                    y = layer.fn({**local, **buffers}, got)
                keep(layer, calls)
                memo.store(key, got, y)
                got = y
            check_output(layer.name, got, i == len(chain) - 1)
            for n, b in buffers.items():
                if version_of(b) != versions[n]:
                    raise FunctionalizeError(
                        f"functionalize: layer {layer.name!r} modified its buffer {n!r} in forward; a pure "
                        "layer cannot carry state. Put the module in eval mode or drop the in-place update."
                    )
        _compare_shapes(expected, got)


def structure_differs(expected: Any, got: Any, spec: Any, got_spec: Any) -> str:
    """What to say when the chain's output is not structured as the module's: the structures, and where a
    field holding every layer's output is shorter in the chain (``output_hidden_states=True``: the units'
    hidden states are collected by hooks on the units, which the code after them does not call), why."""
    message = f"functionalize: the chain returns a {got_spec}, but the module returns a {spec}"
    short = [
        key for key in ("hidden_states", "attentions", "router_logits", "encoder_hidden_states", "encoder_attentions")
        if isinstance(_field(expected, key), (tuple, list))
        and len(_field(got, key) or ()) < len(_field(expected, key))
    ]
    if short:
        flags = ", ".join(f"output_{k.removeprefix('encoder_')}=False" for k in dict.fromkeys(short))
        message += (
            f". Its {', '.join(short)} hold every layer's output, which a split by units does not return (the code "
            f"after the units collects them from the units' calls, which it does not make). Turn them off ({flags}, "
            "in the config or the batch), or split with units=None (one layer)"
        )
    return message


def _field(output: Any, key: str) -> Any:
    return output.get(key) if isinstance(output, dict) else getattr(output, key, None)


def _compare_shapes(expected: Any, got: Any) -> None:
    paths, leaves, spec = optree.tree_flatten_with_path(expected, none_is_leaf=True)
    got_leaves, got_spec = optree.tree_flatten(got, none_is_leaf=True)
    if spec != got_spec:
        raise FunctionalizeError(structure_differs(expected, got, spec, got_spec))
    for path, want, have in zip(paths, leaves, got_leaves, strict=True):
        where = "output" + "".join(f"[{k!r}]" for k in path)
        if isinstance(want, Tensor) != isinstance(have, Tensor):
            raise FunctionalizeError(f"functionalize: the chain gives {type(have).__name__} at {where}, "
                                     f"the module {type(want).__name__}")
        if isinstance(want, Tensor) and (want.shape != have.shape or want.dtype != have.dtype):
            raise FunctionalizeError(
                f"functionalize: the chain differs from the module at {where}: module gives "
                f"{want.dtype}{list(want.shape)}, chain gives {have.dtype}{list(have.shape)}"
            )
