"""Hugging Face experts modules known to compute each token from that token alone.

Sequence parallel (``tensor_parallel(..., sequence_parallel=...)``) runs a transformer block on each
rank's slice of the sequence and follows its ops one by one, refusing any it cannot show to compute
position by position. A mixture-of-experts block's experts dispatch their tokens (``one_hot``,
``torch.where``, ``index_add_``), which no op-by-op rule follows; but the code of Hugging Face's fused
experts (``MixtralExperts.forward``, and every transformers class with that code line for line: OLMoE's,
Qwen2/3-MoE's, DeepSeek-V3's, ...) computes each token's output from its own row, its own top-k
indices and weights, and drops none. Given rows of tokens, its output is those tokens' rows.

That claim holds for the code read, which :mod:`.reproduced` pins by digest (every experts forward pinned
there but DBRX's is one expert_parallel reproduces, which runs each token's experts wherever its owners are: code
that computes a token from others could not be; DBRX's ``DbrxExperts``, its own loop over the experts its tokens
hit, was read for this alone), and for transformers' own
experts implementations (``config._experts_implementation``: "eager", the code read; the kernels
transformers ships compute the same sums). An experts function registered from elsewhere may compute
anything (drop tokens over a capacity): it is not known.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from .reproduced import CHECKED, same_code

# The experts classes whose forward was read (class name -> defining module), from the pinned digests.
_TOKEN_WISE = {
    name.rsplit(".", 2)[1]: name.rsplit(".", 2)[0]
    for name in CHECKED
    if name.endswith("Experts.forward")
}


def computes_each_token_alone(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module running code known to compute each token
    from its own row, indices and weights (see the module docstring)."""
    if not same_code(type(module), _TOKEN_WISE):
        return False
    implementation = implementation_named(module)
    return implementation in (None, "eager") or _transformers_own(implementation)


def implementation_named(module: nn.Module | None) -> Any:
    """The experts implementation ``module``'s config names (transformers' private
    ``config._experts_implementation``, read here only; "eager" where it names none)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", "eager")


def _transformers_own(implementation: str) -> bool:
    """Whether transformers' experts interface maps ``implementation`` to one of its own functions (its
    private ``ExpertsInterface._global_mapping``, read here only)."""
    integration = sys.modules.get("transformers.integrations.moe")
    functions = getattr(getattr(integration, "ExpertsInterface", None), "_global_mapping", {})
    fn = functions.get(implementation)
    return fn is not None and str(getattr(fn, "__module__", "")).startswith("transformers.")


# A split's forward of a whole mixture-of-experts block that, given rows of tokens, returns those tokens' rows
# (each token from its own row alone, dropping none) whatever communication it does inside (expert_parallel's
# dispatch over its own axis), runs through :func:`run_token_wise`. A follower of ops that cannot follow its
# inside (tensor_parallel's sequence-parallel guard, ``positions.py``) sets a runner with :func:`token_wise_runner`
# that takes it as one per-token op. This module is the protocol between them: transforms do not import each
# other.
TokenWiseRunner = Callable[[Callable[[], Any], Any, str], Any]
_runner = threading.local()  # .run: the runner of the block being followed on this thread, if any


def run_token_wise(run: Callable[[], Any], x: Any, where: str) -> Any:
    """``run()``, a forward that computes each token of ``x`` (its rows) from its own row alone and drops none
    (``where``: its path, for errors); handed to the runner set on this thread, if any."""
    runner: TokenWiseRunner | None = getattr(_runner, "run", None)
    return run() if runner is None else runner(run, x, where)


@contextmanager
def token_wise_runner(runner: TokenWiseRunner) -> Iterator[None]:
    """Within: :func:`run_token_wise` hands its forwards to ``runner(run, x, where)``."""
    outer = getattr(_runner, "run", None)
    _runner.run = runner
    try:
        yield
    finally:
        _runner.run = outer
