"""Remat policies, checkpoint_name, saved-bytes accounting and the torch internals remat relies on."""

from __future__ import annotations

import dataclasses
import doctest
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
import shardwise.transforms.remat as remat_pkg
from shardwise.engine.model.chain import Chain, Layer
from shardwise.transforms.remat import (
    CHECKPOINT_NAME_OP,
    _torch_sac,
    checkpoint_name,
    dots_saveable,
    everything_saveable,
    names,
    nothing_saveable,
    offload_to_cpu,
    remat,
    save_only_these_names,
    saved_bytes,
)

aten = torch.ops.aten


class _Ops(TorchDispatchMode):
    """Records the aten ops a piece of code dispatches (what a policy sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dots_saveable_keeps_the_matmul_and_attention_kernels_seen_on_cpu(dtype: torch.dtype) -> None:
    lin, head = torch.nn.Linear(8, 8).to(dtype), torch.nn.Linear(8, 8, bias=False).to(dtype)
    x = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
    q = torch.randn(2, 2, 5, 4, dtype=dtype, requires_grad=True)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with _Ops() as seen:
        lin(x)
        head(x)
        x @ x.transpose(1, 2)
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    saved = {op for op in seen.ops if dots_saveable(op)}
    assert saved == {
        aten.addmm.default,
        aten.mm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    assert not dots_saveable(aten.gelu.default) and not dots_saveable(aten.add.Tensor)


def test_policies_are_frozen_values_with_readable_names() -> None:
    assert nothing_saveable(aten.mm.default) is False and everything_saveable(aten.gelu.default) is True
    assert save_only_these_names("a", "b") == save_only_these_names("b", "a")
    assert hash(save_only_these_names("a")) == hash(save_only_these_names("a"))
    assert repr(save_only_these_names("b", "a")) == "save_only_these_names('a', 'b')"
    assert repr(offload_to_cpu(dots_saveable)) == "offload_to_cpu(dots_saveable)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        save_only_these_names("a").names = frozenset()  # type: ignore[misc]
    with pytest.raises(TypeError, match="non-empty strings"):
        save_only_these_names("")
    with pytest.raises(ValueError, match="offload once"):
        offload_to_cpu(offload_to_cpu())
    policy = save_only_these_names("h")
    assert policy(CHECKPOINT_NAME_OP, torch.ones(1), "h") and not policy(CHECKPOINT_NAME_OP, torch.ones(1), "g")
    assert not policy(aten.mm.default, torch.ones(1), "h")


# -- checkpoint_name ---------------------------------------------------------------------


def test_checkpoint_name_is_a_real_op_that_is_exact_and_has_identity_gradient() -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with _Ops() as seen:
        y = checkpoint_name(x * 2, "h")
    assert CHECKPOINT_NAME_OP in seen.ops
    assert torch.equal(y, x * 2)
    (y * torch.arange(12.0, dtype=torch.float64).view(3, 4)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, 2 * torch.arange(12.0, dtype=torch.float64).view(3, 4))


def test_checkpoint_name_works_under_torch_func() -> None:
    def f(w: torch.Tensor) -> torch.Tensor:
        return (checkpoint_name(w * 2, "h") ** 2).sum()

    w = torch.arange(3.0)
    assert torch.equal(torch.func.grad(f)(w), 8 * w)
    _, vjp = torch.func.vjp(lambda t: checkpoint_name(t, "h"), w)
    assert torch.equal(vjp(torch.ones(3))[0], torch.ones(3))
    batched = torch.arange(6.0).view(2, 3)
    assert torch.equal(torch.func.vmap(lambda t: checkpoint_name(t, "h"))(batched), batched)
    assert torch.equal(torch.func.vmap(torch.func.grad(f))(batched), 8 * batched)


def test_checkpoint_name_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="must be a tensor"):
        checkpoint_name(1.0, "h")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty string"):
        checkpoint_name(torch.ones(1), "")


# -- saved bytes -------------------------------------------------------------------------


def _tagged_chain() -> tuple[sw.Step, dict, tuple[torch.Tensor, torch.Tensor]]:
    def mlp(t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_name(torch.tanh(x @ t["w1"]), "h")
        return torch.sin(torch.exp(h) @ t["w2"])

    chain = Chain([Layer("mlp", mlp, param_names=("w1", "w2"))])
    gen = torch.Generator().manual_seed(0)
    params = {"mlp": {"w1": torch.randn(6, 10, generator=gen), "w2": torch.randn(10, 3, generator=gen)}}
    batch = (torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen))
    return sw.train_step(chain, F.mse_loss, sw.optim.sgd(lr=0.1)), params, batch


def test_save_only_these_names_saves_exactly_the_tagged_tensor() -> None:
    step, params, batch = _tagged_chain()
    inputs = batch[0].nbytes
    tagged = 5 * 10 * 4
    assert saved_bytes(remat(step, nothing_saveable), params, batch) == {"mlp": inputs}
    assert saved_bytes(remat(step, save_only_these_names("h")), params, batch) == {"mlp": inputs + tagged}
    # A name no layer tags saves nothing: plain checkpointing, which it was without a word; now refused.
    with pytest.raises(ValueError, match=r"no remat'd layer tags 'other'.*the names they tag are 'h'"):
        saved_bytes(remat(step, save_only_these_names("other")), params, batch)


def test_offload_on_cpu_keeps_the_same_tensors() -> None:
    step, params, batch = _tagged_chain()
    assert saved_bytes(remat(step, offload_to_cpu()), params, batch) == saved_bytes(step, params, batch)
    x = torch.randn(4, requires_grad=True)
    kept: list[torch.Tensor] = []
    hooks = _torch_sac._KeepForBackward(kept.append, offload=True, pin_memory=True, stay=frozenset())
    with hooks:
        y = torch.exp(x)
    assert any(t is y or t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in kept)
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.detach())


def test_a_policy_must_answer_a_bool() -> None:
    step, params, batch = _tagged_chain()
    bad = remat(step, lambda op, *args, **kwargs: "yes")
    with pytest.raises(ValueError, match="answers True"):
        bad(bad.init(params), batch)


# -- the torch internals remat relies on (fails loudly when torch changes them) -----------


def test_torch_selective_checkpoint_api_is_what_remat_assumes() -> None:
    policy = tuc.CheckpointPolicy
    assert {"MUST_SAVE", "PREFER_RECOMPUTE"} <= set(policy.__members__)
    # One of the two cache forms remat knows (storage_form raises for any other).
    assert _torch_sac.storage_form() in {"indexed", "queued"}
    caching, cached = tuc.create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: policy.PREFER_RECOMPUTE)
    assert caching.storage is cached.storage, "the two SAC modes no longer share a `storage` attribute"
    caching, cached = _torch_sac.selective_contexts(lambda ctx, op, *a, **k: policy.PREFER_RECOMPUTE)
    assert caching.storage is getattr(cached, "mode", cached).storage


def test_saved_outputs_are_shown_to_the_observer_and_not_recomputed() -> None:
    def predicate(op: Any, *args: Any, **kwargs: Any) -> bool:
        return bool(op == aten.mm.default)

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    shown: list[torch.Tensor] = []
    policy_fn = _torch_sac.sac_policy_fn(predicate)
    out = tuc.checkpoint(
        lambda a, b: torch.sin(a @ b), x, w, use_reentrant=False,
        context_fn=lambda: _torch_sac.selective_contexts(policy_fn, shown.append),
    )
    assert len(shown) == 1 and torch.equal(shown[0], x @ w), "the observer sees exactly the saved mm output"
    with _Ops() as seen:
        out.sum().backward()
    assert len(shown) == 1, "a recomputation shows nothing more"
    # Two mm for the gradients; the forward mm comes from the cache. Plain checkpoint recomputes it.
    assert seen.ops.count(aten.mm.default) == 2
    plain = tuc.checkpoint(lambda a, b: torch.sin(a @ b), x, w, use_reentrant=False)
    with _Ops() as seen:
        plain.sum().backward()
    assert seen.ops.count(aten.mm.default) == 3


def test_outer_saved_tensor_hooks_see_checkpoint_inputs_and_no_inner_activation() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    kept: list[torch.Tensor] = []
    with _torch_sac._KeepForBackward(kept.append, offload=False, pin_memory=False, stay=frozenset()):
        out = tuc.checkpoint(lambda a, b: torch.exp(torch.exp(a @ b)), x, w, use_reentrant=False)
    # Besides the inputs, only tensors that hold no memory (torch 2.11 also saves an empty dummy).
    holding = {t.untyped_storage().data_ptr() for t in kept if t.untyped_storage().nbytes() > 0}
    assert holding == {x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    out.sum().backward()


def test_sac_cache_survives_two_backward_calls_as_a_zero_bubble_schedule_needs() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    fn = remat_pkg.Remat(lambda t, a: torch.sin(a @ t["w"]), dots_saveable)
    out = fn({"w": w}, x)
    (gx,) = torch.autograd.grad(out.sum(), [x], retain_graph=True)
    (gw,) = torch.autograd.grad(out.sum(), [w])
    assert torch.equal(gx, torch.cos(x @ w) @ w.T) and torch.equal(gw, x.T @ torch.cos(x @ w))


def test_docstring_examples_run() -> None:
    for module in (remat_pkg, names):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0
