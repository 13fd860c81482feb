"""The options of ``nn.Embedding`` and ``nn.EmbeddingBag`` that a step cannot compute as torch does everywhere.

* ``max_norm``: the forward renormalises the rows it looks up, in place, in the weight (torch.embedding_renorm_).
  On one device without transforms the write lands in the parameter the optimizer updates, as in torch; every
  other step writes into a copy (a gathered or flat one, another stage's copy of a tied weight) or writes it
  once per micro-batch or recompute. The executor refuses the write there (``engine/run/param_writes.py``);
  :func:`renorm_note` names the option in that refusal.
* ``scale_grad_by_freq``: the backward divides each row's gradient by how often the batch looks the row up, a
  statistic of the batch it is called on: :func:`grad_by_frequency` tells such a module, and the composition
  rules refuse it where the batch is cut (``whole_batch.py``), as a BatchNorm's statistics. The same call made
  in a forward's own code (``F.embedding(..., scale_grad_by_freq=True)``) is seen by functionalize's check or
  a step's first call (``functional_frequencies.py``) and refused alike.
* ``sparse``: the gradient is a sparse tensor, which the gradient norm, clipping, the reductions and the
  optimizers do not take: :func:`refuse_sparse` refuses it when the step is built.

:func:`option_fix` says what to do instead of each option, the same words wherever one is refused
(tensor_parallel refuses all three on a split embedding).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)

_FIXES = {
    "max_norm": (
        "drop max_norm and renormalise outside the step (after each update, under torch.no_grad(): "
        "weight.renorm_(2, 0, max_norm)), or compute the renormalised weight functionally in forward "
        "(w * (max_norm / w.norm(dim=-1, keepdim=True).clamp(min=1e-7)).clamp(max=1)) instead of writing it"
    ),
    "scale_grad_by_freq": (
        "set scale_grad_by_freq=False (or divide the gradient by the rows' counts over the global batch yourself)"
    ),
    "sparse": "set sparse=False: the step's gradients are dense tensors",
}


def option_fix(option: str) -> str:
    """What to do instead of the embedding option ``option`` (``max_norm``, ``scale_grad_by_freq``, ``sparse``)."""
    return _FIXES[option]


def renorm_note(module: object) -> str | None:
    """``"an Embedding with max_norm=1.0, which renormalises ..."`` when ``module`` writes its weight in
    forward by its ``max_norm``; None otherwise."""
    if not isinstance(module, EMBEDDINGS) or module.max_norm is None:
        return None
    return (
        f"an {type(module).__name__} with max_norm={module.max_norm!r}, which renormalises the rows it looks up "
        "in place in its weight"
    )


def grad_by_frequency(module: nn.Module) -> str | None:
    """``"Embedding, scale_grad_by_freq=True"`` when ``module`` scales its rows' gradients by how often its
    batch looks each up; None otherwise."""
    if isinstance(module, EMBEDDINGS) and module.scale_grad_by_freq:
        return f"{type(module).__name__}, scale_grad_by_freq=True"
    return None


def refuse_sparse(modules: Iterable[tuple[str, nn.Module]]) -> None:
    """Refuse the first of ``modules`` ((path, module) pairs) that makes a sparse gradient (``sparse=True``)."""
    for path, module in modules:
        if isinstance(module, EMBEDDINGS) and module.sparse:
            raise ValueError(
                f"{path!r} is an {type(module).__name__} with sparse=True, which makes its weight's gradient a "
                "sparse tensor: the step's gradient norm, clipping, reductions and optimizers take dense "
                f"gradients only; {option_fix('sparse')}"
            )
