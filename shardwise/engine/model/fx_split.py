"""Cutting a traced forward into one segment per unit (the fx half of ``functionalize``).

The module is symbolically traced with the units as leaves; each segment is
the glue code before a unit plus the unit call (glue after the last unit joins
the last segment), and becomes a GraphModule over the original module, so
parameter names stay the original qualified names. Exactly one value may
cross each boundary.
"""

from __future__ import annotations

import copy
import inspect
import threading
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from . import host_random
from .fx_stack_traces import stack_trace
from .glue_reads import (
    GlueRead,
    attribute_values,
    drawn_refusal,
    model_files,
    put_back,
    recording_reads,
    written_refusal,
)


class FunctionalizeError(ValueError):
    """A module that ``functionalize`` cannot turn into a Chain as asked; the message says why and what to do."""


class FxTraceError(FunctionalizeError):
    """torch.fx could not trace the module's forward (``functionalize`` may then record its calls instead)."""


class _UnitTracer(fx.Tracer):
    """Traces through everything except the units, which stay as single call_module nodes."""

    def __init__(self, units: list[str]) -> None:
        super().__init__()
        self.units = set(units)
        # torch.fx's own would import torch._dynamo and more; create_node records the same (fx_stack_traces)
        self.record_stack_traces = False
        # Buffers read in traced code become graph reads, so `self.mask[:t, :t]` with a traced
        # t works and the buffer travels with the segment that reads it.
        self.proxy_buffer_attributes = True
        self._thread: int | None = None  # the thread tracing (see trace)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.units or super().is_leaf_module(m, module_qualified_name)

    # torch.fx patches nn.Module.__call__ and __getattr__ for the whole process while it traces: a module
    # called on another thread meanwhile (a thread rank recording its own model's calls, or stepping) went
    # through this tracer, and failed with fx's "module is not installed as a submodule", or read a parameter
    # of a model the ranks share as a proxy of this graph. Only the tracing thread's calls are traced.
    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self._thread = threading.get_ident()
        return super().trace(root, concrete_args)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not node.stack_trace:  # lets errors point at the line of forward
            node.stack_trace = stack_trace()
        return node


def concrete_none(value: object, msg: str) -> None:
    """torch.fx's check that an argument traced as ``None`` (a ``concrete_args`` default) is ``None`` at run time,
    under a name of this module: fx's own (``torch.fx._symbolic_trace._assert_is_none``) is written into the
    segment's code by its dotted name, and registered by that name for tracing again, which the re-trace that
    unpickles a GraphModule cannot look up (a KeyError that also breaks every later trace in that process): a
    segment holding it could not be sent to a process rank (torchtitan's ``forward(tokens, input_batch=None)``)."""
    assert value is None, msg


def _own_none_checks(graph: fx.Graph) -> None:
    """Point fx's None checks at :func:`concrete_none` (the same check, a name that pickles)."""
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none" and \
                getattr(node.target, "__module__", "") == "torch.fx._symbolic_trace":
            node.target = concrete_none
            # traced again as a call (the code registers it with torch.fx.wrap), where fx's own is wrapped
            node.meta["is_wrapped"] = True


# torch.fx patches nn.Module.__call__ and __getattr__ process-wide while it traces, so two
# ranks of the threads backend tracing at once would see each other's patches.
_TRACE_LOCK = threading.Lock()


def _trace(module: nn.Module, units: list[str]) -> tuple[fx.Graph, dict[str, Any], tuple[GlueRead, ...]]:
    """The graph of ``module.forward`` with units as leaves, the constants tracing created, and the
    module globals the traced code read (``glue_reads``: checked at each call of its segments)."""
    before = set(vars(module))
    attributes, drawn, torch_state = attribute_values(module), host_random.capture(), torch.random.get_rng_state()
    try:
        with _TRACE_LOCK, recording_reads(model_files(module)) as reads:
            graph = _UnitTracer(units).trace(module, concrete_args=_concrete_args(module))
        _own_none_checks(graph)
    except FunctionalizeError:
        raise
    except Exception as e:
        raise FxTraceError(
            f"functionalize: torch.fx cannot trace {type(module).__name__}.forward with units {units} "
            f"({type(e).__name__}: {_first_line(e)}).{_likely_cause(module, e)}"
        ) from e
    finally:
        # The tracer parks tensor constants made in forward on the root (_tensor_constant0, ...);
        # take them back off so the user's module is left as it was.
        constants = {k: module.__dict__.pop(k) for k in set(vars(module)) - before}
        # What ran once here, but runs at every call of a torch loop, is put back, then refused (glue_reads.py).
        # (torch's generator too: a draw fx does not trace, fairseq's LayerDropModuleList's in its __iter__)
        written = put_back(attributes)
        drew = host_random.moved(drawn) or not torch.equal(torch.random.get_rng_state(), torch_state)
        host_random.restore(drawn)
        torch.random.set_rng_state(torch_state)
    if written:
        raise FunctionalizeError(written_refusal(written, module))
    if drew:
        raise FunctionalizeError(drawn_refusal(module))
    return graph, constants, tuple(reads.values())


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _likely_cause(module: nn.Module, e: Exception) -> str:
    """What to say about an fx failure: only what the error itself shows."""
    text = str(e)
    if "control flow" in text:
        return (
            " forward branches on a tensor value in the code between units (fx runs it on proxies, "
            "whose values are unknown); move that code into a unit."
        )
    forward = inspect.signature(module.forward)
    if any(p.kind == p.VAR_KEYWORD for p in forward.parameters.values()):
        return " forward takes **kwargs (a decorated forward, as in Hugging Face models), which fx cannot bind."
    return ""


