"""FairScale and DeepSpeed, built for the benchmarks on gloo CPU processes (not a benchmark itself).

The systems the seed set out to match, beside torch's own: FairScale's FSDP, FairScale's OSS
optimizer with ShardedDDP (ZeRO-2's layout), DeepSpeed's ZeRO-2 and ZeRO-3. They are optional:
neither is a dependency of shardwise, and a benchmark reports a system that is not installed as
skipped (:class:`SystemMissing`, raised by :func:`build`) instead of failing. Install them with::

    pip install fairscale==0.4.13 --no-deps    # its declared deps would replace torch
    pip install deepspeed==0.19.8              # pure-python deps only; check torch stays +cpu

Neither was written for CPU training; the workarounds, each at its place below:

* FairScale FSDP creates and waits on CUDA streams whenever it overlaps a transfer:
  :func:`cuda_streams_as_noops` makes them no-ops while one of its steps runs (CPU work is
  synchronous anyway), and :class:`_CpuFSDP` hands it stand-in streams.
* FairScale's reduce-scatter bucket concatenates gradients into a 2-D tensor, which gloo's
  reduce-scatter refuses: ``bucket_cap_mb=0`` reduce-scatters each flat gradient alone.
* DeepSpeed picks its accelerator from ``DS_ACCELERATOR`` (``cpu``) at import and reads
  ``LOCAL_RANK`` from the environment; ``gradient_clipping`` 0, since the other systems do not
  clip either. Its optimizer is ``torch.optim.AdamW`` (``torch_adam``), the one every other
  system here steps with: its fused Adam kernels are for GPUs. It prints its log and its ops'
  build notes on stdout, which the benchmarks keep for their JSON lines: :func:`to_stderr`.
* ShardedDDP reduces through gradient buckets that only its own ``zero_grad`` clears:
  :meth:`Trainer.step` zeroes through the module (with the optimizer's, the GPT's loss drifted
  0.5% from torch's in 20 steps).

Every system is built from an ``nn.Module`` whose weights are the same on every rank (a seeded
build), the ``units`` to shard separately (FSDP's wrapping), the loss and AdamW's
hyper-parameters; :meth:`Trainer.step` takes this rank's slice of the batch and returns its
loss, as torch's DDP or FSDP2 would be stepped.

>>> missing("fairscale_fsdp") is None or "fairscale" in missing("fairscale_fsdp")
True
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

SYSTEMS = ("fairscale_fsdp", "fairscale_oss", "deepspeed_zero2", "deepspeed_zero3")
PACKAGE_OF = {
    "fairscale_fsdp": "fairscale",
    "fairscale_oss": "fairscale",
    "deepspeed_zero2": "deepspeed",
    "deepspeed_zero3": "deepspeed",
}
INSTALL = {"fairscale": "pip install fairscale==0.4.13 --no-deps", "deepspeed": "pip install deepspeed==0.19.8"}
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class SystemMissing(ImportError):
    """The package a system needs is not installed: the benchmark skips that system."""


@dataclass(frozen=True)
class AdamW:
    """AdamW's hyper-parameters, the same for every system."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def torch(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


def missing(system: str) -> str | None:
    """Why ``system`` cannot be built here (its package is not installed, with how to install it), or None."""
    if system not in PACKAGE_OF:
        raise ValueError(f"unknown seed system {system!r}; choose one of {', '.join(SYSTEMS)}")
    package = PACKAGE_OF[system]
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (optional; {INSTALL[package]})"
    return None


class Trainer:
    """One system's module and optimizer on this rank: ``step(x, y)`` trains on this rank's slice."""

    def __init__(self, module: nn.Module, optimizer: Any, loss_fn: LossFn,
                 scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.module, self.optimizer, self.loss_fn, self.scope = module, optimizer, loss_fn, scope

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.scope():
            # The module's zero_grad, not the optimizer's: ShardedDDP reduces through gradient buckets
            # that only its own zero_grad clears (the optimizer's leaves them summing over the steps).
            self.module.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.module(x), y)
            loss.backward()
            self.optimizer.step()
        return loss.detach()

    def state_bytes(self) -> int:
        """Parameters and optimizer state this rank holds at rest (its shards where the system shards)."""
        return tensor_bytes(self.module.parameters()) + optimizer_state_bytes(self.optimizer)


