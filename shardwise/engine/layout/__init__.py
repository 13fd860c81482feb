"""Where state lives: TrainState, per-leaf shard specs (StateLayout), flat ZeRO sharding,
precision policies and loss scales, devices.

May import ``model``, ``optim`` and ``collectives``.
"""