def _concrete_args(module: nn.Module) -> dict[str, Any]:
    """Pin every forward argument after the first to its default: a layer takes one input."""
    signature = inspect.signature(module.forward)
    concrete: dict[str, Any] = {}
    for i, (arg, p) in enumerate(signature.parameters.items()):
        if i == 0 or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            raise FunctionalizeError(
                f"functionalize: {type(module).__name__}.forward takes a second required argument {arg!r}; "
                "a Chain layer takes one input x. Give it a default, or pack the inputs into one tuple."
            )
        concrete[arg] = p.default
    return concrete


def split_graph(module: nn.Module, paths: list[str], ordered: bool) -> list[tuple[str, nn.Module]]:
    """One ``(unit path, segment GraphModule)`` per unit, in execution order."""
    graph, constants, reads = _trace(module, paths)
    calls = _unit_calls(graph, paths)
    if ordered:
        _check_order(paths, calls)
    segment = _assign_segments(graph, calls)
    crossing = _crossing_values(graph, calls, segment)
    # A shallow copy of the root carries the tracing constants without touching the module.
    root = copy.copy(module)
    root.__dict__.update(constants)
    pieces: list[tuple[str, nn.Module]] = [
        (str(call.target), _segment_module(root, graph, segment, crossing, s)) for s, call in enumerate(calls)
    ]
    for _, gm in pieces:
        gm.__dict__[GLUE_READS] = (type(module).__name__, reads)  # (functionalize's layer fn takes it off)
    return pieces


GLUE_READS = "_shardwise_glue_reads"


def _unit_calls(graph: fx.Graph, paths: list[str]) -> list[fx.Node]:
    """The call node of each unit, in execution order; each unit must run exactly once."""
    calls: dict[str, list[fx.Node]] = {p: [] for p in paths}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in calls:
            calls[str(node.target)].append(node)
    for path, nodes in calls.items():
        if not nodes and (inside := _inside_a_leaf(graph, path)) is not None:
            # torch's nn.TransformerEncoder: fx keeps a torch.nn module whole, so the layers in it are not in
            # the graph; recording the calls on an example finds them (functionalize falls back to it).
            raise FxTraceError(
                f"functionalize: unit {path!r} sits inside {inside!r}, a torch.nn module torch.fx does not trace "
                "into, so its calls cannot be split by tracing."
            )
        if not nodes:
            raise FunctionalizeError(
                f"functionalize: unit {path!r} is never called in forward. It may be unused, sit "
                "inside a module fx does not trace into (torch.nn layers other than containers), "
                "or be the same module object as another path; choose units that forward calls."
            )
        if len(nodes) > 1:
            raise FunctionalizeError(
                f"functionalize: unit {path!r} is called {len(nodes)} times in forward, but a unit "
                "is one layer and runs once; make the code that calls it repeatedly the unit instead."
            )
    position = {node: i for i, node in enumerate(graph.nodes)}
    return sorted((nodes[0] for nodes in calls.values()), key=position.__getitem__)


def _inside_a_leaf(graph: fx.Graph, path: str) -> str | None:
    """The module the trace kept whole (a call_module node) that holds the unit at ``path``, if any."""
    for node in graph.nodes:
        if node.op == "call_module" and path.startswith(f"{node.target}."):
            return str(node.target)
    return None


def _check_order(paths: list[str], calls: list[fx.Node]) -> None:
    executed = [str(n.target) for n in calls]
    if executed != paths:
        i = next(i for i, (a, b) in enumerate(zip(paths, executed, strict=True)) if a != b)
        raise FunctionalizeError(
            f"functionalize: units must be listed in the order forward runs them; unit {i} is "
            f"{paths[i]!r} but forward runs {executed[i]!r} there. Execution order: {executed}"
        )


