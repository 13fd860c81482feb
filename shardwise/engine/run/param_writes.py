"""A trainable parameter written in place during forward: kept only by the plain one-device step.

Some forwards write their own parameters: ``nn.Embedding(max_norm=...)`` and ``nn.EmbeddingBag(max_norm=...)``
renormalise the rows they look up (``torch.embedding_renorm_``, also reached by a user's
``F.embedding(..., max_norm=...)``), and a model may clamp a weight under ``torch.no_grad()``. torch keeps the
write: the optimizer then updates the written weight. The one-device step without transforms does the same,
since its leaves share their storage with the parameters the optimizer updates. Every other step loses the write
or makes another one, without an error: ZeRO writes into a gathered or flat copy that the update does not
read, accumulation and a pipeline's micro-batches write once per micro-batch, remat writes again in the
recompute (torch then stops the backward with a raw "modified by an inplace operation"), a pipeline's other
stage keeps its own copy of a tied weight, and a precision policy's compute copy is new each step.

So outside that step the executor watches each layer's parameter leaves' version counters across its call,
as it watches its buffers', and :func:`check_param_writes` refuses a write, naming the layer, the parameter,
the module when it is an embedding with ``max_norm``, and the fix. Reading a version counter costs a
fraction of a microsecond per parameter; the one-device step reads none.

A write through ``.data`` (weight clipping written into forward: ``self.w.data.clamp_(-c, c)``) moves the
version counter of ``.data``'s own tensor, not the leaf's. So on a layer's first call (its first step on each
thread) :func:`param_contents` also takes the leaves' contents before it, and :func:`check_param_writes`
compares them after: a copy of a small leaf's bits, a fingerprint of a large one's (its bits read as
integers in rows of 4096, each column's and each row's sum, wrapping: a change of one element, or of several
all in distinct rows or all in distinct columns, is always seen; only changes that cancel in every row and
column sum are not). It reads each leaf twice and keeps no copy (a GPT-2 block's 7M float32 parameters: about
half the time of one copy on the CPU). Later calls take nothing. ZeRO's leaves, views of one flat buffer, are
compared one by one, so the message names the parameter whose contents changed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..model.chain import Layer
from ..model.embedding_options import option_fix, renorm_note
from ..model.module_call import module_fn
from ..torch_api import version_of

Key = tuple[str, str]  # (owner layer, local name): a step's leaf, a tied one under its owner
Watched = tuple[list[Key], list[torch.Tensor], list[int]]  # keys, their leaves, the leaves' versions before

# Leaves of at most this many elements are copied (compared exactly); larger ones are fingerprinted.
_COPY_LIMIT = 1 << 16
# A larger leaf's bits are read as rows of this many elements: its fingerprint is their column and row sums.
_ROW = 1 << 12
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def param_versions(layer: Layer, leaves: Mapping[Key, torch.Tensor], alone: bool) -> Watched:
    """``layer``'s parameter leaves in ``leaves`` (the stage's) with their version counters now; ``alone``:
    the layer is its stage's only one, whose leaves are all of ``leaves``. (``_version`` read inline, and no
    key built for a layer alone: this runs per layer call.)"""
    if alone:
        keys = list(leaves)
    else:
        keys = [k for local in layer.param_names if (k := layer.ties.get(local) or (layer.name, local)) in leaves]
    held = [leaves[k] for k in keys]
    return keys, held, [leaf._version for leaf in held]


def param_contents(watched: Watched) -> list[torch.Tensor | None]:
    """The contents of ``watched``'s leaves before a layer's first call, for :func:`check_param_writes`."""
    return [_contents(leaf) for leaf in watched[1]]


def check_param_writes(layer: Layer, watched: Watched, where: str,
                       contents: list[torch.Tensor | None] | None = None) -> None:
    """Refuse when ``layer``'s call wrote into a parameter of ``watched`` (its versions changed, or, given
    ``contents`` from :func:`param_contents` before the call, its contents: a write through ``.data``);
    ``where`` names the step's layout in words (``"under shard_params, remat"``)."""
    keys, held, versions = watched
    local_of = {layer.ties.get(local) or (layer.name, local): local for local in layer.param_names}
    if [leaf._version for leaf in held] == versions:
        if contents is None:
            return
        aliased = [local_of.get(k, k[1]) for k, leaf, was in zip(keys, held, contents, strict=True)
                   if was is not None and not torch.equal(_contents(leaf), was)]  # type: ignore[arg-type]
        if aliased:
            _refuse_alias_write(layer, aliased, where)
        return
    changed = [(local_of.get(k, k[1]), leaf) for k, leaf, v in zip(keys, held, versions, strict=True)
               if version_of(leaf) != v]
    written = [local for local, _ in changed]
    storages = {_storage(leaf) for _, leaf in changed}
    noted = {local: note for local in written if (note := _module_note(layer, local)) is not None}
    shared = len(written) > 1 and len(storages) == 1
    if noted and shared:
        written = list(noted)  # views of one flat buffer share a version counter: the embedding wrote
    which = f"one of its trainable parameters {written} (views of one buffer)" if shared and not noted \
        else f"its trainable parameters {written}"
    what = f" ({'; '.join(noted.values())})" if noted else ""
    fix = option_fix("max_norm") if noted else (
        "write the parameter outside the step (after each update, under torch.no_grad()), or compute the "
        "changed value from the parameter in forward without writing it"
    )
    raise ValueError(_message(layer, which, what, where, fix))


