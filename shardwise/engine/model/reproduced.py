"""Library forwards a transform reproduces, pinned to the code it was checked against.

context_parallel installs its own forward in place of a Hugging Face attention's, and expert_parallel
in place of a mixture-of-experts block's, its router's and its experts': each was checked equal to the
class's forward, in float64, by the tests, on the transformers version of ``CHECKED_ON``. A class is
recognised by its name and the module that defines it; a later transformers may change what the same
class computes (a norm added, another scale), and the reproduction would then train another model
without an error. So each reproduced method's code is compared with the code checked: its syntax tree
(names, operations, constants; not its comments, docstring, decorators or layout) hashed, against
:data:`CHECKED`. Another tree is refused, naming the class and both versions. A function a transform
relies on without reproducing it (PhiMoE's ``sparsemixer``, whose draws expert_parallel reasons about) is
pinned the same way, by its module and name.

``tests/engine/test_reproduced.py`` fails loudly on a transformers whose code differs, so that the
tests of the changed class are run again and the digest renewed (``python -m
shardwise.engine.model.reproduced`` prints the installed ones).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
import types
from typing import Any

CHECKED_ON = "5.25.0"  # the transformers the reproductions were checked against (5.24.0: the same digests)

# "module.Class.method" -> the digest of its code (see :func:`digest`) on CHECKED_ON.
CHECKED: dict[str, str] = {
    "transformers.models.gemma.modeling_gemma.GemmaAttention.forward": "2a42eefe63de3673",
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention.forward": "cc28184154d95688",
    "transformers.models.granite.modeling_granite.GraniteAttention.forward": "2a42eefe63de3673",
    "transformers.models.llama.modeling_llama.LlamaAttention.forward": "2a42eefe63de3673",
    "transformers.models.mistral.modeling_mistral.MistralAttention.forward": "a0d81d6c3802d08d",
    "transformers.models.mixtral.modeling_mixtral.MixtralAttention.forward": "a0d81d6c3802d08d",
    "transformers.models.qwen2.modeling_qwen2.Qwen2Attention.forward": "b92611f0ee02d123",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeAttention.forward": "2a42eefe63de3673",
    "transformers.models.qwen3.modeling_qwen3.Qwen3Attention.forward": "db061f327f1306ae",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention.forward": "db061f327f1306ae",
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock.forward": "bdbfb726de7333ca",
    "transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter.forward": "cdb26a08ebbce3df",
    "transformers.models.mixtral.modeling_mixtral.MixtralExperts.forward": "9918bf68fc06e950",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock.forward": "f34876bf49057052",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter.forward": "87bd1d8294101a34",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts.forward": "9918bf68fc06e950",
    "transformers.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock.forward": "3cf15f02bf830bc7",
    "transformers.models.olmoe.modeling_olmoe.OlmoeTopKRouter.forward": "87bd1d8294101a34",
    "transformers.models.olmoe.modeling_olmoe.OlmoeExperts.forward": "9918bf68fc06e950",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock.forward": "a940b30a7eac4702",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter.forward": "87bd1d8294101a34",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts.forward": "9918bf68fc06e950",
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE.forward": "46305b8693ce763d",
    "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts.forward": "9918bf68fc06e950",
    "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeMoE.forward": "46305b8693ce763d",
    "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeExperts.forward": "9918bf68fc06e950",
    "transformers.models.jamba.modeling_jamba.JambaSparseMoeBlock.forward": "0cf39531786a2753",
    "transformers.models.jamba.modeling_jamba.JambaExperts.forward": "9918bf68fc06e950",
    "transformers.models.jamba.modeling_jamba.JambaTopKRouter.forward": "41abbdadf94171b4",
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP.forward": "3aff48099a378b74",
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts.forward": "d97209ad97d09476",
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter.forward": "cb3a9fd4e08051a8",
    "transformers.models.phimoe.modeling_phimoe.PhimoeSparseMoeBlock.forward": "80929cb6145c9d1c",
    "transformers.models.phimoe.modeling_phimoe.PhimoeTopKRouter.forward": "6814f0bc50c99739",
    "transformers.models.phimoe.modeling_phimoe.PhimoeExperts.forward": "9918bf68fc06e950",
    # Read, not reproduced (expert_parallel does not take DBRX): each token's experts from its own row, indices and
    # weights (engine/model/token_wise.py), so context and sequence parallel run it on a part of the sequence.
    "transformers.models.dbrx.modeling_dbrx.DbrxExperts.forward": "5d594cf347303e65",
    "transformers.models.phimoe.modeling_phimoe.sparsemixer": "728a8e64e92741cb",
}


def key(cls: type | types.ModuleType, method: str = "forward") -> str:
    """``module.Class.method``, or ``module.function`` for a function a module defines (``cls`` the module)."""
    if isinstance(cls, types.ModuleType):
        return f"{cls.__name__}.{method}"
    return f"{cls.__module__}.{cls.__qualname__}.{method}"


def digest(cls: type | types.ModuleType, method: str = "forward") -> str:
    """sha256 of the syntax tree of ``cls.method`` as defined (decorators unwrapped), without its
    docstring and decorators: what the code computes, not how it is laid out or commented."""
    try:
        return _digest(inspect.unwrap(getattr(cls, method)))
    except (OSError, TypeError):  # no source to read (a method made at run time): not the checked code
        return "unreadable"


@functools.cache  # per function object: a method replaced on its class is read again
def _digest(fn: Any) -> str:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except SyntaxError:  # the lines of a lambda inside a longer expression
        return "unreadable"
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        # A lambda (``Class.forward = lambda self, x: ...``): getsource gives the statement it is in.
        lambdas = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda)]
        return "unreadable" if len(lambdas) != 1 else hashlib.sha256(
            ast.dump(lambdas[0], annotate_fields=False).encode()).hexdigest()[:16]
    node.decorator_list = []
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(node, annotate_fields=False).encode()).hexdigest()[:16]


def same_code(cls: type, checked: dict[str, str], method: str = "forward") -> bool:
    """Whether ``cls``, a transformers class defining ``method`` itself, has the code of one of ``checked``
    (class name -> defining module; each in :data:`CHECKED`): another model's copy of a checked class
    (Hugging Face's "Copied from"), which a reproduction of that code computes as it does."""
    if not cls.__module__.startswith("transformers.") or method not in vars(cls):
        return False
    digests = {CHECKED.get(f"{module}.{name}.{method}") for name, module in checked.items()} - {None}
    return bool(digests) and digest(cls, method) in digests


def check_reproduced(cls: type | types.ModuleType, who: str, where: str, method: str = "forward") -> None:
    """Refuse ``cls`` where its ``method`` is not the code ``who`` checked its reproduction against."""
    want = CHECKED.get(key(cls, method))
    if want is None:
        raise AssertionError(f"{key(cls, method)} is reproduced but has no checked digest")  # a table out of date
    if digest(cls, method) == want:
        return
    installed = _installed()
    what = (f"{cls.__name__}.{method}, which is" if isinstance(cls, types.ModuleType)
            else f"a {cls.__name__} whose {method} is")
    how = ("replaced or edited in this process" if installed == CHECKED_ON
           else f"on transformers {installed}; it was checked against transformers {CHECKED_ON}")
    raise ValueError(
        f"{who}: {where} is {what} not the code {who} reproduces ({how}): what "
        f"this code computes otherwise would be left out without an error. Use transformers=={CHECKED_ON} "
        f"(or a shardwise release checked against yours) and the class as it is, or leave {who} out"
    )


def _installed() -> str:
    try:
        import transformers
    except ImportError:  # pragma: no cover - a reproduced class comes from transformers
        return "?"
    return str(transformers.__version__)


def installed_digests() -> dict[str, Any]:
    """The digest of every reproduced method on the installed transformers (None: absent there)."""
    import importlib

    out: dict[str, Any] = {}
    for name in CHECKED:
        module, cls_name, method = name.rsplit(".", 2)
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            out[name] = None
            continue
        out[name] = digest(cls, method)
    return out


if __name__ == "__main__":
    for name, value in installed_digests().items():
        print(f'    "{name}": "{value}",')
