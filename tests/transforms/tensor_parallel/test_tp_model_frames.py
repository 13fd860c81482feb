"""The frame helpers (model_frames.py) that tell the model's read of a split parameter from shardwise's own.

They lived in weight_reads.py and skipped its frames by ``__file__`` and a fixed stack depth; split into a module
of their own, they skip every frame of a registered watch file (``watch_file``) from the innermost frame up. Read
here through a WeightReads watch on a plain tensor standing for a split weight: the model's op is refused naming
its own line (called directly, through helpers of any depth, through torch.nn.functional), and the same op made
by shardwise's code (a refusal reading the weight's shape to explain a failure) passes.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.transforms.tensor_parallel import model_frames
from shardwise.transforms.tensor_parallel.failures import colwise_subclass_failed
from shardwise.transforms.tensor_parallel.weight_reads import WeightReads


def _watch(weight: torch.Tensor) -> WeightReads:
    return WeightReads("L", [(weight, "up.weight", "'up' (Colwise(), a Linear)")])


def _line_of(marker: str) -> int:
    """The line of this file holding ``marker`` (a comment on the read)."""
    source = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return 1 + next(k for k, line in enumerate(source) if line.rstrip().endswith(marker) and "_line_of" not in line)


def test_a_models_read_names_its_line() -> None:
    w = torch.ones(4, 2)
    with _watch(w), pytest.raises(ValueError, match=(
        rf"reads parameter 'up\.weight' .*\(norm, at test_tp_model_frames\.py:{_line_of('# direct read')} in "
        r"test_a_models_read_names_its_line\)"
    )):
        w.norm()  # direct read


def _deep(w: torch.Tensor, depth: int) -> torch.Tensor:
    return w.sum() if depth == 0 else _deep(w, depth - 1)  # deep read


@pytest.mark.parametrize("depth", [0, 3, 12])
def test_a_read_through_helpers_of_any_depth_names_the_innermost_model_line(depth: int) -> None:
    w = torch.ones(4, 2)
    with _watch(w), pytest.raises(ValueError, match=rf"\(sum, at test_tp_model_frames\.py:{_line_of('# deep read')} "
                                                    r"in _deep\)"):
        _deep(w, depth)


def test_a_read_through_torch_nn_functional_names_the_models_line() -> None:
    """torch.nn's functions are model code: F.normalize's own norm is the model's read, named at its caller."""
    w = torch.ones(4, 2)
    with _watch(w), pytest.raises(ValueError, match=rf"test_tp_model_frames\.py:{_line_of('# functional read')} in "):
        F.normalize(w)  # functional read


def test_shardwises_own_read_passes() -> None:
    """A refusal that reads the split weight's shape to explain a failure is shardwise's: not refused."""
    layer = nn.Linear(2, 4)
    with _watch(layer.weight):
        message = colwise_subclass_failed("up", layer, RuntimeError("shape"), 2, {})
    assert "(4 of 8)" in message
    with _watch(layer.weight), pytest.raises(ValueError, match=r"\(shape, at test_tp_model_frames\.py"):
        _ = layer.weight.shape  # the same read by the model: refused


def test_every_watch_file_is_registered() -> None:
    """weight_reads.py's frames pass an op on: unregistered, its own frames would be taken for shardwise's caller
    and every read would pass."""
    from shardwise.transforms.tensor_parallel import weight_reads

    assert weight_reads.__file__ in model_frames._WATCHES and model_frames.__file__ in model_frames._WATCHES
