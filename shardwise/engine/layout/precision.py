"""Mixed-precision policies and loss scales, as small frozen values (after jmp).

A :class:`Policy` names four dtypes: the parameters as stored (the fp32
master weights), the compute copies layers run with, the model output, and
the dtype gradients are reduced in across ranks; and whether the layers'
floating buffers keep their stored dtype (``buffers=keep``, the default, as
torch.autocast and FSDP do: a rotary ``inv_freq`` stays f32) or are cast to
the compute dtype too (``buffers=compute``). ``Policy.parse`` reads the
small grammar ``"params=f32,compute=bf16,output=f32,reduce=f32"`` (short
keys ``p``, ``c``, ``o``, ``r``, ``b``); a key not given follows jmp: compute follows
params, output follows compute, reduce follows params. A :class:`Precision` adds per-layer
overrides by layer-name pattern and the loss scale.

Loss scales are interchangeable NamedTuples (so a TrainState holding one
flattens, saves and loads with nothing registered) whose ``adjust(finite)``
returns the next value, with ``torch.amp.GradScaler``'s semantics (a dynamic scale stops at a
floor, far below 1, where GradScaler sinks without end: see :class:`DynamicLossScale`). Each checks
its fields when made, so a scale that would skip every step (zero, infinite, NaN) is refused.
"""

from __future__ import annotations

import fnmatch
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self

import torch

from ..optim import foreach as fe

_DTYPES = {
    "f64": torch.float64, "float64": torch.float64, "double": torch.float64,
    "f32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "f16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute",
         "output": "output", "o": "output", "reduce": "reduce", "r": "reduce", "buffers": "buffers", "b": "buffers"}
_BUFFERS = ("keep", "compute")  # a buffer keeps its stored dtype, or is cast to the compute dtype


def _dtype(text: str, where: str) -> torch.dtype:
    try:
        return _DTYPES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"{where}: unknown dtype {text!r}; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class Policy:
    """Dtypes of the stored parameters, the compute copies, the model output and gradient reduction,
    and whether floating buffers keep their stored dtype (``"keep"``) or compute in ``compute``.

    >>> Policy.parse("params=f32,compute=bf16,output=f32")
    Policy(params=torch.float32, compute=torch.bfloat16, output=torch.float32, reduce=torch.float32, buffers='keep')
    >>> str(Policy.parse("compute=bf16,buffers=compute"))
    'params=f32,compute=bf16,output=bf16,reduce=f32,buffers=compute'
    """

    params: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32
    output: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    buffers: str = "keep"

    def __post_init__(self) -> None:
        for name in ("params", "compute", "output", "reduce"):
            value = getattr(self, name)
            if not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"Policy({name}={value!r}): a floating-point torch dtype is needed")
        if self.buffers not in _BUFFERS:
            raise ValueError(
                f"Policy(buffers={self.buffers!r}): use 'keep' (buffers keep their stored dtype) or 'compute' "
                "(floating buffers are cast to the compute dtype)"
            )

    @classmethod
    def parse(cls, text: str, base: Policy | None = None) -> Policy:
        """Read ``"key=dtype,..."``.

        Without ``base``, keys not given follow jmp's rules: params default to f32, compute
        follows params, output follows compute, and reduce follows params (gradients are
        reduced in the master dtype unless told otherwise), so ``"params=f64,compute=f64"``
        is all-f64 and ``"compute=bf16"`` computes and returns bf16 over f32 masters. With
        ``base`` (a layer override), keys not given keep ``base``'s values.
        """
        given: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, dtype = item.partition("=")
            if not sep or key.strip() not in _KEYS:
                raise ValueError(
                    f"policy {text!r}: cannot read {item!r}; write key=dtype with keys "
                    "params/p, compute/c, output/o, reduce/r (dtypes) and buffers/b (keep or compute), "
                    "e.g. 'params=f32,compute=bf16,output=f32'"
                )
            name = _KEYS[key.strip()]
            if name in given:
                raise ValueError(f"policy {text!r}: {name} is given twice; give each key once")
            given[name] = _buffers(dtype, text) if name == "buffers" else _dtype(dtype, f"policy {text!r}")
        if base is not None:
            return cls(**{**base.__dict__, **given})
        params = given.get("params", torch.float32)
        compute = given.get("compute", params)
        output = given.get("output", compute)
        return cls(params, compute, output, given.get("reduce", params), given.get("buffers", "keep"))

    def __str__(self) -> str:
        short = {v: k for k, v in _DTYPES.items() if len(k) <= 4 and k[0] in "fb"}
        dtypes = ",".join(f"{k}={short[getattr(self, k)]}" for k in ("params", "compute", "output", "reduce"))
        return dtypes if self.buffers == "keep" else f"{dtypes},buffers={self.buffers}"