class DeepSpeedTrainer(Trainer):
    """A DeepSpeed engine: the engine runs backward and the step (it owns the gradients' reduction)."""

    def __init__(self, module: nn.Module, optimizer: Any, loss_fn: LossFn,
                 input_dtype: torch.dtype | None = None) -> None:
        super().__init__(module, optimizer, loss_fn)
        self.input_dtype = input_dtype  # bf16: the engine's module takes its inputs in its own dtype

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        engine: Any = self.module  # a DeepSpeedEngine (untyped)
        cast = self.input_dtype is not None and x.is_floating_point()  # token ids stay integers
        loss = self.loss_fn(engine(x.to(self.input_dtype) if cast else x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def state_bytes(self) -> int:
        # ZeRO-3 leaves each parameter empty between steps and keeps this rank's part in ds_tensor;
        # both stages keep fp32 master partitions beside the model's tensors (also in fp32 training).
        engine: Any = self.module
        params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
        zero = self.optimizer
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(
            zero, "fp32_partitioned_groups_flat", [])
        return tensor_bytes(params) + tensor_bytes(masters) + optimizer_state_bytes(zero.optimizer)


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors`` (one tensor may alias another: count it once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def optimizer_state_bytes(optimizer: Any) -> int:
    """The tensors in ``optimizer.state`` (OSS: its local optimizer's: the shard this rank updates)."""
    inner = getattr(optimizer, "optim", optimizer)
    return tensor_bytes(t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def build(system: str, module: nn.Module, units: Sequence[nn.Module], loss_fn: LossFn, adamw: AdamW,
          micro_batch: int, bf16: bool = False) -> Trainer:
    """``system`` (one of :data:`SYSTEMS`) around ``module`` on the default gloo group.

    ``units``: the submodules FSDP wraps on their own (then the root); ``micro_batch``: the rows
    of this rank's slice (DeepSpeed's config asks for it). Raises :class:`SystemMissing` when the
    system's package is not installed. ``bf16`` (DeepSpeed only): its ``"bf16": {"enabled": true}``
    (the module's parameters in bfloat16, float32 master partitions; inputs cast to bfloat16).
    """
    reason = missing(system)
    if reason is not None:
        raise SystemMissing(reason)
    # Both call torch.distributed's private or renamed collectives (_all_gather_base ...), and torch
    # warns at every call: thousands of lines on stderr that say nothing about the measurement.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is (deprecated|a private function)")
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    if not dist.is_initialized():
        raise RuntimeError(f"building {system}: torch.distributed is not initialized; run it on gloo ranks")
    if system == "fairscale_fsdp":
        return fairscale_fsdp(module, units, loss_fn, adamw)
    if system == "fairscale_oss":
        return fairscale_oss(module, loss_fn, adamw)
    return deepspeed_zero(module, int(system[-1]), loss_fn, adamw, micro_batch, bf16)


# -- FairScale ------------------------------------------------------------------------------------
class _NoopStream:
    """Stands in for a CUDA stream on CPU: there is nothing to order, CPU kernels run in program order."""

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


# One stand-in for every stream: FSDP asserts that the current stream is its post-backward one.
_NOOP_STREAM = _NoopStream()


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    if tensor.is_cuda:
        raise RuntimeError("cuda_streams_as_noops is for CPU training; a CUDA tensor reached record_stream")


@contextlib.contextmanager
def cuda_streams_as_noops() -> Iterator[None]:
    """FairScale FSDP's CUDA stream calls as no-ops, for the ``with`` block only (its forward and backward).

    FSDP issues its all-gathers and reduce-scatters on side streams and orders them with
    ``wait_stream`` and ``record_stream`` unconditionally; on CPU there is no stream to ask.
    Patched only inside the block, so the other systems stepped in the same process see torch as it is.
    """
    with mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _NOOP_STREAM), \
            mock.patch.object(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()), \
            mock.patch.object(torch.Tensor, "record_stream", _record_stream):
        yield


def fairscale_fsdp(module: nn.Module, units: Sequence[nn.Module], loss_fn: LossFn, adamw: AdamW) -> Trainer:
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

    class _CpuFSDP(FullyShardedDataParallel):
        """FSDP that gets stand-in streams where it would make CUDA ones (only when CUDA is available)."""

        def _setup_streams(self) -> None:
            fresh = self._is_root and not self._streams
            super()._setup_streams()
            if fresh and not self._streams:  # the children share this dict (FSDP hands it to them)
                self._streams.update(fp32_to_fp16=_NOOP_STREAM, all_gather=_NOOP_STREAM, post_backward=_NOOP_STREAM)

    options = {
        "compute_device": torch.device("cpu"),  # its default is "the current CUDA device"
        "bucket_cap_mb": 0,  # a bucket is 2-D, which gloo's reduce-scatter refuses
        # The separate reduce-scatter group exists to overlap on a second CUDA stream; on CPU it
        # would only add a process group.
        "process_group_reduce_scatter": fsdp_module.ProcessGroupName.default,
    }
    wrap_units(module, units, lambda unit: _CpuFSDP(unit, **options))
    with cuda_streams_as_noops():
        wrapped = _CpuFSDP(module, **options)
    return Trainer(wrapped, adamw.torch(wrapped.parameters()), loss_fn, scope=cuda_streams_as_noops)


def wrap_units(module: nn.Module, units: Sequence[nn.Module], wrap: Callable[[nn.Module], nn.Module]) -> None:
    """Replace each of ``units`` (submodules of ``module``) in its parent by ``wrap(unit)``."""
    wanted = {id(unit) for unit in units}
    parents = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if id(child) in wanted]
    if len(parents) != len(wanted):
        raise ValueError(f"wrap_units: {len(wanted) - len(parents)} of the {len(wanted)} units are not "
                         "submodules of the module given; pass units from the same module")
    for parent, name, child in parents:
        setattr(parent, name, wrap(child))


def fairscale_oss(module: nn.Module, loss_fn: LossFn, adamw: AdamW) -> Trainer:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    optimizer = OSS(module.parameters(), optim=torch.optim.AdamW, lr=adamw.lr, betas=adamw.betas, eps=adamw.eps,
                    weight_decay=adamw.weight_decay)
    return Trainer(ShardedDataParallel(module, optimizer), optimizer, loss_fn)


# -- DeepSpeed --------------------------------------------------------------------------------------
def deepspeed_config(stage: int, adamw: AdamW, micro_batch: int, bf16: bool = False) -> dict[str, Any]:
    """DeepSpeed's config for ZeRO ``stage`` in float32 (``bf16``: bfloat16 parameters over float32
    master partitions) with AdamW, no clipping, no logging."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": adamw.lr, "betas": list(adamw.betas), "eps": adamw.eps,
                                                  "weight_decay": adamw.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        **({"bf16": {"enabled": True}} if bf16 else {}),
    }


def _import_deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    # DeepSpeed reads the rank on this host from LOCAL_RANK; these ranks all run on one host.
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    with to_stderr():
        import deepspeed

    return deepspeed


@contextlib.contextmanager
def to_stderr() -> Iterator[None]:
    """Print to stderr inside: DeepSpeed prints its log and its ops' build notes on stdout, which
    the benchmarks keep for their JSON lines (its logger binds the stream it finds at import)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


@contextlib.contextmanager
def deepspeed_zero3_init(adamw: AdamW, micro_batch: int) -> Iterator[None]:
    """DeepSpeed's ``zero.Init``: a module built inside it has each parameter partitioned as it is
    made (DeepSpeed's way to build a model larger than one rank; its counterpart of a meta init)."""
    reason = missing("deepspeed_zero3")
    if reason is not None:
        raise SystemMissing(reason)
    deepspeed = _import_deepspeed()
    # The dtype comes from the config (float32: neither fp16 nor bf16 enabled). Not dtype=torch.float:
    # 0.19.8 reads an explicit dtype as "fp16 if supported, else bf16" (operator precedence), bf16 on CPU.
    # zero.Init also swaps in its own F.linear for the rest of the process: run it in a process of its own.
    with to_stderr(), deepspeed.zero.Init(config_dict_or_path=deepspeed_config(3, adamw, micro_batch)):
        yield


def deepspeed_zero(module: nn.Module, stage: int, loss_fn: LossFn, adamw: AdamW, micro_batch: int,
                   bf16: bool = False) -> Trainer:
    deepspeed = _import_deepspeed()
    with to_stderr():
        engine, optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                       config=deepspeed_config(stage, adamw, micro_batch, bf16),
                                                       dist_init_required=False)
    return DeepSpeedTrainer(engine, optimizer, loss_fn, input_dtype=torch.bfloat16 if bf16 else None)
