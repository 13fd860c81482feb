"""The library forwards context_parallel and expert_parallel reproduce are pinned to the code they were
checked against (engine/model/reproduced.py): a transformers that changed one fails here, loudly, and the
transforms refuse it rather than train another model without an error."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.engine.model import reproduced

T = pytest.importorskip("transformers", reason="the [hf] extra (pip install -e '.[hf]') is not installed")


def test_every_reproduced_forward_is_the_code_it_was_checked_against() -> None:
    """If this fails, transformers changed a class a transform reproduces: run that transform's tests for
    the class on the new version, read the diff of its code, and renew the digest
    (``python -m shardwise.engine.model.reproduced``), or stop reproducing it."""
    installed = reproduced.installed_digests()
    changed = {name: (want, installed[name]) for name, want in reproduced.CHECKED.items() if installed[name] != want}
    assert not changed, f"transformers {T.__version__} (checked: {reproduced.CHECKED_ON}) changed: {changed}"


def _compiled(tmp_path: Any, name: str, source: str) -> Any:
    """Class ``C`` of a module written from ``source`` (inspect reads a class's code from its file)."""
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.C


def test_the_digest_reads_what_the_code_computes_not_its_layout(tmp_path: Any) -> None:
    plain = _compiled(tmp_path, "plain", """
        class C:
            def forward(self, x):
                return x * 2
    """)
    commented = _compiled(tmp_path, "commented", '''
        import functools
        class C:
            @functools.lru_cache
            def forward(self, x):
                """Doubles."""
                # twice x
                return (x *
                        2)
    ''')
    other = _compiled(tmp_path, "other", """
        class C:
            def forward(self, x):
                return x * 3
    """)
    assert reproduced.digest(plain) == reproduced.digest(commented) != reproduced.digest(other)


def _changed(method: Any) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:  # what a later version might add
        out = method(self, *args, **kwargs)
        return out
    return forward


def test_context_parallel_refuses_an_attention_whose_code_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    cfg = T.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    chain, _ = sw.functionalize(T.LlamaForCausalLM(cfg), units=LlamaDecoderLayer, example_input=torch.zeros(1, 4,
                                                                                                             dtype=torch.long))
    step = sw.train_step(chain, lambda out, y: out.logits.sum(), sw.optim.sgd(0.1))
    monkeypatch.setattr(LlamaAttention, "forward", _changed(LlamaAttention.forward))
    with pytest.raises(ValueError, match=r"context_parallel: .*self_attn is a LlamaAttention whose forward is not "
                                         r"the code context_parallel reproduces \(replaced or edited in this process\)"
                                         r".*Use transformers==5\.25\.0"):
        sw.context_parallel(step, "cp")


def _mixtral() -> Any:
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    cfg = T.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          router_jitter_noise=0.0, experts_implementation="eager", bos_token_id=0, eos_token_id=0)
    model = T.MixtralForCausalLM(cfg)
    return model, MixtralDecoderLayer


@pytest.mark.parametrize("part", ["MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts"])
def test_expert_parallel_refuses_a_block_router_or_experts_whose_code_changed(
        part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.mixtral import modeling_mixtral

    model, layer = _mixtral()
    cls = getattr(modeling_mixtral, part)
    monkeypatch.setattr(cls, "forward", _changed(cls.forward))
    chain, _ = sw.functionalize(model, units=layer, example_input=torch.zeros(1, 4, dtype=torch.long))
    step = sw.train_step(chain, lambda out, y: out.logits.sum(), sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=rf"expert_parallel: .*is a {part} whose forward is not the code "
                                         "expert_parallel reproduces"):
        sw.expert_parallel(step, "ep")


def test_expert_parallel_refuses_experts_of_another_class() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class ScaledExperts(MixtralExperts):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return 2 * super().forward(*args, **kwargs)

    model, layer = _mixtral()
    block = model.model.layers[0].mlp
    swapped = ScaledExperts(model.config)
    swapped.load_state_dict(block.experts.state_dict())
    block.experts = swapped
    chain, _ = sw.functionalize(model, units=layer, example_input=torch.zeros(1, 4, dtype=torch.long))
    step = sw.train_step(chain, lambda out, y: out.logits.sum(), sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"experts is a ScaledExperts .*not the MixtralSparseMoeBlock's own "
                                         r"MixtralExperts"):
        sw.expert_parallel(step, "ep")


def test_a_forward_replaced_by_a_lambda_has_a_digest_of_its_own(tmp_path: Any) -> None:
    """``Class.forward = lambda self, x: ...`` (a common monkeypatch): getsource gives the assignment, which is
    no function definition; the digest was a bare AssertionError, which stopped tensor parallel with sequence
    parallel and context parallel on a model with such a class, whatever they reproduced."""
    doubled = _compiled(tmp_path, "doubled", """
        class C:
            pass
        C.forward = lambda self, x: x * 2
    """)
    tripled = _compiled(tmp_path, "tripled", """
        class C:
            pass
        C.forward = lambda self, x: x * 3
    """)
    twice = _compiled(tmp_path, "twice", """
        class C:
            pass
        C.forward, C.other = (lambda self, x: x), (lambda self, x: x)
    """)
    assert reproduced.digest(doubled) != reproduced.digest(tripled)
    assert "unreadable" not in (reproduced.digest(doubled), reproduced.digest(tripled))
    assert reproduced.digest(twice) == "unreadable"  # two lambdas on the line: which one is not known