def _refuse_alias_write(layer: Layer, written: list[str], where: str) -> None:
    raise ValueError(_message(
        layer, f"its trainable parameters {written}", " (through .data or another alias, which moves no "
        "version counter of the parameter's)", where,
        "write the parameter outside the step (after each update, under torch.no_grad(); weight clipping "
        "belongs there), or compute the changed value from the parameter in forward without writing it"))


def _message(layer: Layer, which: str, what: str, where: str, fix: str) -> str:
    return (
        f"layer {layer.name!r} wrote into {which} during forward{what}: {where} the "
        "forward runs on another copy of them than the one the update reads (a gathered or flat copy, a "
        "micro-batch's or a recomputed forward's, another stage's copy of a tied weight, a compute copy), so "
        "the write would be lost or made more than once, without an error; only the one-device step without "
        f"transforms keeps it, as torch does. Instead: {fix}"
    )


def _contents(leaf: torch.Tensor) -> torch.Tensor | None:
    """``leaf``'s bits as integers, copied when small, else their fingerprint (column and row sums); None
    for a meta tensor, which holds none."""
    if leaf.is_meta:
        return None
    t = leaf.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    bits = t.view(_INT_OF_SIZE[t.element_size()])
    if bits.numel() <= _COPY_LIMIT:
        return bits.clone()
    flat = bits.reshape(-1)
    whole = flat.numel() // _ROW * _ROW
    grid = flat[:whole].view(-1, _ROW)
    # Sums in the bits' own integer type, wrapping (a changed element changes its row's and column's sum; an
    # int64 accumulator would cost several times as much on the CPU); the last partial row copied.
    return torch.cat([grid.sum(0, dtype=bits.dtype), grid.sum(1, dtype=bits.dtype), flat[whole:]])


def _storage(leaf: torch.Tensor) -> int:
    """The address of ``leaf``'s storage: views of one flat buffer (ZeRO's) share it, and their version
    counter, so a write into one of them moves every one's."""
    return leaf.untyped_storage().data_ptr()


def _module_note(layer: Layer, local: str) -> str | None:
    """``"'0' is an Embedding with max_norm=1.0, ..."`` when the module owning ``layer``'s parameter
    ``local`` writes it by its max_norm; None when it cannot be told."""
    fn = module_fn(layer.fn)
    module = getattr(getattr(fn, "replicas", None), "module", None)
    if not isinstance(module, torch.nn.Module):
        return None
    path = local.rpartition(".")[0]
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        return None
    note = renorm_note(owner)
    if note is None:
        return None
    prefix = [str(getattr(fn, "root_prefix", "")), str(getattr(fn.replicas, "prefix", "")), path]
    name = ".".join(p.strip(".") for p in prefix if p.strip(".")) or layer.name
    return f"{name!r} is {note}"