def _buffers(text: str, policy: str) -> str:
    value = text.strip().lower()
    if value not in _BUFFERS:
        raise ValueError(
            f"policy {policy!r}: buffers={text.strip()!r}; use buffers=keep (floating buffers keep their stored "
            "dtype, the default) or buffers=compute (they are cast to the compute dtype)"
        )
    return value


class NoLossScale(NamedTuple):
    """No loss scaling (bf16 and fp32 need none)."""

    def checked(self) -> NoLossScale:
        return self

    def scale_value(self) -> float:
        return 1.0

    def adjust(self, finite: bool) -> NoLossScale:
        return self


def _is_number(value: Any) -> bool:
    # Only numbers are checked: a pytree map over a TrainState rebuilds its loss scale from whatever
    # it put in the leaves (tensors, None, flags), and must not be refused for that.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: The largest loss scale: float32's largest finite value. The loss is scaled in float32 (or wider); a scale
#: beyond it is infinite there (torch's GradScaler never grows past it either).
MAX_LOSS_SCALE = torch.finfo(torch.float32).max


def _check_positive(where: str, name: str, value: Any) -> None:
    if _is_number(value) and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}({name}={value!r}): {name} must be a finite number > 0")
    if _is_number(value) and value > MAX_LOSS_SCALE:
        raise ValueError(
            f"{where}({name}={value!r}): {name} must be at most float32's largest finite value "
            f"({MAX_LOSS_SCALE:.6g}): the loss is scaled in float32, where it would be infinite"
        )


def _check_count(where: str, name: str, value: Any, least: int) -> None:
    if _is_number(value) and not (isinstance(value, numbers.Integral) and int(value) >= least):
        raise ValueError(f"{where}({name}={value!r}): {name} must be an integer >= {least}")


class _StaticFields(NamedTuple):
    scale: float


class StaticLossScale(_StaticFields):
    """A fixed factor; a step with a non-finite gradient is still skipped.

    ``scale`` must be a finite number > 0 (a zero, infinite or NaN scale would skip every step).
    """

    __slots__ = ()

    def checked(self) -> Self:
        """This value, once its fields are valid (else a ValueError naming the field)."""
        _check_positive("StaticLossScale", "scale", self.scale)
        return self

    def scale_value(self) -> float:
        return float(self.scale)

    def adjust(self, finite: bool) -> StaticLossScale:
        return self


#: DynamicLossScale's default floor: the smallest normal float16. At this scale a float16 gradient
#: under about 1e-3 already underflows to zero, and one that still overflows is above 1e9: gradients
#: that are not finite even here are diverged (or inf/NaN from the forward), not badly scaled.
MIN_LOSS_SCALE = 2.0**-14


class _DynamicFields(NamedTuple):
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = MIN_LOSS_SCALE
    good_steps: int = 0


