"""Communication backends: the contract (``base``) and what fulfils it.

``single`` (a world of one), ``threads`` (ranks as threads of one process, the
reference), ``distributed`` (+ ``distributed_p2p``: torch.distributed, gloo or
NCCL, one process per rank) and ``processes`` (local gloo ranks;
``process_worker`` is a rank's side, ``start_method`` how a rank starts). ``current`` says which backend the
calling rank talks through; ``thread_ranks`` runs a function on rank threads.
Nothing here knows of meshes, autograd or the ledger.
"""
