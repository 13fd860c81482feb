"""Shard specs: how every parameter and optimizer-state leaf is laid out over the mesh.

``step.layout(mesh, params)`` returns a ``StateLayout``: per leaf a ``LeafSpec`` (global
shape and dtype, the ZeRO flat shard with its padding, a tensor-parallel ``TensorSplit``)
and the ``Placement`` of the layers over pipeline stages. Checkpoints and ``full_params``
read only these.

>>> import torch, shardwise as sw
>>> chain, params = sw.functionalize(torch.nn.Linear(3, 2))
>>> step = sw.shard_params(sw.train_step(chain, torch.nn.functional.mse_loss, sw.optim.sgd(0.1)), "dp", stage=3)
>>> isinstance(step.layout(sw.Mesh(dp=2), params), sw.layout.StateLayout)
True
"""

from .engine.layout.state_layout import LeafSpec, Placement, StateLayout, TensorSplit

__all__ = ["LeafSpec", "Placement", "StateLayout", "TensorSplit"]