class DynamicLossScale(_DynamicFields):
    """torch.amp.GradScaler's rule: x``growth_factor`` after ``growth_interval`` finite steps in a
    row (never past float32's largest value, as GradScaler), x``backoff_factor`` on a step with a
    non-finite gradient (that step is skipped).

    GradScaler backs off without end, so a run whose gradients are not finite at any scale skips
    every step while the scale sinks towards zero. Here the scale stops at ``min_scale`` (by default
    :data:`MIN_LOSS_SCALE`, 2**-14, far below 1: gradients that overflow float16 unscaled still
    train, as with GradScaler), and a step whose gradient is not finite at that floor raises
    ``FloatingPointError`` instead of skipping again. A higher floor (one a user chose; 1.0, an
    older default a checkpoint may carry) skips such a step, as before: an overflow there may pass.
    The fields are checked where a value is used (:meth:`checked`), naming the field and its range.

    >>> s = DynamicLossScale(scale=4.0, growth_interval=2, min_scale=1.0)
    >>> s.adjust(True).adjust(True).scale, s.adjust(False).scale
    (8.0, 2.0)
    >>> DynamicLossScale(backoff_factor=2.0).checked()
    Traceback (most recent call last):
    ...
    ValueError: DynamicLossScale(backoff_factor=2.0): backoff_factor must be a number between 0 and 1 (exclusive)
    """

    __slots__ = ()

    def checked(self) -> Self:
        """This value, once its fields are valid (else a ValueError naming the field and its range).
        Checked where a value is used (``mixed_precision(loss_scale=)``, a checkpoint's load, every
        step), not when made: a pytree map over a TrainState rebuilds it from whatever it mapped."""
        scale, growth_factor, backoff_factor, growth_interval, min_scale, good_steps = self
        where = "DynamicLossScale"
        _check_positive(where, "scale", scale)
        _check_positive(where, "min_scale", min_scale)
        if _is_number(growth_factor) and not (math.isfinite(growth_factor) and growth_factor > 1):
            raise ValueError(f"{where}(growth_factor={growth_factor!r}): growth_factor must be a finite number > 1")
        if _is_number(backoff_factor) and not 0 < backoff_factor < 1:
            raise ValueError(
                f"{where}(backoff_factor={backoff_factor!r}): backoff_factor must be a number between 0 and 1 "
                "(exclusive)"
            )
        _check_count(where, "growth_interval", growth_interval, 1)
        _check_count(where, "good_steps", good_steps, 0)
        if _is_number(scale) and _is_number(min_scale) and min_scale > scale:
            raise ValueError(
                f"{where}(scale={scale!r}, min_scale={min_scale!r}): the scale starts below its floor; "
                f"give min_scale <= scale (by default min_scale is {MIN_LOSS_SCALE!r})"
            )
        return self

    def scale_value(self) -> float:
        return float(self.scale)

    def adjust(self, finite: bool) -> DynamicLossScale:
        if not finite:
            # At the default floor (or lower) a gradient still not finite is diverged, not badly scaled;
            # at a higher floor a user chose (or an older checkpoint's 1.0) an overflow may pass: skipped.
            if self.scale <= self.min_scale <= MIN_LOSS_SCALE:
                raise FloatingPointError(
                    f"the gradients are not finite even at the loss scale's floor (DynamicLossScale "
                    f"min_scale={self.min_scale!r}): scaling them down further would not make them finite, "
                    "and every step from here would be skipped. The loss or the gradients are inf/NaN "
                    "at any scale: the run diverged (lower the learning rate), the data "
                    "holds an inf/NaN, or a layer overflows its compute dtype in the forward (compute it "
                    "in float32: mixed_precision(overrides={layer: 'compute=f32'})). If gradients this "
                    "large are expected, give a lower min_scale (a resumed state: "
                    "state._replace(loss_scale=state.loss_scale._replace(min_scale=...)))"
                )
            return self._replace(scale=max(self.scale * self.backoff_factor, self.min_scale), good_steps=0)
        if self.good_steps + 1 >= self.growth_interval:
            # As torch's GradScaler: a growth past float32's range (2**128, infinite there) is not made.
            grown = self.scale * self.growth_factor
            return self._replace(scale=grown if grown <= MAX_LOSS_SCALE else self.scale, good_steps=0)
        return self._replace(good_steps=self.good_steps + 1)


