"""The transform stack: the roles a spec plays for the engine (``roles.py``: one written protocol
per role), the composition rules, stated once (``compose.py``: which stacks are accepted, the order
the layers are rewritten in), a stack's splits asked as one (``splits.py``: one per axis), and the
one recording context of the collectives a split's layers issue inside a compute (``in_layer.py``), and a
loss term of the whole batch beside a token-weighted loss (``batch_term.py``).

May import ``model``, ``layout`` and ``collectives``.
"""
