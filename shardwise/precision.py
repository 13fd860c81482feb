"""Precision policies and loss scales for ``sw.mixed_precision``.

A ``Policy`` says the dtype of the parameters, of the compute and of the outputs
(jmp's grammar: ``"params=f32,compute=bf16,output=f32"``) and whether floating buffers
keep their dtype (``buffers=keep``, the default) or are cast too (``buffers=compute``); a loss scale is a frozen
value whose ``adjust`` returns the next one. ``mixed_precision`` takes either the
objects or their strings (``loss_scale="dynamic"``).

>>> import torch, shardwise as sw
>>> policy = sw.precision.Policy.parse("params=f32,compute=bf16,output=f32")
>>> policy.compute
torch.bfloat16
>>> sw.precision.StaticLossScale(1024.0).scale
1024.0
"""

from .transforms.mixed_precision import DynamicLossScale, Policy, StaticLossScale

__all__ = ["DynamicLossScale", "Policy", "StaticLossScale"]
