"""Python's and numpy's calls that take a part's length in C, past its marks: watched while a layer's first call is.

A :class:`~.part_length.PartLength` keeps its mark through Python's arithmetic and is judged where ``__int__``,
``__float__``, numpy's protocols or a torch call take it. Some calls read an ``int`` subclass's value in C and ask
it nothing: ``range(t)`` (and so ``len(range(t))``, ``list(range(t))``), ``numpy.arange(t)``, and math's functions
of a float computed from one (``math.sqrt(1 / t)``; ``math.sqrt(t)`` asks ``__float__``, refused already) or of the
length as an integer (``math.isqrt(t)``, ``math.gcd(t, k)``). What they return is a plain number: the part's
positions counted ``0 .. t - 1``, or a value of the part's count. Each trained another model without an error
(TinyGPT, cp 2, float64, relative loss error at the second step: ``x * len(range(t)) / 8`` 8.0e-5; positions from
``list(range(t))``, from ``np.arange(t)``, and ``x * math.sqrt(1 / t)`` 1.3e-4 each).

numpy asks one only where it is among what a function dispatches on (``np.clip(t, ..)``), or converts a list holding
one; a size or a count it reads in C (``np.ones(t)``, ``np.zeros((b, t))``, ``np.linspace(0, 1, t)``), and an
array of the part's length is not followed (``np.ones(t).cumsum()`` counts the part's positions): relative loss
error 3.0e-6 for ``linspace``, 5.8e-4 for the two counts, without an error.

itertools' ``islice(it, t)`` and ``repeat(v, t)`` count their items in C too (positions from them: 5.6e-4, 5.8e-4);
``enumerate(it, start=t)`` counts on from it (a value from it, ``x * i``: 8.0e-5) and ``operator.index(t)``
returned it as a plain ``int`` (positions ``torch.arange`` of it: 7.6e-4): the one is refused, the other returns
the marked length itself, judged where it goes as the read is.
(A list or tuple repeated, ``[1.0] * t``, asks the marked number: ``part_length.py`` refuses it.)

While any thread watches a layer's first call (``unsplit.watched``), the engine's stand-ins stand
(``engine/stack/host_calls.py``: ``range``, ``itertools.islice`` and ``repeat``, ``enumerate``, ``operator.index``,
math's functions but those that keep the mark, numpy's functions, and a module's own bindings of them): a marked
number given by the watched layer's code (``part_length.by_the_model_at``: not torch's, shardwise's, or another
thread's) is refused, naming the call.
``math.ceil``, ``floor`` and ``trunc`` keep the mark (``t // k`` sized as ``math.ceil(t / k)``), as does
``math.prod`` (Python's ``*``). While they stand, in every thread of the process: ``type(r) is range`` is False, and
pickle refuses a ``range`` object and a math or numpy function taken before the watch.

A name bound before the watch (``from math import sqrt``, ``from numpy import arange`` at a module's top) is the
module's own binding of the original, which a stand-in in ``math`` leaves as it was: it trained another model as
silently (``sqrt(1 / t)``). So the watch also puts the stand-ins in the places of such bindings, in every imported
module that may be the model's code (``engine/stack/host_calls.py``): not Python's standard library, torch,
numpy, torch's sympy and mpmath, or shardwise but its testing models. The modules are scanned once each (a few
milliseconds for a thousand), those imported since at the next watch.

What it cannot see: ``str(t)`` (a string is no value of the computation: a number parsed back from it would pass
unseen, while refusing it would refuse a model that logs its shapes), ``x.shape.numel()`` (``torch.Size``
multiplies its ints in C), and a name bound to the original elsewhere than a module's globals (a default argument,
a class attribute, a closure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...engine.stack.host_calls import calls_watched, register
from .part_length import Part, PartLength, _refuse, by_the_model_at

__all__ = ["calls_watched"]

_AS_MANY = "items (as many as this rank's part has, plain values)"
_WHAT = {
    "range": "numbers (this rank's part counted 0 .. t - 1, plain ints) cannot be followed: positions or a count made "
             "of them are the part's",
    "islice": f"{_AS_MANY} cannot be followed: positions or a count made of them are the part's",
    "repeat": f"{_AS_MANY} cannot be followed: positions or a count made of them are the part's",
    "enumerate": "numbers (counted on from the part's length, plain ints) cannot be followed: values of the "
                 "computation made of the part's count",
    "math": "result is a plain number that cannot be followed: a value of the computation made of the part's count",
    "numpy": "result (a plain number, or an array whose length or values are the part's count: numpy's arrays are not "
             "followed) cannot be followed: a value of the computation, or the part's positions counted 0 .. t - 1",
}


def _judge(number: Any, caller: str, call: str, kind: str) -> Callable[[Any], Any] | None:
    """A marked number given to a watched call by the watched layer's code: refused, naming the call; or, for
    ``operator.index`` (a plain ``int`` of it), given back itself, its mark kept."""
    if kind == "operator" and isinstance(number, PartLength):
        return lambda _: number
    if by_the_model_at(caller) and kind in _WHAT:
        _refuse(number.origin, f"passes it to {call}, whose {_WHAT[kind]}")
    return None


register(Part, _judge)
