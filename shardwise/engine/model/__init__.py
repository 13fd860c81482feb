"""A module as a Chain of pure layers: functionalize, capture of control flow, fx splitting, pytrees.

Owns the structure of a model; holds no distributed state. May import ``torch_api`` and ``collectives``.
"""
