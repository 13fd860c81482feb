"""Chain: a model as an immutable sequence of pure layers.

The Chain is the unit of structure of the engine: a layer is where parameters are
gathered and freed (FSDP), what a pipeline stage holds and what remat recomputes.
A :class:`Layer` is plain data plus a pure function ``fn(tensors, x) -> y``; it
holds no trainable state. Parameters live outside, in a pytree

    params: dict[layer_name, dict[local_param_name, Tensor]]

holding only *owned* params. A param shared by two layers (tied embedding and
output head) appears once, at the first layer that uses it; later layers name it in
``Layer.ties``. :meth:`Chain.layer_params` rebuilds one layer's full local dict.

Hand-written layers are ordinary::

    w = {"lin": {"weight": torch.randn(8, 4)}, "act": {}}
    chain = Chain([
        Layer("lin", lambda t, x: x @ t["weight"].T, param_names=("weight",)),
        Layer("act", lambda t, x: torch.tanh(x)),
    ])
    y = chain(w, torch.randn(2, 4))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from torch import Tensor
from torch.nn.parameter import is_lazy

from .module_call import module_fn
from .pytrees import plain_batch

LayerFn = Callable[[dict[str, Tensor], Any], Any]
Params = Mapping[str, Mapping[str, Tensor]]


# eq=False: tensors have no truth value, so identity is the only sound equality (and hash).
@dataclass(frozen=True, eq=False)
class Layer:
    """One pure step of a Chain: ``y = fn({**params, **buffers}, x)``.

    Attributes:
        name: unique within the chain, e.g. ``"0"``, ``"embed"``, ``"blocks.3"``.
        fn: pure function of the layer's tensors (params and buffers by local name) and its input.
        param_names: local names of the trainable tensors ``fn`` expects, owned and tied.
        buffers: non-trainable tensors carried with the layer and never updated.
        ties: local param name -> ``(owner layer name, owner's local name)`` for params owned by
            an earlier layer of the chain.
        frozen: the names in ``buffers`` that are the module's frozen parameters
            (``requires_grad=False``): weights it does not train, not state, so a precision
            policy computes them as it does parameters.
    """

    name: str
    fn: LayerFn
    param_names: tuple[str, ...] = ()
    buffers: Mapping[str, Tensor] = field(default_factory=dict)
    ties: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # Defensive copies, so mutating the caller's containers cannot change a frozen Layer.
        object.__setattr__(self, "param_names", tuple(self.param_names))
        object.__setattr__(self, "buffers", dict(self.buffers))
        object.__setattr__(self, "ties", {k: (str(v[0]), str(v[1])) for k, v in self.ties.items()})
        object.__setattr__(self, "frozen", frozenset(self.frozen))
        _check_layer(self)

    def __call__(self, params: Mapping[str, Tensor], x: Any) -> Any:
        """Run ``fn`` on ``params`` (this layer's full local dict, tied ones included) and buffers."""
        return self.fn({**params, **self.buffers}, x)

    def bind(self, params: Mapping[str, Tensor]) -> Callable[[Any], Any]:
        """``lambda x: self(params, x)``, with params and buffers merged once: for running the
        layer on many inputs (micro-batches) with the same tensors."""
        tensors, fn = {**params, **self.buffers}, self.fn
        return lambda x: fn(tensors, x)

    def bind_quiet(self, params: Mapping[str, Tensor]) -> Any:
        """The layer on ``params`` as ``(module, tensors, fn)``, run as ``fn(module, tensors, x)`` on a
        tensor ``x`` while ``module_call.calls_forward_alone(module)`` holds, when its ``fn`` says it is
        one call of a forward that draws no random numbers (a functionalized ``nn.Linear``, say:
        module_call.DRAWS_NOTHING); None for any other layer. Asked of the fn's class, so a wrapper
        that forwards attribute reads to the fn it wraps never answers for it."""
        quiet = getattr(type(self.fn), "quiet", None)
        return None if quiet is None or self.buffers else quiet(self.fn, {**params})

    @property
    def owned_param_names(self) -> tuple[str, ...]:
        """``param_names`` minus the tied ones: what ``params[self.name]`` holds."""
        return tuple(n for n in self.param_names if n not in self.ties)

    def __repr__(self) -> str:
        return f"Layer({self.name!r}, {_describe_layer(self)})"


def _check_layer(layer: Layer) -> None:
    where = f"Layer {layer.name!r}"
    if not isinstance(layer.name, str) or not layer.name:
        raise ValueError(f"a Layer needs a non-empty string name, got {layer.name!r}")
    if not callable(layer.fn):
        raise TypeError(
            f"{where}: fn must be callable as fn(tensors, x), got {type(layer.fn).__name__}"
        )
    duplicates = sorted({n for n in layer.param_names if layer.param_names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{where}: param_names lists {duplicates} more than once")
    clash = sorted(set(layer.param_names) & set(layer.buffers))
    if clash:
        raise ValueError(
            f"{where}: {clash} are both params and buffers; a tensor is one or the other"
        )
    loose = sorted(layer.frozen - set(layer.buffers))
    if loose:
        raise ValueError(f"{where}: frozen names {loose} that are not in buffers; a frozen parameter travels as one")
    stray = sorted(set(layer.ties) - set(layer.param_names))
    if stray:
        raise ValueError(
            f"{where}: ties {stray} are not in param_names {list(layer.param_names)}; "
            "a tied param is still one of the layer's params, add it to param_names"
        )


class Chain:
    """An immutable sequence of :class:`Layer` run one after another: ``chain(params, x)``."""

    def __init__(self, layers: Sequence[Layer], init: Any = None) -> None:
        # init: how the meta parameters of a meta-built module are made (materialize.ModuleInit);
        # None when every parameter comes with its values.
        self.init = init
        self._layers = tuple(layers)
        for i, layer in enumerate(self._layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Chain layer {i} is a {type(layer).__name__}, not a Layer")
        self._index = _index_names(self._layers)
        for layer in self._layers:
            self._check_ties(layer)

    def _check_ties(self, layer: Layer) -> None:
        here = self._index[layer.name]
        for local, (owner, owner_local) in layer.ties.items():
            where = f"Layer {layer.name!r} ties {local!r} to ({owner!r}, {owner_local!r})"
            if owner not in self._index:
                raise ValueError(
                    f"{where}, but the chain has no layer {owner!r}; layers: {list(self._index)}"
                )
            if self._index[owner] >= here:
                raise ValueError(
                    f"{where}, but {owner!r} does not come earlier; a tied param is owned by its first user"
                )
            owner_layer = self._layers[self._index[owner]]
            if owner_local not in owner_layer.owned_param_names:
                raise ValueError(
                    f"{where}, but {owner!r} does not own {owner_local!r} "
                    f"(it owns {list(owner_layer.owned_param_names)}); tie to the owner itself, not to another tie"
                )

    @property
    def layers(self) -> tuple[Layer, ...]:
        return self._layers

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._layers)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    @overload
    def __getitem__(self, key: int) -> Layer: ...
    @overload
    def __getitem__(self, key: str) -> Layer: ...
    def __getitem__(self, key: int | str) -> Layer:
        if isinstance(key, str):
            if key not in self._index:
                raise KeyError(f"the chain has no layer {key!r}; layers: {list(self._index)}")
            return self._layers[self._index[key]]
        if isinstance(key, int):
            return self._layers[key]
        raise TypeError(
            f"index a Chain by position (int) or layer name (str), not {type(key).__name__}"
        )

    def index(self, layer: str | int | Layer) -> int:
        """Position of a layer given by name, position or the Layer itself."""
        if isinstance(layer, Layer):
            layer = layer.name
        if isinstance(layer, int):
            return range(len(self._layers))[layer]  # normalises negatives, raises IndexError
        return self._index[self[layer].name]

    def _layer(self, layer: str | int | Layer) -> Layer:
        return layer if isinstance(layer, Layer) else self[layer]

    def owned_param_names(self, layer: str | int | Layer) -> tuple[str, ...]:
        """The local names ``params[layer.name]`` holds: ``param_names`` minus ties."""
        return self._layer(layer).owned_param_names

    def layer_params(self, params: Params, layer: str | int | Layer) -> dict[str, Tensor]:
        """The full local param dict of one layer: owned params plus tied ones read at their owner.

        Entries of ``params[layer]`` that the layer does not declare are ignored.
        """
        lay = self._layer(layer)
        owned = params.get(lay.name, {})
        local: dict[str, Tensor] = {}
        for name in lay.param_names:
            owner, owner_local = lay.ties.get(name, (lay.name, name))
            source = owned if owner == lay.name else params.get(owner, {})
            try:  # the executor calls this every step: what is wrong is told on the failure path only
                missing = owner_local not in source
            except RuntimeError:  # a Tensor (a flat shard of ZeRO-3's state.params) takes no str
                missing = True
            if missing:
                raise _missing_param(source, lay.name, name, owner, owner_local)
            local[name] = source[owner_local]
        return local

    def __call__(self, params: Params, x: Any) -> Any:
        """Run every layer in order on ``x`` (a tokenizer's ``BatchEncoding`` as the dict it holds, as a
        step takes it: ``plain_batch``)."""
        x = plain_batch(x)
        for layer in self._layers:
            local = self.layer_params(params, layer)
            _refuse_other_shapes(layer, local)
            x = layer(local, x)
        return x

    def summary(self, params: Params | None = None) -> str:
        """One line per layer: params (with shapes and counts when ``params`` is given), ties, buffers."""
        lines = [f"Chain of {len(self)} layers"]
        total = 0
        for layer in self._layers:
            shapes = {}
            if params is not None:
                for n, t in params.get(layer.name, {}).items():
                    shapes[n] = tuple(t.shape)
                    total += t.numel()
            lines.append(f"  {layer.name}: {_describe_layer(layer, shapes)}")
        if params is not None:
            lines.append(f"  total owned params: {total:,}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        body = "".join(f"\n  {layer.name}: {_describe_layer(layer)}" for layer in self._layers)
        return f"Chain({body}\n)" if body else "Chain()"


# What a step's state holds where a layer's parameters are not a dict of whole tensors by name.
_NOT_WHOLE = (
    "the state.params of a step that shards or pipelines its parameters hold only this rank's part (shard_params "
    "stage 3, and stages 1-2 under bf16 / fp16 compute: one flat shard per layer; a pipeline: the layers of this "
    "rank's stage; tensor_parallel: this rank's slices of the layers it splits; expert_parallel: this rank's "
    "experts); to run the chain on them, e.g. to "
    "evaluate, pass step.full_params(state), the complete parameters (every rank calls it together)"
)


def _refuse_other_shapes(layer: Layer, local: Mapping[str, Tensor]) -> None:
    """Refuse a parameter of another shape than the one its layer's module registered (a tensor-parallel rank's
    slice: the chain would run the whole module on it, silently, and a Linear's slices return a partial sum)."""
    fn = module_fn(layer.fn)
    if fn is None:  # a layer of a plain function: no module to hold it to
        return
    replicas = fn.replicas
    for name, p in replicas.module.named_parameters(remove_duplicate=False):
        key = replicas.prefix + name
        given = local.get(key)
        if given is None or not isinstance(given, Tensor) or is_lazy(p) or given.shape == p.shape:
            continue
        raise ValueError(
            f"layer {layer.name!r}'s parameter {key!r} has shape {tuple(given.shape)}, where its module's "
            f"{type(replicas.module).__name__} has {tuple(p.shape)}: {_NOT_WHOLE}"
        )


def _missing_param(source: Any, layer: str, name: str, owner: str, owner_local: str) -> Exception:
    """The error for ``params[owner][owner_local]`` missing, which layer ``layer`` reads as ``name``."""
    if not isinstance(source, Mapping):
        return TypeError(
            f"params[{owner!r}] is a {type(source).__name__}"
            + (f" of shape {tuple(source.shape)}" if isinstance(source, Tensor) else "")
            + f", not a dict of parameters by name (layer {layer!r} reads {owner_local!r} there): {_NOT_WHOLE}"
        )
    tied = "" if owner == layer else f" (tied to {owner!r}'s {owner_local!r})"
    hint = f"; {_NOT_WHOLE}" if not source else ""
    return KeyError(
        f"params[{owner!r}] has no {owner_local!r}, which layer {layer!r} needs as "
        f"{name!r}{tied}; params[{owner!r}] holds {sorted(source)}{hint}"
    )


def _index_names(layers: tuple[Layer, ...]) -> dict[str, int]:
    index: dict[str, int] = {}
    for i, layer in enumerate(layers):
        if layer.name in index:
            raise ValueError(
                f"Chain layers {index[layer.name]} and {i} are both named {layer.name!r}; names must be unique"
            )
        index[layer.name] = i
    return index


def _describe_layer(layer: Layer, shapes: Mapping[str, tuple[int, ...]] | None = None) -> str:
    shapes = shapes or {}
    parts = []
    owned = [f"{n}{list(shapes[n]) if n in shapes else ''}" for n in layer.owned_param_names]
    if owned:
        parts.append("params " + ", ".join(owned))
    if layer.ties:
        parts.append(
            "tied "
            + ", ".join(f"{n} -> params[{o!r}][{ol!r}]" for n, (o, ol) in layer.ties.items())
        )
    if layer.buffers:
        parts.append(
            "buffers " + ", ".join(f"{n}{list(t.shape)}" for n, t in layer.buffers.items())
        )
    return "; ".join(parts) or "no params"
