"""State a recomputed layer's forward leaves, which its recomputation would read: refused.

remat runs a layer's forward again in backward and differentiates that run, trusting it to compute what the
forward computed. A forward that changes its module's Python attributes and reads them (truncated BPTT's
``self.hidden = (h.detach(), c.detach())``, read as the next call's start; a running centre in a dict; a counter
feeding the output) breaks that: the recomputation starts from the state the forward left. torch's checkpoint
also stops a recomputation once it has what backward needs, so a write after that point never happens again,
and the state after the step looks as after one call (``forward_state.check_end`` sees nothing). The gradient is
of another computation (4e-3 in a TBPTT LSTM's, on one device), without an error.

On a layer's watched forward (its first with gradients), its module's Python state (``forward_state.python_state``)
is compared before and after; where the forward changed it, the call runs again on a copy of the module as the
forward left it (``first_call_state.module_copy``: registered tensors shared, attributes copied), on the same
input and random state, with no gradient: what the recomputation computes. An output that differs is refused,
naming the layer and the attributes. State a forward sets from its input's shape (a rotary cache) gives the same
output again and passes. Not judged (a gap): a layer whose module a split rewrote (no copy stands in for it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...engine.model.module_call import module_fn
from ...engine.run.first_call_state import module_copy
from ...engine.run.forward_state import python_state, same_output, same_state


def refusing_state_the_recompute_reads(fn: Any, tensors: dict[str, Any], x: Any, layer: str,
                                       run: Callable[[], Any]) -> Any:
    """``run()`` (the layer's watched forward), refused where its recomputation would read state it left."""
    holder = module_fn(fn)
    if holder is None:
        return run()
    module = holder.replicas.get().module
    before = python_state(module)
    with _random_state_kept() as replay:
        out = run()
    after = python_state(module)
    changed = sorted(k for k in before.keys() | after.keys()
                     if k not in before or k not in after or not same_state(before[k], after[k]))
    if not changed:
        return out
    left = module_copy(fn)
    if left is None:
        return out  # a module a split rewrote: not judged
    with holder.replicas.probing(left), replay(), torch.no_grad():
        again = fn(dict(tensors), x)
    if not same_output(out, again):
        raise ValueError(
            f"layer {layer!r} changed its module's attributes {changed} during forward, and a second call on the "
            "same input computes another output from them: remat's recomputation in backward would start from "
            "the state this forward left, and backward would differentiate another computation than the "
            "forward's (torch's loop without remat runs each call once). Keep the state outside the model (pass "
            "it in with the batch), compute it from the input, or leave this layer out of remat "
            "(sw.remat(step, layers=[...]))"
        )
    return out


@contextlib.contextmanager
def _random_state_kept() -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
    """The default generators' state as the block began; ``replay()`` runs a block from it, leaving them as it
    found them (a second call draws what the first drew, as remat's recomputation does)."""
    cuda = torch.cuda.is_initialized()
    start = torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None

    def put(states: tuple[torch.Tensor, Any]) -> None:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        now = torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None
        put(start)
        try:
            yield
        finally:
            put(now)

    yield replay
