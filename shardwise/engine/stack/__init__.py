"""The transform stack: the roles a spec plays for the engine (``roles.py``: one written protocol
per role, and the split of a stack without one), the composition rules, stated once
(``compose.py``: which stacks are accepted, the order the layers are rewritten in), and the one
recording context of the collectives a split's layers issue inside a compute (``in_layer.py``).

May import ``model``, ``layout`` and ``collectives``.
"""
