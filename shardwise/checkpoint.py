"""Checkpoints: save a step's state on every rank, load it onto any mesh and stack, and trade weights with torch.

``save(path, state, step)`` writes each rank's shards in torch.distributed.checkpoint's layout;
``load(path, step, mesh)`` reads them back laid out for *that* step and mesh (another
data-parallel size, ZeRO stage, pipeline partition or tensor-parallel size, or one device).
``full_state_dict`` hands the weights back under the module's names, ``save_pretrained`` writes
them as transformers' ``save_pretrained`` does, one layer gathered at a time; ``init_from_pretrained``,
``init_from_dcp`` and ``init_from_state_dict`` start a step from weights saved by others, each
rank reading only what it keeps.

>>> import tempfile, torch, shardwise as sw
>>> chain, params = sw.functionalize(torch.nn.Linear(2, 2))
>>> step = sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1))
>>> path = tempfile.mkdtemp() + "/ckpt"
>>> handle = sw.checkpoint.save(path, step.init(params), step)   # written: blocking by default
>>> sw.checkpoint.load(path, step).step
0
"""

from .engine.checkpoint.export import save_pretrained
from .engine.checkpoint.file_format import CheckpointError
from .engine.checkpoint.save_load import SaveHandle, describe, load, save
from .engine.checkpoint.state_dict import full_state_dict, init_from_state_dict, read_dcp_state_dict
from .engine.checkpoint.weights import init_from_dcp, init_from_pretrained

# A traceback names an exception by its module, and a handle's repr its class's: the public one,
# not where it happens to live.
CheckpointError.__module__ = SaveHandle.__module__ = __name__

__all__ = [
    "CheckpointError",
    "SaveHandle",
    "describe",
    "full_state_dict",
    "init_from_dcp",
    "init_from_pretrained",
    "init_from_state_dict",
    "load",
    "read_dcp_state_dict",
    "save",
    "save_pretrained",
]
