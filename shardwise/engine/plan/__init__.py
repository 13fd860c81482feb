"""The Plan: typed per-rank actions, the lowering of a transform stack into them, and the memory
accounting of what backward keeps.

May import ``torch_api``, ``model``, ``optim``, ``layout``, ``stack`` and ``collectives``.
"""
