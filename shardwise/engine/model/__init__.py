"""A module as a Chain of pure layers: functionalize, capture of control flow, fx splitting, pytrees;
and a stage's backward split into its input part and its weight part (zero-bubble schedules).

Owns the structure of a model; holds no distributed state. May import ``torch_api`` and ``collectives``.
"""
