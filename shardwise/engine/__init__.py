"""The engine: everything between a model and a distributed training step, one folder per concern.

Each folder may import only the folders listed before it here (tests/test_layering.py checks it):

* ``torch_api``: the private torch APIs shardwise relies on, wrapped in one module.
* ``model/``: a module as a Chain of pure layers (functionalize, capture, fx splitting, pytrees).
* ``optim/``: functional optimizers and learning-rate schedules.
* ``layout/``: where state lives: TrainState, per-leaf shard specs, flat sharding, precision, devices.
* ``stack/``: the transform stack: the roles a spec plays, the rules for composing them, the splits
  asked as one, the optimizers a stack may hand pieces of parameters, and the recording of the
  collectives a split's layers issue inside a compute.
* ``plan/``: the Plan's typed actions, the lowering of a stack into them, memory accounting.
* ``simulate/``: simulate(plan), its costs and timelines (reads Plans only).
* ``run/``: the one executor and what it needs at run time (rng, metrics, agreement checks).
* ``checkpoint/``: save, load and reshard (reads shard specs, never the executor).
* ``step/``: Step, the value the transforms rewrite, and its planning.
"""
