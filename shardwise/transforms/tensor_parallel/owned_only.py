"""A module that owns a parameter a styled module inside it splits, watched for reading it itself.

Hugging Face ties ``BertLMPredictionHead.bias`` (``RobertaLMHead.bias``) to its decoder's bias, and
only the decoder adds it: with the decoder Colwise the head hands the bias on and never reads it,
so owning it is not using it. A head whose own forward did read it would get this rank's slice
where it meant the whole, so that read is refused, at the first forward (the Plan's prediction or
the first step), naming the parameter.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class _WatchedParameters(dict[str, Any]):
    """A module's parameter dict that notes the names read from it (``self.bias`` in its forward goes
    through nn.Module.__getattr__ to here) while ``reads`` is a set; a dict to everything else, so the
    calls that swap tensors in and out (ModuleCall) and the copies (deepcopy, pickle) keep it."""

    reads: set[str] | None = None

    def __getitem__(self, name: str) -> Any:
        if self.reads is not None:
            self.reads.add(name)
        return super().__getitem__(name)


class OwnedOnly:
    """The forward of an unstyled module owning a parameter that a styled module inside it splits
    (Hugging Face ties ``BertLMPredictionHead.bias`` to its decoder's bias, and only the decoder adds
    it): the class's forward, refused if it reads the parameter itself (it would get this rank's
    slice, where it meant the whole)."""

    def __init__(self, module: nn.Module, refusals: dict[str, str]) -> None:
        self.module, self.refusals = module, refusals  # attribute -> the refusal if read
        module._parameters = _WatchedParameters(module._parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        watched = m.__dict__.get("_parameters")
        if not isinstance(watched, _WatchedParameters):  # copied without it (module_call._shallow_tree)
            raise ValueError(next(iter(self.refusals.values())))
        outer, watched.reads = watched.reads, set()
        try:
            out = type(m).forward(m, *args, **kwargs)
            read = sorted(watched.reads & self.refusals.keys())
        finally:
            watched.reads = outer
        if read:
            raise ValueError(self.refusals[read[0]])
        return out
