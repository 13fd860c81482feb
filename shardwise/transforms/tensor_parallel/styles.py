"""The styles a tensor-parallel plan gives to modules, by name pattern.

As in torchtitan and DTensor's ``parallelize_module``, a plan maps module path
patterns (fnmatch, on the paths ``model.named_modules()`` gives) to styles:

* :class:`Colwise`: a Linear (or a Hugging Face ``Conv1D``) split on its output
  features, bias too: each rank computes its slice of the output, which stays
  split (``output="sharded"``, the default: the input of a Rowwise or a
  vocab-parallel loss) or is gathered (``output="replicated"``). ``fused=3`` for a fused q, k, v
  projection whose module cuts three equal blocks apart (GPT-2's ``c_attn``):
  each block is split, so a rank holds its heads of q, of k and of v (blocks of
  unequal widths, or q, k and v laid out per head as GPT-NeoX's are, are refused
  on the first forward: split_watch.py). On an Embedding: split on the hidden
  dim, the output gathered (by default; ``output="sharded"`` keeps it split).
* :class:`Rowwise`: a Linear (or ``Conv1D``) split on its input features; the
  partial outputs are summed over the axis (reduce-scattered over the sequence
  under sequence parallel), then the bias, replicated, is added once. On an
  Embedding: split on the vocabulary (each rank looks up its rows, the others
  contribute zeros, and the lookups are summed).
* :class:`Region`: a module whose input enters the parallel region once
  (Megatron's f: identity forward, all-reduce backward; an all-gather of the
  sequence under sequence parallel): an attention or MLP block holding the
  Colwise / Rowwise pair. ``heads`` names the attributes that count attention
  heads (and key/value heads), which must divide by the axis size; those the
  module or a submodule holds are divided by it while the module runs (a
  forward that reshapes by its head count makes this rank's heads), a config's
  are only checked; ``local`` names int attributes each rank divides by it
  (GPT-2's ``split_size``); ``arguments`` maps the name of an argument of the module's forward that holds
  one slice per head (a bias of every head built around the layers: ALiBi's) to :class:`HeadsAlong`, and each
  call hands the module the rank's heads of it.

* :class:`PerHead`: a parameter (not a module: the plan names its path, ``"model.layers.*.self_attn.sinks"``)
  holding one value per attention head along dim 0, inside a Region whose ``heads`` count them (GPT-OSS's
  attention sinks, ``(num_attention_heads,)``). Dim 0 is cut into tp equal contiguous blocks, as the
  Colwise projections cut their heads: rank r holds, and trains, the values of its own heads. No
  communication: each rank's heads use only its slice.

* :class:`HeadsAlong`: in a Region's ``arguments``, where an argument holds its heads: along ``dim``, one
  slice per head (MPT's ``position_bias``, ``(H, 1, t)``: dim 0; Falcon's ``attention_mask`` with ALiBi folded
  in, ``(b, H, q, k)``: dim 1), or with ``folded_batch=True`` the batch and the heads flattened into that dim,
  batch-major (row ``i * H + h``: Bloom's ``alibi``, ``(b * H, 1, t)``: dim 0). At each call the Region hands its
  module the rank's heads ``[r*H/tp, (r+1)*H/tp)``, the blocks its Colwise projections cut; a size of 1 along
  the dim (a bias broadcast over the heads) is handed on whole. An argument that requires grad gets its
  gradient summed over the axis (each rank's slice reaches its own heads of the whole tensor): head_arguments.py.

A Colwise module outside any Region enters the region itself (in a sequence-parallel block it
gathers the sequence at its own input; a module that reshapes its output by the slice's length,
as BERT's attention does, is refused: sequence_gather.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

OUTPUTS = ("sharded", "replicated")


@dataclass(frozen=True)
class Colwise:
    """Split on the output features (see the module docstring)."""

    output: str | None = None  # None: "sharded" on a Linear / Conv1D, "replicated" on an Embedding
    fused: int = 1

    def __post_init__(self) -> None:
        if self.output is not None and self.output not in OUTPUTS:
            raise ValueError(f"Colwise(output={self.output!r}): choose one of {OUTPUTS}, or leave it out")
        if isinstance(self.fused, bool) or not isinstance(self.fused, int) or self.fused < 1:
            raise ValueError(
                f"Colwise(fused={self.fused!r}): the number of fused blocks is a positive int (3 for q, k, v)"
            )
        if self.fused > 1 and self.output == "replicated":
            raise ValueError(
                f"Colwise(fused={self.fused}, output='replicated'): a fused projection's gathered output would "
                "interleave the blocks' slices; keep output='sharded' (the attention splits its heads)"
            )


@dataclass(frozen=True)
class Rowwise:
    """Split on the input features (or, on an Embedding, the vocabulary); the outputs are summed."""


@dataclass(frozen=True)
class HeadsAlong:
    """Where an argument of a Region's module holds its heads (see the module docstring).

    ``dim``: the dim of one slice per head (negative counts from the end); ``folded_batch``: that dim holds the
    batch and the heads flattened, batch-major (Bloom's ``(b * H, 1, t)``); ``heads``: which of the Region's
    ``heads=`` counts it (by default the first, its query heads).

    >>> import shardwise as sw
    >>> region = sw.tp.Region(heads=("num_heads",), arguments={"alibi": sw.tp.HeadsAlong(dim=0, folded_batch=True)})
    >>> region.argument_layouts()
    {'alibi': HeadsAlong(dim=0, folded_batch=True, heads=None)}
    """

    dim: int
    folded_batch: bool = False
    heads: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"HeadsAlong(dim={self.dim!r}): the dim of the argument that holds its heads, an int")
        if not isinstance(self.folded_batch, bool):
            raise TypeError(
                f"HeadsAlong(folded_batch={self.folded_batch!r}): True where that dim holds the batch and the heads "
                "flattened, batch-major (Bloom's alibi, (b * H, 1, t)), else False"
            )
        if self.heads is not None and (not isinstance(self.heads, str) or not self.heads):
            raise TypeError(
                f"HeadsAlong(heads={self.heads!r}): the name of a count in the Region's heads=, e.g. "
                "'num_heads', or leave it out (the Region's first: its query heads)"
            )


@dataclass(frozen=True, repr=False)
class Region:
    """A module whose input enters the tensor-parallel region once (see the module docstring).
    ``arguments``: argument name -> :class:`HeadsAlong` (kept as sorted pairs, so the style stays hashable)."""

    heads: tuple[str, ...] = ()
    local: tuple[str, ...] = ()
    arguments: Mapping[str, HeadsAlong] | tuple[tuple[str, HeadsAlong], ...] = ()

    def __post_init__(self) -> None:
        for field_name in ("heads", "local"):
            value = getattr(self, field_name)
            if isinstance(value, str):
                value = (value,)
            if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v for v in value):
                raise TypeError(f"Region({field_name}={value!r}): attribute names, e.g. ('num_heads',)")
            object.__setattr__(self, field_name, tuple(value))
        pairs = tuple(self.arguments.items()) if isinstance(self.arguments, Mapping) else self.arguments
        if not isinstance(pairs, (tuple, list)) or not all(
            isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and p[0]
            and isinstance(p[1], HeadsAlong) for p in pairs
        ):
            raise TypeError(
                f"Region(arguments={self.arguments!r}): a dict of the forward's argument names to "
                "sw.tp.HeadsAlong(dim=...), e.g. {'alibi': sw.tp.HeadsAlong(dim=0, folded_batch=True)}"
            )
        if self.arguments and not self.heads:
            raise ValueError(
                f"Region(arguments={dict(pairs)!r}) without heads=: an argument's heads are cut as the Region's "
                "heads are, so name the count they are of, e.g. heads=('num_heads',)"
            )
        object.__setattr__(self, "arguments", tuple(sorted(((str(k), v) for k, v in pairs), key=lambda p: p[0])))

    def __repr__(self) -> str:
        arguments = f", arguments={self.argument_layouts()!r}" if self.arguments else ""
        return f"Region(heads={self.heads!r}, local={self.local!r}{arguments})"

    def argument_layouts(self) -> dict[str, HeadsAlong]:
        """The arguments holding one slice per head, by name."""
        return dict(self.arguments.items() if isinstance(self.arguments, Mapping) else self.arguments)


@dataclass(frozen=True)
class PerHead:
    """A parameter of one value per head on dim 0, split as the heads are (see the module docstring). A buffer
    or a frozen parameter (fixed values, such as ALiBi's slopes) stays whole in its layer, which hands the
    module its rank's rows at each call.

    ``heads`` names which of the enclosing Region's ``heads=`` counts dim 0 (``"config.num_key_value_heads"``
    for one value per key/value head); by default the Region's first, its query heads.

    Hugging Face's plans say this with a Linear's style on a 1-D parameter: GPT-OSS's
    ``"layers.*.self_attn.sinks": "local_rowwise"`` (transformers 4) and GraniteSWA's ``"colwise"`` both cut
    its one dim into tp equal contiguous blocks, which is what this does; transformers 5's GPT-OSS plan
    splits no attention at all (``sw.tp.gpt_oss_plan()`` does).
    """

    heads: str | None = None

    def __post_init__(self) -> None:
        if self.heads is not None and (not isinstance(self.heads, str) or not self.heads):
            raise TypeError(
                f"PerHead(heads={self.heads!r}): the name of a count in the Region's heads=, e.g. "
                "'config.num_key_value_heads', or leave it out (the Region's first: its query heads)"
            )


Style = Colwise | Rowwise | Region | PerHead


def gathers(style: Colwise, embedding: bool) -> bool:
    """Whether a Colwise module's output is gathered: as asked, else on an Embedding only."""
    return style.output == "replicated" or (style.output is None and embedding)
