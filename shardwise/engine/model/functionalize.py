"""functionalize: turn an ``nn.Module`` into a :class:`Chain` of pure layers and a params pytree.

How the module is cut into layers:

* ``units=None`` and an ``nn.Sequential``: one layer per child, named as the child
  (``"0"``, ``"1"``, ... or the ``OrderedDict`` keys); local names are the child's own
  (``"weight"``, ``"bias"``).
* ``units=None`` and any other module: one layer named ``"model"`` holding the
  whole module; local names are the module's qualified names.
* ``units=[paths]`` or ``units=SomeModuleClass``: the module is traced with torch.fx,
  the units kept as leaf calls, and the graph is cut into one segment per unit: the
  glue code before the unit plus the unit call (glue after the last unit joins the last
  segment). Each segment is an ``fx.GraphModule`` over the original module, so local
  names stay the original qualified names (``"blocks.0.ln1.weight"``, ``"pos_emb"``).
  A glue op runs in the segment of its first user, so a param read early in forward
  but used late does not have to cross a boundary. (Sinking glue past a unit reorders
  it relative to that unit; this changes no value, except that random glue ops, such
  as dropout in glue in training mode, would draw from the RNG in a different order.)
* units given, for a Hugging Face ``PreTrainedModel``, a module torch.fx cannot trace (given
  ``example_input``), or an ``example_input`` dict that forward takes as keyword arguments
  (nanoGPT's ``{"idx": ..., "targets": ...}``: fx would trace ``forward(idx)`` alone): the
  module is run once on an example input (``example_input``, or the model's own
  ``dummy_inputs`` ids) while hooks record every unit call, and cut into
  ``"embed"`` (forward up to the first unit: embeddings, mask, position ids, rotary
  embeddings), one layer per unit (named by its path, names relative to the root), and
  ``"head"`` (forward after the last unit: final norm, head, the model's own loss). Units in
  two stacks (``units=(BartEncoderLayer, BartDecoderLayer)``, or paths in both) get a
  ``"bridge"`` between them: the code from the encoder's last layer to the decoder's first
  (the encoder's final norm, the decoder's embedding and masks), whose output carries the
  decoder's hidden state and the encoder's output its layers receive. The
  value between layers is a tuple of tensors; its layout is fixed by the example, so pass
  an example like your batches (a dict batch if you train on dict batches). A unit may
  return a tuple whose elements after the hidden state nothing reads (Bloom's attention
  weights), or that the next units of its loop receive (T5's position bias: its layer
  writes it into the value between layers); one the code around the units reads is
  refused. See ``capture`` for how, and what is refused.

Layer inputs and outputs:

* A dict input whose keys are all arguments of ``forward`` (``input_ids``,
  ``attention_mask``, ``labels``), or some of them and the rest taken by its ``**kwargs``
  (transformers 5's ``shift_labels``, ``return_dict``), is passed as keywords
  (``module(**x)``); a ``forward`` that takes ``use_cache`` gets ``use_cache=False``.
* Outputs may be any pytree of tensors: tuples, lists, dicts, named tuples, and (registered
  with optree on first sight, see :mod:`shardwise.engine.model.pytrees`) ``ModelOutput`` and
  dataclasses, so a loss on ``out.logits`` gets a real ``ModelOutput`` and gradients flow.
  With an example input, an output carrying no floating-point tensor is refused.

Every layer fn calls the module's code with its tensors swapped in, as
``torch.func.functional_call`` does (``module_call.ModuleCall``: the same swap with the
name walk done once), so outputs are bitwise those of the module: same ops, same order,
equal values.
Who owns what: the returned parameters and the layers' buffers *are* the module's tensors,
detached (``requires_grad=False``; call ``requires_grad_()`` to use ``backward``): no data is
copied. The chain keeps only a skeleton of the module (its structure, every parameter and buffer
a meta tensor; ``module_call.skeleton``), so deleting the module and the returned params frees the
model's memory. A step never trains these tensors in place: ``Step.init`` copies (or cuts the
rank's shards of) them into its own state, so the module is left as it was. A module built on
the meta device gives meta parameters; ``Step.init`` then materializes each rank's own shards
from the module's initializers (see ``materialize``).

Decisions:

* Shared parameters are found by identity. The first layer that uses one owns it;
  later layers name it in ``Layer.ties``. Inside one layer a shared param appears once,
  under the name ``named_parameters()`` gives, and ``functional_call(tie_weights=True)``
  feeds it under every alias, so its gradient is the sum over all uses.
* Parameters with ``requires_grad=False`` are frozen: they travel as buffers (in
  ``Layer.buffers``, never updated, never in the params pytree), named in ``Layer.frozen``
  (a precision policy computes them as weights, not as buffers).
* Buffers are carried in ``Layer.buffers`` (the module's own, detached); a buffer shared by
  several layers is one tensor in each.
* A module that updates state in forward (BatchNorm in training mode with running
  stats) is refused: a pure layer cannot update it. One that normalises with its batch's
  statistics (``track_running_stats=False``) is pure, and accepted; a step that cuts the batch
  refuses it (``whole_batch.py``). So does one whose own forward calls ``F.embedding(...,
  scale_grad_by_freq=True)``: functionalize notes the call on the layer, seen while checking the chain on the
  example input; without one, a step that cuts the batch sees it at each layer's first call
  (``functional_frequencies.py``). No forward runs once more to find it.
* ``functional_call`` swaps tensors into the module for the duration of a call, which is
  not safe when threads (the threads backend runs ranks as threads) call one module at
  once. Each thread therefore runs its own replica of the module, a deep copy that
  shares the original's tensors (they are swapped out anyway).
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from ...collectives.backends.current import current_backend, on_rank_thread
from ...collectives.backends.thread_ranks import holding_turn
from ..torch_api import dense_where_refused, fake_run_errors
from . import host_random
from .aliased_tensors import refuse_aliased, refuse_param_hooks
from .batch_loss_terms import refuse_split_batch_loss
from .capture import Piece, split_by_calls
from .chain import Chain, Layer
from .changed_inputs import LeafIndices, changed_since, copies, versions, with_copies
from .functional_frequencies import keep, layer_paths, watching
from .fused_attention import without_fused_attention
from .fx_split import GLUE_READS, FunctionalizeError, FxTraceError, split_graph
from .given_params import remember as remember_given
from .glue_reads import refuse_changed
from .init_fn import InitFn, as_path_init
from .materialize import ModuleInit, has_meta_tensors, is_transformers_model, stand_in
from .module_call import Quiet, ThreadReplicas, call_arguments, module_fn
from .pytrees import float_leaves, plain_batch, register_output_types, unregistered_reason
from .root_hooks import refuse_root_hooks
from .shape_check import check_shapes_against_module, structure_differs
from .uncompiled import uncompiled
from .unit_stubs import checking_the_example

__all__ = ["FunctionalizeError", "functionalize"]

Units = str | Sequence[str] | type[nn.Module] | Sequence[type[nn.Module]] | None
ParamTree = dict[str, dict[str, Tensor]]

WHOLE_MODULE = "model"
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def functionalize(
    module: nn.Module,
    *,
    units: Units = None,
    example_input: Any = None,
    init_fn: InitFn | None = None,
    device: torch.device | str | None = None,
) -> tuple[Chain, ParamTree]:
    """Split ``module`` into a :class:`Chain` of pure layers and return it with its params.

    Args:
        module: the model. Never modified; the chain keeps no reference to its tensors. A
            ``torch.compile``'d model or block is split as its uncompiled code and its layers
            run eagerly (docs/guide.md, section 1).
        units: how to cut it (see the module docstring): ``None``; a list of submodule paths
            in execution order (a path naming a ModuleList / Sequential / ModuleDict
            stands for each of its children); or a module class, whose outermost
            instances become the units; or a tuple of classes (an encoder's layer and
            a decoder's: both stacks split per layer, a ``"bridge"`` layer between).
        example_input: if given, ``module(example_input)`` and the chain are run on it and
            must agree bitwise, no layer may modify its buffers, and every layer output must
            carry a floating-point tensor. A split that records calls (Hugging Face models,
            modules fx cannot trace) is recorded on it, and checked on it always. For a module
            built on the meta device both run on fake tensors from the first unit on:
            structure, shapes and dtypes agree, and identical blocks run once; a model that
            reads data to decide a shape (a mixture-of-experts' routing) runs on zero-cost
            stand-in parameters instead (one zero each, expanded; a kernel that refuses their
            stride of 0, such as ``torch._grouped_mm``, gets a dense copy for that op alone).
        init_fn: for a module built on the meta device: ``fn(module)``, or ``fn(module, path)``
            with the module's path in the model (``""`` for the model; given to an fn whose
            second argument has no default), that initializes a
            module's own parameters and buffers (as ``model.apply(fn)`` would apply it); by
            default a Hugging Face model's ``_init_weights``, else each module's
            ``reset_parameters()``. Constructor code outside these (nanoGPT's scaled ``c_proj``
            after ``self.apply(self._init_weights)``) is not replayed: ``init_fn`` must do it
            (docs/guide.md, "Models larger than one rank").
        device: for a module built on the meta device: where its buffers are made now and its
            parameters later, by ``Step.init`` (default: the CPU).

    Returns:
        ``(chain, params)`` with ``params[layer_name][local_name]`` holding owned params only;
        every layer has an entry, empty if it owns none.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> chain, params = functionalize(model, example_input=torch.randn(3, 4))
    >>> chain.names, sorted(params["0"])
    (('0', '1', '2'), ['bias', 'weight'])

    A Hugging Face model split per block (``pip install -e ".[hf]"``), e.g.
    ``functionalize(GPT2LMHeadModel(config), units=GPT2Block)``, gives the layers
    ``("embed", "transformer.h.0", ..., "head")``; an encoder-decoder wrapped to return its
    logits, with ``units=(BartEncoderLayer, BartDecoderLayer)``, ``("embed",
    "model.model.encoder.layers.0", ..., "bridge", "model.model.decoder.layers.0", ..., "head")``.
    """
    # It sets torch's, Python's and numpy's generators back after tracing and checking the model: on thread
    # ranks, which share them, the next rank's seeding and build wait for it (collectives/backends/thread_ranks).
    with holding_turn():
        return _functionalize(module, units, example_input, init_fn, device)


def _functionalize(
    module: nn.Module, units: Units, example_input: Any, init_fn: InitFn | None, device: torch.device | str | None
) -> tuple[Chain, ParamTree]:
    module = uncompiled(module)  # layers run eagerly: see engine/model/uncompiled.py
    _refuse_lazy(module)
    _refuse_stateful(module)
    refuse_aliased(module)
    refuse_param_hooks(module)
    if units is not None:
        refuse_split_batch_loss(module)
    if isinstance(module, nn.Sequential) if units is None else _resolve_units(module, units) is not None:
        refuse_root_hooks(module)  # (split: the model's own call never runs)
    init, target, origin = _meta_init(module, init_fn, device)
    example_input = plain_batch(example_input)  # a tokenizer's BatchEncoding: recorded as the dict the step sees
    # A meta-built module runs on stand-in parameters that are one zero each, expanded (no memory: the model
    # may not fit). A kernel that refuses their stride of 0 (torch._grouped_mm, HF MoE experts) runs again on
    # a dense copy made for that op alone: one layer's weights at most, never the whole model at once.
    with dense_where_refused() if init is not None else contextlib.nullcontext():
        try:
            chain, params, sources, example_input = _split_and_check(target, units, example_input, init is not None)
        except fake_run_errors():
            if init is None:
                raise
            # The model reads data to decide a shape (a mixture-of-experts' routing), or an op's fake kernel
            # refuses what its real one runs, which fake tensors cannot: record and check it on its stand-in
            # tensors instead (real, zero-cost parameters), where a genuine error is raised again.
            chain, params, sources, example_input = _split_and_check(target, units, example_input, False)
    if init is None:
        remember_given(chain, module)  # (a loss reading its parameters is refused: given_params.py)
        return chain, params
    # A meta-built module: the chain says how to make its parameters; they are returned meta.
    meta, paths = _meta_params(target, sources, origin)
    meta = {layer: meta.get(layer, {}) for layer in params}  # every layer has an entry
    return Chain(chain.layers, ModuleInit(module, paths, init.init_fn, init.device)), meta


def _split_and_check(
    target: nn.Module, units: Units, example_input: Any, on_fake: bool
) -> tuple[Chain, ParamTree, dict[tuple[str, str], Tensor], Any]:
    """The chain of ``target`` split at ``units``, its parameters, their source tensors and the input
    it was checked on; recorded and checked on fake tensors when ``on_fake`` (a meta-built module),
    else on real ones."""
    pieces, recorded = _pieces(target, units, example_input, meta_built=on_fake)
    chain, params, sources = _build_chain(pieces)
    if units is None and isinstance(target, nn.Sequential):
        for layer in chain:  # each layer calls a child: its modules' paths in the model start with its name
            layer.fn.root_prefix = layer.name  # type: ignore[attr-defined]
    if recorded is not None:
        example_input = recorded
    try:
        with checking_the_example():
            if example_input is not None and on_fake:
                check_shapes_against_module(
                    target, chain, params, example_input, _output_check(chain), _unit_modules(target, units)
                )
            elif example_input is not None:
                _check_against_module(target, chain, params, example_input)
    except Exception as err:
        for change in _dtype_changes(chain):
            err.add_note(f"functionalize: {change}")
        raise
    return chain, params, sources, example_input


def _dtype_changes(chain: Chain) -> list[str]:
    """What the stubs of a recorded split say of the units that return another dtype than they are given."""
    found: dict[str, None] = {}
    for layer in chain:
        module = getattr(getattr(module_fn(layer.fn), "replicas", None), "module", None)
        if isinstance(module, nn.Module):
            found.update((change, None) for sub in module.modules()
                         if isinstance(change := getattr(sub, "dtype_change", None), str))
    return list(found)


def _unit_modules(module: nn.Module, units: Units) -> list[nn.Module]:
    """The modules ``units`` names in ``module`` (none for the default split)."""
    paths = None if units is None else _resolve_units(module, units)
    return [] if paths is None else [module.get_submodule(p) for p in paths]


def _meta_init(
    module: nn.Module, init_fn: InitFn | None, device: torch.device | str | None
) -> tuple[ModuleInit | None, nn.Module, dict[int, Tensor]]:
    """For a meta-built module: how to make its tensors, the module to split (a stand-in that
    runs: zero-cost parameters, made buffers) and which of the module's tensors each stand-in
    tensor is. For any other module: (None, the module, {})."""
    if not has_meta_tensors(module):
        if init_fn is not None or device is not None:
            given = "init_fn" if init_fn is not None else "device"
            raise TypeError(
                f"functionalize({given}=...) is for a module built on the meta device, and "
                f"{type(module).__name__} holds its values already: drop {given}= (move a real "
                "model with module.to(device) first)."
            )
        return None, module, {}
    if init_fn is not None:
        as_path_init(init_fn)  # refuses, now, an init_fn that can be called neither way
    init = ModuleInit(module, {}, init_fn, torch.device(device if device is not None else "cpu"))
    # Buffers are the chain's own (layers carry them): made now, each from its module's initializer.
    # Frozen parameters (requires_grad=False), which the chain carries as buffers too, stay the
    # split's stand-ins (a frozen base is loaded, not made: init_from_pretrained fills them, a
    # checkpoint's load too); Step.init refuses one still unfilled (materialize.unfilled_frozen).
    buffers = {id(b): init.tensor(path, seed=0) for path, b in module.named_buffers() if b.is_meta}
    target, origin = stand_in(module, buffers, init.device)
    return init, target, origin


def _meta_params(
    module: nn.Module, sources: dict[tuple[str, str], Tensor], origin: dict[int, Tensor]
) -> tuple[ParamTree, dict[tuple[str, str], str]]:
    """The meta parameters of a meta-built module by (layer, local name), and the path of each
    in ``module`` (its first name, if tied), from the stand-in tensors the split was made of."""
    path_of = {id(t): path for path, t in module.named_parameters()}
    params: ParamTree = {}
    paths: dict[tuple[str, str], str] = {}
    for (layer, name), t in sources.items():
        params.setdefault(layer, {})[name] = origin[id(t)].detach()
        paths[(layer, name)] = path_of[id(t)]
    return params, paths


Piece_ = tuple[str, nn.Module | Piece]


def _pieces(module: nn.Module, units: Units, example: Any, meta_built: bool) -> tuple[list[Piece_], Any]:
    """(layer name, module or Piece to call) for each layer, and the input the split was
    recorded on (None when it was not recorded: the whole module, a Sequential, fx). A
    meta-built module's units are recorded on fake tensors (``recording.record_calls``)."""
    if units is None:
        if isinstance(module, nn.Sequential):
            # _modules, not named_children(): a child repeated at two indices is two layers (tied).
            return [(name, child) for name, child in module._modules.items() if child is not None], None
        return [(WHOLE_MODULE, module)], None
    paths = _resolve_units(module, units)
    if paths is None:  # the root itself is the unit class
        return [(WHOLE_MODULE, module)], None
    ordered = not isinstance(units, type) and not all(isinstance(u, type) for u in units)
    if not is_transformers_model(module) and not _spreads(module, example):
        try:
            return list(split_graph(module, paths, ordered=ordered)), None
        except FxTraceError as e:
            if example is None:
                raise FunctionalizeError(
                    f"{e} Pass example_input= (an input like your batches) and functionalize splits the "
                    "model by recording which units forward calls on it, with which arguments, instead; "
                    "or write the model as an nn.Sequential (functionalize(model) needs no tracing), or "
                    "build the Chain from explicit Layer objects."
                ) from e
    # Hugging Face models, modules fx cannot trace, and examples that are keyword arguments (fx traces
    # forward's first argument alone, the others fixed at their defaults): record the calls on the example.
    example = example if example is not None else _dummy_input(module)
    return list(split_by_calls(module, paths, example, ordered=ordered, fake_units=meta_built)), example


def _spreads(module: nn.Module, example: Any) -> bool:
    """Whether ``example`` is a dict the module is called with as keyword arguments (``module(**x)``:
    nanoGPT's ``{"idx": ..., "targets": ...}``), which an fx trace of ``forward(x)`` cannot take."""
    return isinstance(example, Mapping) and call_arguments(module, example)[0] == ()


def _dummy_input(module: nn.Module) -> Tensor:
    """A token batch for a Hugging Face model when no example is given: its own dummy ids."""
    dummy = getattr(module, "dummy_inputs", None)
    ids = dummy.get("input_ids") if isinstance(dummy, dict) else None
    takes = getattr(module, "main_input_name", "input_ids")
    if not isinstance(ids, Tensor) or takes != "input_ids":
        # (transformers' PreTrainedModel offers dummy input_ids to every model, a ViT's or Whisper's too, which
        # take pixel_values or input_features: the recording would fail inside the model, unpacking an image)
        offers = "no dummy input_ids" if not isinstance(ids, Tensor) else f"no dummy {takes}, its main input"
        raise FunctionalizeError(
            f"functionalize: {type(module).__name__} is split by recording its calls on an example input, "
            f"and it offers {offers}; pass example_input= (an input like your batches"
            + (f", e.g. {{'{takes}': ...}} of your batches' shape" if takes != "input_ids" else "") + ")."
        )
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return ids.to(device)


# --- refusing impure modules --------------------------------------------------------------


def _refuse_lazy(module: nn.Module) -> None:
    """Refuse a lazy module (``nn.LazyLinear``, ``nn.LazyConv2d``) whose parameters are not made yet: they take
    their shapes at the module's first call, which functionalize does not make for it."""
    for path, sub in module.named_modules():
        lazy = [n for n, p in sub.named_parameters(recurse=False) if nn.parameter.is_lazy(p)]
        lazy += [n for n, b in sub.named_buffers(recurse=False) if nn.parameter.is_lazy(b)]
        if lazy:
            where = repr(path) if path else "the module itself"
            raise FunctionalizeError(
                f"functionalize: {where} ({type(sub).__name__}) has parameters not made yet ({', '.join(lazy)}): a "
                "lazy module makes them, with their shapes, at its first call. Call the model once on an input like "
                "your batches (model(example)) before functionalize"
            )


def _refuse_stateful(module: nn.Module) -> None:
    for path, sub in module.named_modules():
        where = repr(path) if path else "the module itself"
        if isinstance(sub, _NormBase) and sub.training and sub.track_running_stats:
            raise FunctionalizeError(
                f"functionalize: {where} ({type(sub).__name__}) updates running_mean / running_var "
                "in forward because it is in training mode, and a pure layer cannot update state. "
                "Call module.eval() first (it then normalises with the running stats), or use "
                "GroupNorm / LayerNorm, or build it with track_running_stats=False: it then normalises with "
                "the statistics of the batch it is called on, which is the single-device step, but a step that "
                "cuts the batch (shard_params, accumulation, a pipeline's micro-batches, expert or context "
                "parallel) would normalise each part with its own, so such a step refuses it."
            )
        # Hugging Face's flag (``model.activation_checkpointing_enable()``, formerly
        # ``gradient_checkpointing_enable``): its torch.utils.checkpoint
        # runs the forward again in the backward, after the layer's call has returned, on the module's
        # own parameters, which a pure layer does not hold (a crash on meta tensors, or torch's
        # refusal of a checkpoint with inputs= in its reentrant form).
        if sub.training and getattr(sub, "gradient_checkpointing", False) is True:
            raise FunctionalizeError(
                f"functionalize: {where} ({type(sub).__name__}) has activation checkpointing on "
                "(model.activation_checkpointing_enable(), formerly gradient_checkpointing_enable()): "
                "torch.utils.checkpoint would run its forward again in the backward, outside the layer's "
                "call, on parameters a pure layer does not hold. Call model.activation_checkpointing_disable() "
                "and recompute with shardwise instead: sw.remat(step) (its Plan counts what the "
                "recomputation saves)."
            )
        # transformers' Reformer: its reversible residual layers (an autograd Function) run the layers' forward
        # again in the backward, on the modules' own parameters, as activation checkpointing does (a crash on
        # the chain's meta skeleton: "Tensor on device meta is not on the expected device").
        if sub.training and type(sub).__name__ == "ReformerEncoder" and type(sub).__module__.startswith(
                "transformers."):
            raise FunctionalizeError(
                f"functionalize: {where} ({type(sub).__name__}) computes its layers as reversible residual layers, "
                "whose backward runs their forward again outside the layer's call, on parameters a pure layer "
                "does not hold; shardwise cannot train it (in training mode). Use a model of plain residual layers, "
                "and recompute with sw.remat(step) where memory is short"
            )


# --- building the chain -------------------------------------------------------------------


class _ModuleFn:
    """A layer fn: ``functional_call`` of a module on the layer input (see ``call_arguments``),
    on a per-thread replica of it; its output's ModelOutput / dataclass types become pytrees."""

    def __init__(self, module: nn.Module) -> None:
        # The globals an fx segment's traced code read (fx_split, glue_reads.py): refused once changed.
        self.traced_from, self.glue_reads = module.__dict__.pop(GLUE_READS, ("", ()))
        self.replicas = ThreadReplicas(module)
        self.changed: LeafIndices = ()  # the input's tensors the module changes in place (_change_copies)
        self.root_prefix = ""  # the module's path in the model functionalize was given
        # The buffers the module does not persist (register_buffer(..., persistent=False)), which its
        # state_dict leaves out, read here: a copy of a GraphModule (the skeleton, each thread's replica,
        # a pickle) registers every buffer it holds as a persistent one again.
        persisted = set(module.state_dict(keep_vars=True))
        self.transient = frozenset(n for n, _ in module.named_buffers(remove_duplicate=False) if n not in persisted)

    @property
    def module(self) -> nn.Module:
        return self.replicas.module

    def __call__(self, tensors: dict[str, Tensor], x: Any) -> Any:
        # strict: every param and buffer must be given, so the module's own tensors never leak in.
        if self.glue_reads:
            refuse_changed(self.glue_reads, f"a layer of {self.traced_from}")
        call = self.replicas.get()
        x, _ = with_copies(x, self.changed)
        if isinstance(x, Tensor) and not call.takes_use_cache:  # the usual layer input: module(x)
            return register_output_types(call.call(tensors, (x,), {}))
        args, kwargs = call_arguments(call.module, x)
        return register_output_types(call.call(tensors, args, kwargs))

    def quiet(self, tensors: dict[str, Tensor]) -> Quiet | None:
        """This thread's :meth:`ModuleCall.quiet` on ``tensors``: what ``self(tensors, x)`` runs on a
        tensor ``x`` as one call that draws no random numbers, or None."""
        call = self.replicas.get()
        return None if call.takes_use_cache else call.quiet(tensors)

    def __repr__(self) -> str:
        return f"functional_call({type(self.module).__name__})"


def _build_chain(pieces: list[Piece_]) -> tuple[Chain, ParamTree, dict[tuple[str, str], Tensor]]:
    """The chain, its params (the pieces' tensors detached) and, by (layer, local name), the
    tensor each owned param was detached from."""
    owners: dict[int, tuple[str, str]] = {}  # id(param) -> (owner layer, owner's local name)
    detached: dict[int, Tensor] = {}  # id(tensor) -> the tensor detached, once

    def copy_of(t: Tensor) -> Tensor:
        # The module's own tensor (detached: no copy of the data, and no autograd history).
        if id(t) not in detached:
            detached[id(t)] = t.detach()
        return detached[id(t)]

    layers, params = [], {}
    sources: dict[tuple[str, str], Tensor] = {}
    for name, mod in pieces:
        param_names: list[str] = []
        owned: dict[str, Tensor] = {}
        ties: dict[str, tuple[str, str]] = {}
        buffers = {local: copy_of(b) for local, b in mod.named_buffers()}
        frozen: set[str] = set()
        for local, p in mod.named_parameters():  # remove_duplicate: one entry per tensor
            if not p.requires_grad:
                buffers[local] = copy_of(p)  # frozen: carried, never trained
                frozen.add(local)
                continue
            param_names.append(local)
            if id(p) in owners:
                ties[local] = owners[id(p)]
            else:
                owners[id(p)] = (name, local)
                owned[local] = copy_of(p)
                sources[(name, local)] = p
        fn = mod.fn if isinstance(mod, Piece) else _ModuleFn(mod)
        layers.append(Layer(name, fn, tuple(param_names), buffers, ties, frozenset(frozen)))
        params[name] = owned
    return Chain(layers), params, sources


# --- resolving units ----------------------------------------------------------------------


def _resolve_units(
    module: nn.Module, units: str | Sequence[str] | type[nn.Module] | Sequence[type[nn.Module]]
) -> list[str] | None:
    """Unit paths, containers expanded; None if the root module is itself the unit class."""
    if isinstance(units, type):
        return _units_of_class(module, (units,))
    given: list[Any] = [units] if isinstance(units, str) else list(units)
    if not given:
        raise FunctionalizeError("functionalize: units is empty; pass None for the default split")
    if all(isinstance(u, type) for u in given):  # an encoder's layer class and its decoder's
        return _units_of_class(module, tuple(given))
    paths: list[str] = []
    for path in given:
        paths.extend(_expand_unit(module, path))
    _refuse_overlaps(paths)
    return paths


def _units_of_class(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[str] | None:
    """The paths of the outermost instances of ``classes`` (several: an encoder's layers and a decoder's)."""
    if len(classes) == 1 and isinstance(module, classes[0]):
        return None
    given = classes[0].__name__ if len(classes) == 1 else f"({', '.join(c.__name__ for c in classes)})"
    if isinstance(module, classes):
        raise FunctionalizeError(
            f"functionalize: units={given} but {type(module).__name__} is itself a {type(module).__name__}, "
            "so every unit would be inside another; pass its class alone for one layer, or units=None"
        )
    found: list[str] = []
    kinds: dict[type[nn.Module], int] = dict.fromkeys(classes, 0)
    for path, sub in module.named_modules():
        inside = any(path.startswith(f + ".") for f in found)
        if isinstance(sub, classes) and not inside:
            found.append(path)
            for cls in classes:
                kinds[cls] += isinstance(sub, cls)
    missing = [cls.__name__ for cls, count in kinds.items() if not count]
    if missing:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise FunctionalizeError(
            f"functionalize: units={given} but {type(module).__name__} contains no {missing[0]} outside the "
            f"other units; module classes present: {present}"
        )
    return found


def _expand_unit(module: nn.Module, path: str) -> list[str]:
    if isinstance(path, type):
        raise FunctionalizeError(
            f"functionalize: units=[...] mixes submodule paths and the class {path.__name__}; pass classes "
            f"alone (units={path.__name__}, or units=({path.__name__}, OtherLayer) for an encoder's layers and a "
            "decoder's), or the paths of the submodules to make units"
        )
    if not isinstance(path, str) or not path:
        raise FunctionalizeError(
            f"functionalize: unit {path!r} is not a submodule path; for the whole module as one layer pass units=None"
        )
    try:
        sub = module.get_submodule(path)
    except AttributeError:
        known = [p for p, _ in module.named_modules() if p]
        close = difflib.get_close_matches(path, known, n=3)
        hint = (
            f"; did you mean {close}?"
            if close
            else f"; top-level children: {[n for n, _ in module.named_children()]}"
        )
        raise FunctionalizeError(
            f"functionalize: unknown unit {path!r}: {type(module).__name__} has no such submodule{hint}"
        ) from None
    if isinstance(sub, _CONTAINERS):
        children = list(sub._modules)
        if not children:
            raise FunctionalizeError(
                f"functionalize: unit {path!r} is an empty {type(sub).__name__}"
            )
        return [f"{path}.{child}" for child in children]
    return [path]


def _refuse_overlaps(paths: list[str]) -> None:
    for i, a in enumerate(paths):
        for b in paths[i + 1 :]:
            if a == b:
                raise FunctionalizeError(f"functionalize: unit {a!r} is listed twice")
            if b.startswith(a + ".") or a.startswith(b + "."):
                outer, inner = (a, b) if b.startswith(a + ".") else (b, a)
                raise FunctionalizeError(
                    f"functionalize: units {outer!r} and {inner!r} overlap ({inner!r} is inside {outer!r}); "
                    "a unit is one layer, so keep only one of them"
                )


# --- tracing and splitting ----------------------------------------------------------------


def _check_against_module(module: nn.Module, chain: Chain, params: ParamTree, x: Any) -> None:
    """Run module and chain on ``x`` from the same random state (torch's generators, Python's
    ``random`` and numpy's: ``host_random``), which they are left in after; refuse any bitwise
    difference."""
    snapshot = {(layer.name, n): b.clone() for layer in chain for n, b in layer.buffers.items()}
    devices = sorted(
        {t.device.index or 0 for t in optree.tree_leaves(x) if isinstance(t, Tensor) and t.is_cuda}
    )
    with torch.no_grad(), torch.random.fork_rng(devices=devices), host_random.kept(), without_fused_attention():
        rng, host = _rng_states(devices), host_random.capture()
        # On a copy of the example's tensors: forward may change one in place (Whisper's SpecAugment masks
        # input_features), and the chain must start from the same input.
        given = copies(x)
        unchanged = versions(given)
        args, kwargs = call_arguments(module, given)
        expected = register_output_types(module(*args, **kwargs))
        drew = not torch.equal(torch.get_rng_state(), rng[0])  # (dropout in training mode)
        _change_copies(chain, changed_since(given, unchanged))
        _set_rng_states(devices, rng)
        host_random.restore(host)
        got = x
        check_output = _output_check(chain)
        # The module's parameters require grad; so must the chain's here: under no_grad torch still
        # reads requires_grad to pick a kernel (matmul folds a 3-D input into one 2-D product only for a
        # weight that does not), and the two would round differently where the step itself does not.
        trained = {layer: {name: t.detach().requires_grad_(t.is_floating_point() or t.is_complex())
                          for name, t in held.items()} for layer, held in params.items()}
        for i, layer in enumerate(chain):
            # Which of its modules call an embedding op with scale_grad_by_freq=True (functional_frequencies.py).
            with watching(layer_paths(layer), layer.name) as found:
                got = layer(chain.layer_params(trained, layer), got)
            keep(layer, found)
            check_output(layer.name, got, i == len(chain) - 1)
    for (name, buffer_name), before in snapshot.items():
        if not _same(before, chain[name].buffers[buffer_name]):
            raise FunctionalizeError(
                f"functionalize: layer {name!r} modified its buffer {buffer_name!r} in forward; a pure "
                "layer cannot carry state. Put the module in eval mode or drop the in-place update."
            )
    try:
        _compare_outputs(expected, got)
    except FunctionalizeError as err:
        if not (drew and on_rank_thread() and current_backend().world_size > 1):
            raise
        raise FunctionalizeError(
            f"{str(err).rstrip('.')}; or, on thread ranks, which share torch's generator: another rank drew from it "
            "meanwhile (built its model after its turn to run alone ran out), and the module and the chain drew "
            "different dropout masks here. If so: build the model before launch, or give launch a longer timeout (a "
            "rank's turn is min(5 s, timeout / (4 * world)))"
        ) from None


def _change_copies(chain: Chain, changed: LeafIndices) -> None:
    """A first layer that calls a module on the layer input (``units=None``), which changes the input's
    ``changed`` tensors in place, changes copies of them: remat's recomputation replays it on the input
    as it was (on the changed one, torch's checkpoint failed with autograd's raw in-place error), and the
    caller's batch is left as it was. (The call-recording split notes them as it records.)"""
    first = chain[0].fn
    if changed and isinstance(first, _ModuleFn):
        first.changed = changed


def _rng_states(devices: list[int]) -> tuple[Tensor, list[Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_states(devices: list[int], states: tuple[Tensor, list[Tensor]]) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip(devices, states[1], strict=True):
        torch.cuda.set_rng_state(state, d)


def _output_check(chain: Chain) -> Callable[[str, Any, bool], None]:
    """``_check_passable`` for the layers of ``chain``, called as ``check(layer name, output, last)``.

    The first layer, when it has no parameters and is not the last, may pass on no floating-point
    tensor: it is fed only by the batch, and no gradient needs to reach the batch. This is the empty
    glue before the first unit where the units start at the embedding (``units=["wte", "h", "lm_head"]``
    on a dict example: the glue passes the batch's token ids on to the embedding)."""
    fed_by_batch = chain[0].name if len(chain) > 1 and not chain[0].param_names else None

    def check(layer: str, y: Any, last: bool) -> None:
        _check_passable(layer, y, last, needs_float=layer != fed_by_batch)

    return check


def _check_passable(layer: str, y: Any, last: bool, needs_float: bool = True) -> None:
    """Refuse an output with no floating-point tensor (the loss could reach no parameter through
    it) where ``needs_float``, and, between layers, an output with anything but tensors in it (a
    pipeline sends tensors)."""
    leaves = optree.tree_leaves(y)
    if needs_float and not float_leaves(y):
        opaque = [type(v).__name__ for v in leaves if not isinstance(v, Tensor)]
        reasons = [r for r in (unregistered_reason(v) for v in leaves) if r]
        why = f" ({'; '.join(reasons)})" if reasons else ""
        raise FunctionalizeError(
            f"functionalize: layer {layer!r} returns {_kind(y)} that carries no floating-point tensor"
            + (f"; optree sees it as opaque leaves {opaque}{why}" if opaque else "")
            + ". Gradients flow only through floating tensors in tuples, lists, dicts, named tuples, "
            "dataclasses or ModelOutputs: return the tensors (e.g. the logits), or register the output "
            "class with optree.register_pytree_node."
        )
    if not last:
        others = sorted({type(v).__name__ for v in leaves if not isinstance(v, Tensor)})
        if others:
            raise FunctionalizeError(
                f"functionalize: layer {layer!r} passes {_kind(y)} holding {others} to the next layer, but the "
                "value passed between layers must hold only tensors (it is what a pipeline stage sends)."
            )


def _kind(y: Any) -> str:
    return f"a {type(y).__name__}"


def _same(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    equal = a == b
    if a.is_floating_point() or a.is_complex():
        equal |= a.isnan() & b.isnan()
    return bool(equal.all())


def _compare_outputs(expected: Any, got: Any) -> None:
    paths, leaves, spec = optree.tree_flatten_with_path(expected, none_is_leaf=True)
    got_leaves, got_spec = optree.tree_flatten(got, none_is_leaf=True)
    if spec != got_spec:
        raise FunctionalizeError(structure_differs(expected, got, spec, got_spec))
    for path, want, have in zip(paths, leaves, got_leaves, strict=True):
        where = "output" + "".join(f"[{k!r}]" for k in path)
        if isinstance(want, Tensor) and isinstance(have, Tensor):
            if not _same(want, have):
                raise FunctionalizeError(
                    f"functionalize: the chain differs from the module at {where}: {_difference(want, have)}"
                )
        elif not _same_leaf(want, have):
            raise FunctionalizeError(
                f"functionalize: the chain differs from the module at {where}: {have!r} != {want!r}"
            )


def _same_leaf(want: Any, have: Any) -> bool:
    """Equal plain values; other objects (a cache, say) only of the same type: their ``==`` may be
    elementwise or identity, neither of which says the chain computed the same."""
    if isinstance(want, (bool, int, float, str, type(None))):
        return type(want) is type(have) and want == have
    return type(want) is type(have)


def _difference(want: Tensor, have: Tensor) -> str:
    if want.shape != have.shape or want.dtype != have.dtype:
        return f"module gives {want.dtype}{list(want.shape)}, chain gives {have.dtype}{list(have.shape)}"
    diff = (want.double() - have.double()).abs().nan_to_num(nan=float("inf"))
    flat = int(diff.argmax())
    index = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), want.shape))
        if want.dim()
        else ()
    )
    return (
        f"largest difference {diff.max().item():.6g} at index {list(index)} "
        f"(module {want[index].item()!r}, chain {have[index].item()!r}). "
        "The split changed the computation: check code between units that depends on call order "
        "or module attributes (hooks, random ops in glue)."
    )
