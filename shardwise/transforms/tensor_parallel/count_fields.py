"""The model config's field a Region's head count copies, and what to change where the axis does not divide it.

A user changes the config, not a module's copy of it: Falcon's attention copies ``config.num_kv_heads`` into its
``num_kv_heads``. Not in its first layout (``new_decoder_architecture=False``) with ``multi_query=True``
(Falcon-7B's), where the count is 1 whatever ``config.num_kv_heads`` says: one key/value head that every query head
shares, which no tensor-parallel size above 1 divides; GPTBigCode's ``multi_query`` does the same. The way out there
is no other size but another attention layout, or the attention left whole.
"""

from __future__ import annotations

from torch import nn

MULTI_QUERY = "config.multi_query=True"


def config_field(module: nn.Module, attr: str, value: int) -> str:
    """The config field that makes ``module``'s count ``attr`` (of ``value``), by its name and value, or the
    multi-query flag that makes it 1; "" where it has none, or the Region names the config's own."""
    name = attr.rsplit(".", 1)[-1]
    config = getattr(module, "config", None)
    if value == 1 and getattr(config, "multi_query", None) is True:
        if getattr(config, "new_decoder_architecture", None) is False:  # Falcon's first layout
            return f"{MULTI_QUERY} with config.new_decoder_architecture=False"
        if not hasattr(config, "new_decoder_architecture"):
            return MULTI_QUERY
    copied = not attr.startswith("config.") and getattr(config, name, None) == value
    return f"config.{name}" if copied and not isinstance(getattr(config, name), bool) else ""


def undivided_count_message(path: str, attr: str, value: int, field: str, parts: int, axis: str, pattern: str) -> str:
    """The refusal of a Region's count ``value`` that the ``parts`` ranks of ``axis`` do not divide; ``field``:
    :func:`config_field`'s; ``pattern``: the plan's key for the Region."""
    copied = f" (the model's {field})" if field else ""
    said = (
        f"tensor_parallel: {path}.{attr} is {value}{copied}, which the {parts} ranks of axis {axis!r} do not divide "
        "(each rank computes whole heads)"
    )
    if not field.startswith(MULTI_QUERY):
        return f"{said}; use a tensor-parallel size that divides {value}"
    grouped = (
        f", or with the grouped layout, config.new_decoder_architecture=True and config.num_kv_heads divisible by "
        f"{parts}" if "new_decoder_architecture" in field else ""
    )
    return (
        f"{said}: a multi-query attention has one key/value head, which every query head reads, so no rank can hold "
        f"a part of the key/value heads. Leave the attention out of the plan (plan[{pattern!r}] and its "
        "projections' entries): it stays whole on every rank while the rest still splits, the model unchanged "
        "(without sequence_parallel=, which needs the attention's Region). Or build the model with "
        f"config.multi_query=False (one key/value head per query head){grouped}: another model, whose key/value "
        "projection has another shape, so a multi-query checkpoint does not load into it"
    )
