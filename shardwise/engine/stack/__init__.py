"""The transform stack: the roles a spec plays for the engine and the composition rules, stated once.

May import ``model`` and ``collectives``.
"""
