"""The Plan: typed per-rank actions, the lowering of a transform stack into them, and the memory
accounting of what backward keeps; and the prediction, on fake tensors, of the collectives a split
transform's layers issue inside each compute (``inside.py``).

May import ``torch_api``, ``model``, ``optim``, ``layout``, ``stack`` and ``collectives``.
"""