def _assign_segments(graph: fx.Graph, calls: list[fx.Node]) -> dict[fx.Node, int]:
    """Segment of every node: units fixed, glue runs with its first user (else where it stands)."""
    unit_index = {node: i for i, node in enumerate(calls)}
    last = len(calls) - 1
    segment: dict[fx.Node, int] = {}
    next_unit = last  # the unit a node stands before; glue after the last unit joins it
    for node in reversed(graph.nodes):
        if node in unit_index:
            next_unit = unit_index[node]
            segment[node] = next_unit
        elif node.op == "placeholder":
            segment[node] = 0
        elif node.op == "output":
            segment[node] = last
        elif node.users:
            segment[node] = min(segment[user] for user in node.users)
        else:  # no users (asserts, in-place ops): keep it where forward runs it
            segment[node] = next_unit
    return segment


def _crossing_values(
    graph: fx.Graph, calls: list[fx.Node], segment: dict[fx.Node, int]
) -> list[fx.Node]:
    """The one value that flows across each boundary; refuse a boundary that needs more or none."""
    crossing = []
    for b in range(len(calls) - 1):
        live = [
            node
            for node in graph.nodes
            # get_attr reads are repeated in every segment that needs them instead of crossing.
            if node.op != "get_attr"
            and segment[node] <= b
            and any(segment[u] > b for u in node.users)
        ]
        if len(live) != 1:
            raise FunctionalizeError(_boundary_error(calls[b], calls[b + 1], live))
        crossing.append(live[0])
    return crossing


def _boundary_error(before: fx.Node, after: fx.Node, live: list[fx.Node]) -> str:
    where = f"functionalize: between units {before.target!r} and {after.target!r}"
    if not live:
        return (
            f"{where} no value flows: {after.target!r} and what follows do not use anything computed "
            f"up to {before.target!r}. Drop the unused unit, or list units that form a chain."
        )
    values = "\n".join(f"  - {_describe(node)}" for node in live)
    return (
        f"{where} {len(live)} values cross, but a layer passes exactly one value (a tensor or a "
        f"tuple of tensors) to the next:\n{values}\n"
        "Compute the extra values inside the units that use them (or derive them from the value "
        "that crosses, e.g. x.size(1) instead of idx.size(1)), make a constant a registered "
        "buffer, or choose units whose boundaries leave one value live."
    )


def _describe(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"{node.target!r}, the input of forward"
    if node.op == "call_module":
        text = f"{node.name!r}, the output of {node.target!r}"
    elif node.op == "call_method":
        text = f"{node.name!r} = .{node.target}(...)"
    else:
        text = f"{node.name!r} = {getattr(node.target, '__name__', node.target)}(...)"
    trace = node.meta.get("stack_trace") or ""
    lines = trace.strip().splitlines()
    return f"{text} at {lines[0].strip()}" if lines else text


def _segment_module(
    root: nn.Module, graph: fx.Graph, segment: dict[fx.Node, int], crossing: list[fx.Node], s: int
) -> fx.GraphModule:
    """The GraphModule running segment ``s``: input = the value crossing in, output = the one crossing out."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if s > 0:
        env[crossing[s - 1]] = g.placeholder(crossing[s - 1].name)

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":  # _crossing_values guarantees this; a failure is our bug
                raise AssertionError(f"segment {s} reads {node.name!r} from another segment")
            env[node] = g.node_copy(node)
        return env[node]

    for node in graph.nodes:
        if segment[node] == s and node.op != "output" and node not in env:
            env[node] = g.node_copy(node, lookup)
            # Annotations written as strings (`from __future__ import annotations`) would
            # land in the generated code's globals and make the GraphModule unpicklable.
            env[node].type = None
    if s == len(crossing):
        g.output(fx.map_arg(graph.output_node().args[0], lookup))
    else:
        g.output(lookup(crossing[s]))
    g.lint()
    gm = fx.GraphModule(root, g, class_name=f"{type(root).__name__}Segment")
    gm.training = root.training  # the recorded ops already fixed their mode; keep the flag truthful
    _keep_non_persistent(root, gm)
    return gm


def _keep_non_persistent(root: nn.Module, gm: fx.GraphModule) -> None:
    """Register again as non-persistent each buffer of ``gm`` that ``root`` does not persist: GraphModule
    copies a buffer it reads as a persistent one, so a model-level one that every segment reads (torchtitan's
    ``freqs_cis``, passed to each block) was in each segment's state_dict under one key, a checkpoint refused
    the chain ("names two different tensors"), and one in a single segment was saved where torch saves none."""
    read = list(gm.named_buffers())
    if not read:
        return
    persisted = set(root.state_dict(keep_vars=True))
    held = {name for name, _ in root.named_buffers(remove_duplicate=False)}
    for name, buffer in read:
        if name in held and name not in persisted:  # the same path in both: GraphModule copies it there
            path, _, attr = name.rpartition(".")
            gm.get_submodule(path).register_buffer(attr, buffer, persistent=False)


# --- checking against the module ----------------------------------------------------------