LossScale = NoLossScale | StaticLossScale | DynamicLossScale


def as_loss_scale(spec: Any) -> LossScale:
    """``None``/"none", "dynamic", a number (static), or a LossScale value."""
    if spec is None or spec == "none":
        return NoLossScale()
    if spec == "dynamic":
        return DynamicLossScale()
    if isinstance(spec, (NoLossScale, StaticLossScale, DynamicLossScale)):
        return spec.checked()
    if isinstance(spec, (int, float)) and not isinstance(spec, bool) and math.isfinite(spec) and spec > 0:
        return StaticLossScale(float(spec)).checked()
    raise ValueError(
        f"loss_scale={spec!r}: use None, 'dynamic', a finite positive number (static), or a "
        "DynamicLossScale(...)/StaticLossScale(...)"
    )


@dataclass(frozen=True)
class Precision:
    """The precision of a step: a default policy, per-layer overrides, and the initial loss scale."""

    policy: Policy
    overrides: tuple[tuple[str, Policy], ...] = field(default=())
    loss_scale: Any = field(default_factory=NoLossScale)

    def for_layer(self, name: str) -> Policy:
        """The first override whose pattern matches ``name`` (fnmatch), else the default policy."""
        for pattern, policy in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                return policy
        return self.policy

    def compute_params(self, params: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Compute copies of the parameters, cast once per step by each owning layer's policy."""
        return {
            layer: {k: t.detach().to(self.for_layer(layer).compute) for k, t in tensors.items()}
            for layer, tensors in params.items()
        }


def compute_dtype(precision: Precision | None, layer: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``layer`` computes in: its policy's compute dtype, or ``dtype`` (the stored one)
    without a precision policy."""
    return dtype if precision is None else precision.for_layer(layer).compute


def all_finite(tensors: Any, device: torch.device | None = None) -> torch.Tensor:
    """A 0-d float tensor: 1.0 if every element of every tensor is finite, else 0.0 (1.0 on
    ``device`` for no tensors).

    Read from each tensor's largest magnitude (its inf-norm): infinite for an infinity, NaN for
    a NaN (the max propagates it; ``tests/engine/test_precision_finite.py`` checks that on
    every device it finds), and never an overflow of finite values, as a sum of them could be.
    One multi-tensor kernel per dtype on an accelerator, where a check of each tensor cost two
    launches per parameter, on a small model about as many as its whole optimizer step."""
    # An empty tensor (a ZeRO shard past the end) has no max; an integer one is always finite; a
    # complex one is read as its real and imaginary parts (its magnitude may overflow where they do not).
    tensors = [
        torch.view_as_real(t) if t.is_complex() else t
        for t in tensors if t.numel() and (t.is_floating_point() or t.is_complex())
    ]
    if not tensors:
        return torch.ones((), dtype=torch.float64, device=device)
    # stack promotes the dtypes' peaks to one (an infinity and a NaN stay what they are)
    return torch.stack(fe.norm(tensors, math.inf)).isfinite().all().to(torch.float64)


def metric_dtype(dtypes: Iterable[torch.dtype], frozen: Iterable[torch.dtype] = ()) -> torch.dtype:
    """The dtype the ranks exchange their shares in: float64 if any parameter of the model is (every
    rank must pick the same, so this reads the whole model's dtypes, not one rank's). With no
    parameter that trains, the loss is computed from the frozen tensors (``frozen``: the model's
    buffers, frozen parameters among them), so their dtypes decide: a frozen float64 model reports
    its loss in float64, as on one device. Not the loss's own dtype: a pipeline rank without the
    last stage has no loss, and must exchange in the same dtype as the one that has."""
    found = set(dtypes) or set(frozen)
    return torch.float64 if torch.float64 in found else torch.float32
