"""Which code made a torch op: the model's, or shardwise's own (the watches of weight_reads.py ask).

A watch (a TorchFunctionMode) sees an op on a split parameter and must tell the model's read (refused,
naming its line) from shardwise's own (a refusal reading the weights' shapes to explain a failure, a
collective). The op's caller is the first frame up the stack that does not only pass the op on: the
watches' own frames (their files register with :func:`watch_file`), torch's Python outside torch.nn,
torch.nn's function dispatching itself, and the torch function modes handing the op to each other. The
walk starts at the innermost frame and skips by file, so it does not depend on how deep in a watch the
question is asked.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

_TORCH = os.path.dirname(torch.__file__ or "") + os.sep
# torch.nn's modules and functions are model code (nn.MultiheadAttention reads its out_proj's weight itself);
# the rest of torch's Python only passes an op on (Tensor methods, torch.functional, the modes' dispatch).
_TORCH_NN = _TORCH + "nn" + os.sep
_SHARDWISE = os.path.dirname(sys.modules[__name__.split(".")[0]].__file__ or "") + os.sep
_MODELS = _SHARDWISE + os.path.join("testing", "models.py")  # shardwise's own example models are model code
# The files whose frames are a watch's own (this one, and each watch's: watch_file).
_WATCHES = {__file__}


def watch_file(path: str) -> None:
    """Frames of ``path`` (a watch's module: ``watch_file(__file__)``) are the watch's own, never an op's caller."""
    _WATCHES.add(path)


def by_shardwise(op: str) -> bool:
    """Whether ``op`` was called by shardwise's own code (a refusal explaining shapes, a collective), not the
    model's (torch.nn's modules and functions included): the first frame of the stack that does not only pass
    the op on (see _passing_on)."""
    frame = caller(op)
    name = "" if frame is None else frame.f_code.co_filename
    return name.startswith(_SHARDWISE) and name != _MODELS


def caller(op: str) -> Any:
    """The frame that called ``op``: the innermost one that does not only pass it on."""
    frame = sys._getframe(1)
    while frame is not None and _passing_on(frame, op):
        frame = frame.f_back  # type: ignore[assignment]
    return frame


def _passing_on(frame: Any, op: str) -> bool:
    """A watch's own frames, torch's Python outside torch.nn, a torch.nn function dispatching itself
    (F.multi_head_attention_forward seen as one op), and the torch function modes handing the op to each
    other (the layer's other watches)."""
    code = frame.f_code
    if code.co_name == "__torch_function__" or code.co_filename in _WATCHES:
        return True
    if not code.co_filename.startswith(_TORCH):
        return False
    return not code.co_filename.startswith(_TORCH_NN) or code.co_name == op


def model_line(op: str) -> str:
    """The model code doing the read: the first frame outside torch and shardwise, or, where shardwise calls
    torch.nn's module itself (a layer that is a TransformerEncoderLayer), torch.nn's line calling the op."""
    frame, nearest = caller(op), ""
    while frame is not None:
        name = frame.f_code.co_filename
        where = f":{frame.f_lineno} in {frame.f_code.co_name}"
        if not name.startswith((_TORCH, _SHARDWISE)) or name == _MODELS:
            return os.path.basename(name) + where
        if name.startswith(_SHARDWISE):
            return nearest
        nearest = nearest or "torch/" + os.path.relpath(name, _TORCH).replace(os.sep, "/") + where
        frame = frame.f_back
    return nearest


def innermost_model_line() -> str:
    """The innermost frame of model code (outside torch and shardwise, torch.nn's modules included): where a
    watch that sees the op by its own code (head_views.py) names the line making it."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name == _MODELS or not name.startswith((_TORCH, _SHARDWISE)) or (
            name.startswith(_TORCH_NN) and frame.f_code.co_name != "__torch_function__"
        ):
            return f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<no model frame>"
