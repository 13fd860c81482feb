"""The private torch APIs shardwise relies on (engine/torch_api.py), checked so a torch change fails loudly here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.engine.torch_api import free_storage, holders, owns_storage, refill_storage, version_of, view_base


def test_free_and_refill_is_invisible_to_autograd_and_gives_the_same_gradients() -> None:
    buffer = torch.randn(6, dtype=torch.float64)
    values = buffer.clone()
    weight = buffer[:6].view(2, 3).detach().requires_grad_(True)  # as the executor makes parameter leaves
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tanh(x @ weight.t())  # saves weight for backward
    expected = torch.autograd.grad(y.sum(), weight, retain_graph=True)[0]

    free_storage(buffer)
    assert buffer.untyped_storage().nbytes() == 0 and weight.untyped_storage().nbytes() == 0
    refill_storage(buffer, values)
    assert buffer.untyped_storage().nbytes() == 48
    got = torch.autograd.grad(y.sum(), weight)[0]  # would raise if the version counter had moved
    assert torch.equal(got, expected)


def test_version_of_counts_in_place_writes_only() -> None:
    t = torch.zeros(3, dtype=torch.int64)
    before = version_of(t)
    _ = t + 1
    assert version_of(t) == before
    t += 1
    assert version_of(t) == before + 1 and version_of(t[1:]) == before + 1  # views share the counter


def test_view_base_is_the_root_a_view_was_made_from_and_shares_its_version() -> None:
    flat = torch.zeros(10)
    weight = flat[:6].view(2, 3)
    bias = torch.split(flat[6:], [2, 2])[1]
    assert view_base(weight) is flat and view_base(bias) is flat and view_base(flat) is None
    before = version_of(weight)
    flat[7:9].add_(1.0)  # written through another view of the same base
    assert version_of(weight) > before and version_of(bias) > before
    assert view_base(weight.clone()) is None


def test_owns_storage() -> None:
    t = torch.zeros(10)
    assert owns_storage(t) and not owns_storage(t[2:]) and not owns_storage(t[:5])


def test_storage_key_tells_storages_apart_on_cpu_and_meta() -> None:
    from shardwise.engine.torch_api import storage_key

    for device in ("cpu", "meta"):
        a, b = torch.empty(4, device=device), torch.empty(4, device=device)
        assert storage_key(a) == storage_key(a[1:]) == storage_key(a.detach()) == storage_key(a.view(2, 2))
        assert storage_key(a) != storage_key(b)


def test_storage_key_is_no_op_a_torch_function_mode_sees() -> None:
    from torch.overrides import TorchFunctionMode

    from shardwise.engine.torch_api import storage_key

    seen: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    a = torch.zeros(4)
    with Watch():
        storage_key(a[1:])
        a.untyped_storage()  # (the mode sees this: the check is not vacuous)
    assert seen == ["__getitem__", "untyped_storage"]


def test_fake_tensors_keep_the_device_and_the_kernel_choice() -> None:
    from shardwise.engine.torch_api import fake_tensors

    q = torch.randn(2, 2, 8, 4)
    with fake_tensors() as fake:
        f = fake(q)
        assert f.device.type == "cpu" and f.shape == q.shape
        out = torch.nn.functional.scaled_dot_product_attention(f, f, f, is_causal=True)
        assert out.shape == q.shape


def test_real_ops_read_real_tensors_inside_fake_tensors_and_keep_fake_ones_fake() -> None:
    """A pipeline's prediction runs the first layer so: the batch's mask code reads it, the parameters stay fake."""
    from shardwise.engine.torch_api import fake_tensors, is_fake, real_ops

    mask = torch.tensor([[1, 1, 0]])
    with fake_tensors():
        weight = torch.empty(3, 4)
        assert is_fake(weight)
        with real_ops():
            padded = not bool(mask.all())  # read: no fake mode in force for real tensors alone
            out = (mask.double() @ weight.double()).relu()
        assert padded and is_fake(out) and out.shape == (1, 4)
        assert is_fake(mask * 2)  # out of the block, the mode is back


def test_data_dependent_errors_are_what_fake_tensors_raise_on_a_data_dependent_shape() -> None:
    """functionalize falls back to stand-in tensors on these (an MoE's routing reads its data)."""
    import pytest

    from shardwise.engine.torch_api import data_dependent_errors, fake_tensors

    with fake_tensors() as fake:
        x = fake(torch.tensor([0, 1, 0, 2]))
        with pytest.raises(data_dependent_errors()):
            torch.nonzero(x)
        with pytest.raises(data_dependent_errors()):
            x.sum().item()


def test_stand_ins_run_a_data_dependent_shape_inside_fake_tensors_and_pass_gradients() -> None:
    """The Plan's predictions run such a layer on real stand-ins (torch's unset_fake_temporarily):
    its output comes back fake, and a backward reaches the fake inputs through it."""
    from shardwise.engine.torch_api import fake_tensors, is_fake, real_stand_ins, run_on_stand_ins

    def layer(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(x[:, 0] >= 0).flatten()  # zeros: every row
        return torch.zeros_like(x).index_add(0, rows, x[rows] @ w)

    with fake_tensors() as fake:
        w = fake(torch.randn(3, 3)).requires_grad_(True)
        x = fake(torch.randn(4, 3)).requires_grad_(True)
        y = run_on_stand_ins(layer, w, x)
        assert is_fake(y) and y.shape == (4, 3)
        gw, gx = torch.autograd.grad((y * 2).sum(), [w, x])
        assert is_fake(gw) and gw.shape == (3, 3) and gx.shape == (4, 3)
        with real_stand_ins() as real:
            z = real(x)
            assert not is_fake(z) and z.requires_grad and torch.equal(z, torch.zeros(4, 3))


def test_a_kernel_that_refuses_a_stride_of_0_runs_on_a_dense_copy_inside_dense_where_refused() -> None:
    """functionalize runs a meta-built module on stand-ins that are one zero each, expanded, which
    torch._grouped_mm (HF Mixtral's experts) refuses in its real and fake kernels: inside the block it
    runs again on a dense copy, real or fake, with the same result; an op that takes the stride is not
    copied, and a genuine error is still raised."""
    import pytest

    from shardwise.engine.torch_api import dense_where_refused, fake_tensors, is_fake

    x = torch.randn(6, 8, dtype=torch.bfloat16)
    w = torch.ones((), dtype=torch.bfloat16).expand(2, 8, 8)  # one value, expanded: stride 0
    offs = torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="strides"):
        torch._grouped_mm(x, w, offs=offs)
    with dense_where_refused():
        assert torch.equal(torch._grouped_mm(x, w, offs=offs), torch._grouped_mm(x, w.contiguous(), offs=offs))
        assert torch.equal(x @ w[0], x @ w[0].contiguous())  # taken as it is
        with fake_tensors() as fake:
            y = torch._grouped_mm(fake(x), fake(w), offs=fake(offs))
            assert is_fake(y) and y.shape == (6, 8)
        with pytest.raises(RuntimeError, match="mat_b"):  # shapes that do not fit: the dense run's error
            torch._grouped_mm(x, w[:, :4], offs=offs)
        with pytest.raises(RuntimeError, match="single memory location"):  # a write is not run on a copy
            w.add_(1)


def test_the_cpu_flash_attention_kernel_has_the_schema_the_wrappers_are_written_against() -> None:
    """Ring attention's block kernel (transforms/context_parallel/online_softmax.py) calls it through these
    wrappers; a torch that renamed it or changed its arguments would quietly fall back to the math kernel
    (right, but slower): this test is where that shows."""
    from shardwise.engine.torch_api import FLASH_ATTENTION_CPU_SCHEMAS, has_flash_attention_cpu

    ops = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    assert tuple(str(op.default._schema) for op in ops) == FLASH_ATTENTION_CPU_SCHEMAS
    x = torch.zeros(1, 1, 2, 2)
    assert has_flash_attention_cpu(x, x.double(), x.bfloat16())
    assert not has_flash_attention_cpu(x.to("meta")) and not has_flash_attention_cpu(x.int())


def test_cpu_flash_attention_returns_the_log_sum_exp_and_its_backward_the_gradients() -> None:
    """float64, grouped-query heads, non-contiguous views, causal and not: equal to sdpa (which runs the
    same kernel on CPU) and to the log-sum-exp of the scaled scores; the backward given the forward's
    output equals autograd's gradients of sdpa."""
    from shardwise.engine.torch_api import flash_attention_cpu, flash_attention_cpu_backward

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64, generator=gen)[:, :, 2:10]
    kv = torch.randn(2, 2, 2, 8, 8, dtype=torch.float64, generator=gen)
    k, v = kv.unbind(0)
    g = torch.randn(2, 4, 8, 8, dtype=torch.float64, generator=gen)
    for causal in (False, True):
        out, lse = flash_attention_cpu(q, k, v, causal=causal, scale=0.3)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out, want.detach(), rtol=1e-13, atol=1e-13)
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3
        if causal:
            scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-13, atol=1e-13)
        grads = flash_attention_cpu_backward(g, q, k, v, out, lse, causal=causal, scale=0.3)
        for got, expected in zip(grads, torch.autograd.grad(want, leaves, g), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


def test_accumulate_backward_takes_torch_engine_path_and_matches_backward_bitwise() -> None:
    from shardwise.engine import torch_api

    assert torch_api._ENGINE_RUN_BACKWARD is not None, (
        f"torch {torch.__version__} has no torch.autograd.graph._engine_run_backward: accumulate_backward "
        "falls back to torch.autograd.backward (correct, slower per layer); update engine/torch_api.py"
    )

    def grads(run: object) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(5, 3, dtype=torch.float64, generator=gen).requires_grad_(True)
        x = torch.randn(4, 3, dtype=torch.float64, generator=gen).requires_grad_(True)
        seed = torch.randn(4, 5, dtype=torch.float64, generator=gen)
        for _ in range(2):  # the second call accumulates into .grad, as micro-batches do
            y = torch.tanh(x @ w.t())
            run([y], [seed], [x, w])  # type: ignore[operator]
        assert x.grad is not None and w.grad is not None
        return [x.grad, w.grad]

    expected = grads(lambda o, s, i: torch.autograd.backward(o, s, inputs=i))
    assert all(torch.equal(g, e) for g, e in zip(grads(torch_api.accumulate_backward), expected, strict=True))
    # A seed of another shape takes torch's own checks, and its error.
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        torch_api.accumulate_backward([leaf * 2], [torch.ones(2)], [leaf])


def test_holders_counts_the_tensors_on_a_storage_the_owners_of_a_tensor_and_its_python_references() -> None:
    """engine/run/handover.py frees a layer's output where these counts did not move during the next
    layer's forward: each way of keeping the memory must move one of them."""
    y = torch.randn(4, 3, dtype=torch.float64, requires_grad=True) * 2
    x = y.detach().requires_grad_(True)
    on_storage, owners, refs = holders(x)
    assert on_storage == 2 and holders(y)[:2] == (2, 1)  # y and its detached copy; nothing owns y but y
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    kept = x * w  # mul saves x itself, and its gradient accumulator owns x
    assert holders(x)[1] == owners + 2
    del kept
    assert holders(x)[1] == owners
    view = x[:, :2]
    assert holders(x)[0] == on_storage + 1
    del view
    alias = x
    assert holders(x)[2] == refs + 1
    del alias
    out = torch.sigmoid(y)  # saves its result: a tensor on that result's storage
    assert holders(out)[0] == 2
    assert holders(x) == (on_storage, owners, refs)


def test_computed_dtype_reads_through_casts_to_the_dtype_a_tensor_was_computed_in() -> None:
    """torch_api.computed_dtype reads autograd's private ``_input_metadata`` under ``ToCopyBackward0``: fails here
    if torch changes either."""
    from shardwise.engine.torch_api import computed_dtype

    x = torch.randn(3, requires_grad=True)
    assert computed_dtype((x.half() ** 2).mean().float()) == torch.float16
    assert computed_dtype((x.half() ** 2).mean().bfloat16().double()) == torch.float16
    assert computed_dtype((x**2).mean()) == torch.float32
    assert computed_dtype(torch.ones(()).half().float()) == torch.float32  # no graph: its own dtype
