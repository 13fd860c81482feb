"""What a model computes over the whole batch it is called on, and so cannot compute on a part of it.

The single-device step calls the model once on the global batch. A transform that cuts the batch (data
parallel's shares, a pipeline's or accumulation's micro-batches, expert parallel's shares, context
parallel's sequence parts) calls it on each part and takes the mean of the parts' losses, which is the
global batch's loss only when the model treats each sample on its own. Four kinds of model do not, and
:func:`over_whole_batch` finds them in a chain (the composition rules refuse them under such a
transform, ``engine/stack/compose.py``):

* :data:`BATCH_STATISTICS`: a layer that normalises with its batch's own mean and variance
  (``batch_statistics.py``: BatchNorm in training mode, or without running statistics);
* :data:`LOSS_TERM`: a loss that adds a term of the whole batch (``batch_loss_terms.py``: a Hugging Face
  mixture of experts' routers' load-balancing loss);
* :data:`ROWS_MIXED`: a layer known to compute a token's output from other rows of its batch
  (``batch_mixing.py``: transformers' Doge mixture of experts);
* :data:`FREQUENCIES`: an embedding whose backward divides each row's gradient by how often its batch looks
  the row up (``embedding_options.py``: ``scale_grad_by_freq=True``), or a module whose own forward calls
  ``F.embedding(..., scale_grad_by_freq=True)`` (``functional_frequencies.py``: seen by functionalize's check
  on an example input; without one the step refuses it at the layer's first call, ``run/frequency_watch.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import nn

from .batch_loss_terms import batch_loss_coef
from .batch_mixing import mixes_rows
from .batch_statistics import batch_statistics
from .chain import Chain, Layer
from .embedding_options import grad_by_frequency
from .module_call import module_fn

BATCH_STATISTICS = "batch statistics"  # normalises with the statistics of the batch it is called on
LOSS_TERM = "loss term"  # adds a loss term of the batch it is called on
ROWS_MIXED = "rows mixed"  # a token's output reads other rows of the batch it is called on
FREQUENCIES = "frequencies"  # its gradient divides by counts over the batch it is called on


@dataclass(frozen=True)
class WholeBatch:
    """One module of the model that computes something over the whole batch it is called on.

    ``path``: its path in the model functionalize was given (the layer's name for the model's root);
    ``cause``: :data:`BATCH_STATISTICS`, :data:`LOSS_TERM`, :data:`ROWS_MIXED` or :data:`FREQUENCIES`;
    ``what``: what it is, in words
    (``"BatchNorm1d in training mode"``, ``"MixtralForCausalLM, router_aux_loss_coef=0.5"``).
    """

    path: str
    cause: str
    what: str

    def __str__(self) -> str:
        return f"{self.path!r} ({self.what})"


def over_whole_batch(chain: Chain) -> list[WholeBatch]:
    """Every module of ``chain``'s layers that computes something over the whole batch, once each, in
    the order of the layers (the layers that hand-written functions are have no modules to tell)."""
    found: dict[str, WholeBatch] = {}
    for path, module in called_modules(chain):
        statistics = batch_statistics(module)
        if statistics is not None:
            found.setdefault(path, WholeBatch(path, BATCH_STATISTICS, statistics))
        coef = batch_loss_coef(module)
        if coef:
            found.setdefault(path, WholeBatch(path, LOSS_TERM, f"{type(module).__name__}, router_aux_loss_coef={coef}"))
        mixing = mixes_rows(module)
        if mixing is not None:
            found.setdefault(path, WholeBatch(path, ROWS_MIXED, f"{type(module).__name__}: {mixing}"))
        counted = grad_by_frequency(module)
        if counted is not None:
            found.setdefault(path, WholeBatch(path, FREQUENCIES, counted))
    for layer in chain:  # a forward's own F.embedding(..., scale_grad_by_freq=True) (functional_frequencies.py)
        calls = getattr(module_fn(layer.fn), "frequency_calls", {})
        for path, call in calls.items():
            found.setdefault(path, WholeBatch(path, FREQUENCIES, call))
    return list(found.values())


def called_modules(chain: Iterable[Layer], this_thread: bool = False) -> Iterator[tuple[str, nn.Module]]:
    """(its path in the model, or the layer's name for the model's root; the module) for every module a
    layer of ``chain`` calls; ``this_thread``: the copies the calling thread's calls run (a thread rank's
    own replica of each layer's module, engine/model/module_call.py: ThreadReplicas), where a hook sees them."""
    for layer in chain:
        fn = module_fn(layer.fn)
        replicas = getattr(fn, "replicas", None)
        module = getattr(replicas, "module", None)
        if this_thread and isinstance(module, nn.Module):
            module = replicas.get().module  # type: ignore[union-attr]
        if not isinstance(module, nn.Module):
            continue
        # The layer's module's path in the model: root_prefix (a Sequential's child) or the replicas'
        # prefix (a recorded unit); a traced segment and the whole model keep the model's own paths.
        prefix = [str(getattr(fn, "root_prefix", "")), str(getattr(fn.replicas, "prefix", ""))]
        for sub, inner in module.named_modules():
            if type(inner).__name__ == "UnitStub":  # a unit's stand-in inside a recorded embed / head
                continue
            path = ".".join(p.strip(".") for p in (*prefix, sub) if p.strip("."))
            yield path or layer.name, inner
