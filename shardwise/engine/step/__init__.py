"""Step: the immutable value train_step returns and the transforms rewrite (``step.py``); how it
lays out its state (``layouts.py``, ``master.py`` for the precision policy's copies, ``init_state.py``,
``param_groups.py``), prepares and finishes one call's run (``run_inputs.py``) and plans (``planning.py``).

The top of the engine: may import every folder.
"""
