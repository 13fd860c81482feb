"""Functional optimizers (optax shape: pure init / update pairs) and learning-rate schedules.

May import nothing else of the engine.
"""
