"""The line of ``forward`` each traced node came from, recorded without importing torch's compiler.

``functionalize`` traces with stack traces so that an error can point at the line of forward a
value comes from. torch.fx's own (``record_stack_traces``) captures the stack with
``CapturedTraceback``, whose symbolization imports torch._inductor and torch._dynamo, and then
drops torch's files by importing the modules that hold them
(``torch.fx.experimental.symbolic_shapes.uninteresting_files``: torch.export, sympy, networkx):
about 1,200 modules and 1.2 s of CPU in every process that traces, every rank of a launch
included. :func:`stack_trace` records the same text with Python's traceback module and finds
torch's files by their paths, importing nothing. tests/engine/test_fx_stack_traces.py checks
that it is torch's text, node for node, and that tracing imports neither.
"""

from __future__ import annotations

import os
import sys
import traceback
import types

import torch

_TORCH = os.path.dirname(torch.__file__)
# What uninteresting_files() lists (torch 2.13), as paths under torch's directory, and fx's proxy.py
# (torch keeps its frames: they only say that fx made the node). A file that is never on the stack
# while fx traces is harmless here; a directory covers every file in it.
_FILES = frozenset(os.path.join(_TORCH, *path.split("/")) for path in (
    "__init__.py", "_compile.py", "_dynamo/eval_frame.py", "_dynamo/external_utils.py", "_inductor/sizevars.py",
    "_library/custom_ops.py", "_library/fake_impl.py", "_logging/_internal.py", "_logging/structured.py",
    "_subclasses/fake_tensor.py", "_subclasses/meta_utils.py", "export/_trace.py", "fx/_symbolic_trace.py",
    "fx/experimental/recording.py", "fx/experimental/sym_node.py", "fx/experimental/symbolic_shapes.py",
    "fx/interpreter.py", "fx/proxy.py",
)) | {"<string>"}
_DIRECTORIES = tuple(os.path.join(_TORCH, name) + os.sep for name in ("_dynamo/polyfills", "_higher_order_ops"))
# The tracer's own override of fx's call_module (fx_split.py: only the tracing thread's calls are traced) stands
# where fx's frame stood, in fx/_symbolic_trace.py: dropped as that one is.
_FILES |= {os.path.join(os.path.dirname(os.path.abspath(__file__)), "fx_split.py")}


def stack_trace() -> str | None:
    """What torch.fx records as the stack trace of a node that the caller of this function's caller
    creates now (``record_stack_traces``), less fx's proxy.py: the frames from the first
    ``forward`` on, less torch's files, formatted; None without a ``forward``."""
    frames: list[types.FrameType] = []
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:  # frame objects alone: a deep caller's frames cost a pointer each
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first, as extract_stack
    first = next((i for i, f in enumerate(frames) if f.f_code.co_name == "forward"), len(frames))
    kept = [traceback.FrameSummary(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in frames[first:]
            if f.f_code.co_filename not in _FILES and not f.f_code.co_filename.startswith(_DIRECTORIES)]
    return "".join(traceback.StackSummary.from_list(kept).format()).strip() if kept else None
