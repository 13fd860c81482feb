"""A layer that normalises over the batch dimension with the statistics of the batch it is called on.

``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and their kin (every ``_BatchNorm``) normalise with the
mean and variance of the batch they are given whenever they do not use running statistics: in training
mode, and in eval mode when they keep none (``track_running_stats=False``). functionalize accepts such a
layer (it updates no state), and on one device it is what the single-device step computes. A step that
calls it on a part of the batch (each data-parallel rank's share, each micro-batch of a pipeline or of
accumulation, each expert-parallel share, each part of a context-parallel sequence) normalises each part
with its own statistics: another loss and update than the single-device step's, by a few percent, and
nothing would say so. :func:`batch_statistics` tells such a module, so that the step can refuse it.

Per-sample normalisations (LayerNorm, GroupNorm, RMSNorm, InstanceNorm) and a BatchNorm in eval mode with
running statistics are not affected by a cut of the batch.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def batch_statistics(module: nn.Module) -> str | None:
    """What ``module`` itself (not its children) is, when it normalises with its batch's statistics, as
    ``"BatchNorm1d, track_running_stats=False, in training mode"``; None when it does not."""
    if not isinstance(module, _BatchNorm):
        return None
    # torch's own rule (_BatchNorm.forward): batch statistics in training mode, and in eval mode when
    # there are no running ones.
    without = module.running_mean is None and module.running_var is None
    if not module.training and not without:
        return None
    kept = ", track_running_stats=False" if not module.track_running_stats else ""
    return f"{type(module).__name__}{kept}, in {'training' if module.training else 'eval'} mode"
