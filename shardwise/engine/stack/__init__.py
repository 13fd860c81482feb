"""The transform stack: the roles a spec plays for the engine (``roles.py``: one written protocol
per role, and the split of a stack without one) and the composition rules, stated once
(``compose.py``: which stacks are accepted, the order the layers are rewritten in).

May import ``model``, ``layout`` and ``collectives``.
"""
