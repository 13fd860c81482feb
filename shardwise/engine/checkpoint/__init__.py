"""Save, load and reshard training state: formats, names, cutting to shards, state dicts.

Reads shard specs (``layout``), never the executor: may import ``model``, ``optim``, ``layout``.
"""
