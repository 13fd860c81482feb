"""A batch and its slices: ``(inputs, targets)`` pytrees cut along their batch dim.

A rank of a data-parallel axis takes its slice of the global batch, and a
micro-batch its slice of the rank's; every tensor leaf must have the batch dim
and divide evenly, or the error names the tensor and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import optree
import torch


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A batch is ``(inputs, targets)``: inputs feed the chain, targets the loss. A dict (a Hugging
    Face batch such as ``{"input_ids", "attention_mask", "labels"}``) is all inputs: the model
    computes its own loss, and loss_fn gets ``(output, None)``."""
    if isinstance(batch, Mapping):
        return batch, None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            f"a batch must be a pair (inputs, targets) or a dict of inputs, got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            + "; inputs feed the chain and targets go to loss_fn(output, targets)"
        )
    return batch[0], batch[1]


def split_over(
    tree: Any, parts: int, index: int, what: str, whole: tuple[int, str] | None = None
) -> Any:
    """Slice ``index`` of ``parts`` equal slices along dim 0 of every tensor in ``tree``.

    ``whole``: (n, why) when the global batch is cut n ways in all (data-parallel ranks x
    micro-batches), so the fix names the multiple it needs, not this cut's ``parts``."""
    multiple, why = whole if whole is not None else (parts, "")
    rows = {t.shape[0] for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if parts > 1:
        _refuse_per_row_lists(tree, what)
    if parts > 1 and len(rows - {1}) > 1:  # (one row beside more: the broadcast case, refused in cut below)
        _refuse_other_rows(tree, what)

    def cut(path: tuple[Any, ...], t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            where = "".join(f"[{k!r}]" for k in path)
            # Not passed whole to every part: a list of per-row values (strings) flattens to such leaves.
            raise ValueError(
                f"{what}: every batch leaf must be a tensor with a batch dim to cut, but (inputs, targets){where} is "
                f"{t!r:.60} ({type(t).__name__}). A value that is the same for every row (a flag such as "
                "return_dict=True) does not belong in the batch: set it where the model reads it (its config, "
                "or a wrapper module's forward); per-row values must be tensors with the batch dim first; a count "
                "over the whole batch (Hugging Face's num_items_in_batch) is what train_step(tokens=...) computes "
                "per part and sums"
            )
        if t.shape[0] % parts:
            where = "".join(f"[{k!r}]" for k in path)
            others = sorted(rows - {t.shape[0]})
            if t.shape[0] == 1 and others:  # one row for all: broadcast by the model, cut here like the rest
                raise ValueError(
                    f"{what}: {where or 'the batch'} has one row (shape {tuple(t.shape)}) beside tensors of "
                    f"{others[0]} rows: a tensor the model broadcasts over the rows (Hugging Face takes position_ids "
                    "of shape (1, seq)) is cut with the rows like every batch tensor, and one row does not divide "
                    f"into {parts} parts; expand it to the batch first (t.expand({others[0]}, *t.shape[1:]))"
                )
            raise ValueError(
                f"{what}: batch size {t.shape[0]} ({where or 'the batch'}: a tensor of shape {tuple(t.shape)}) does "
                f"not divide into {parts} equal parts; use a global batch size that is a multiple of "
                f"{multiple}{why}"
            )
        size = t.shape[0] // parts
        return t[index * size : (index + 1) * size]

    return optree.tree_map_with_path(cut, tree)


def _batch_rows(tree: Any) -> int | None:
    """The batch's rows: the first dim most of the inputs' tensors have (the smaller on a tie; one aside)."""
    inputs = tree[0] if isinstance(tree, (tuple, list)) and len(tree) == 2 else tree
    sizes = [t.shape[0] for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0
             and t.shape[0] != 1]
    return min(set(sizes), key=lambda n: (-sizes.count(n), n)) if sizes else None


def _fewest_rows(tree: Any) -> int | None:
    """The smallest first dim of the inputs' tensors (one aside) where every batch tensor's first dim is a multiple
    of it; else None."""
    inputs = tree[0] if isinstance(tree, (tuple, list)) and len(tree) == 2 else tree
    sizes = {t.shape[0] for t in optree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0} - {1}
    every = {t.shape[0] for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0} - {1}
    fewest = min(sizes, default=None)
    return fewest if fewest is not None and all(n % fewest == 0 for n in every) else None


def _refuse_per_row_lists(tree: Any, what: str) -> None:
    """Refuse a list (or tuple) in the batch holding one entry a row: dicts of the same keys whose tensors are not
    the batch's rows (torchvision's and DETR's detection targets, ``[{"boxes": ..., "labels": ...} for each
    image]``). The cut takes dim 0 of every tensor, not a list's entries: each part would get every row's entry,
    each cut in pieces (the second rank pairing its images with the first's targets), and where every entry's length
    is a multiple of the parts no size check sees it. Entries whose tensors all have as many values as the batch has
    rows (4 boxes an image at a batch of 4, by chance) look like views of the batch (two augmented views at a batch of
    2): cut as views, with a warning. Not seen: a list of bare tensors (a tuple of a batch's parts, input_ids beside
    pixel_values, looks alike at a batch of 2)."""
    rows = _batch_rows(tree)
    if rows is None or rows < 2:
        return
    found: list[tuple[str, str]] = []
    alike: list[tuple[str, str]] = []  # records whose tensors all have the rows: views of the batch, or by chance

    def visit(path: str, node: Any, top: bool) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                visit(f"{path}[{key!r}]", value, False)
        elif isinstance(node, (tuple, list)):
            entries = list(node)
            # Entries of their own sizes: a per-row list (two views of the batch, each a dict of the rows' tensors,
            # are not: every tensor has the rows)
            found_leaves: list[Any] = optree.tree_leaves(node)  # type: ignore[arg-type]
            leaves = [t for t in found_leaves if isinstance(t, torch.Tensor)]
            own_sizes = any(t.dim() == 0 or t.shape[0] != rows for t in leaves)
            # Records of one kind, dicts of the same keys (a tuple of a batch's parts, such as input_ids beside
            # pixel_values of 2 images a row, holds tensors or dicts of other keys: at a batch of 2 it is 2 long)
            records = all(isinstance(e, Mapping) and e and set(e) == set(entries[0]) for e in entries)
            if not top and len(entries) == rows and own_sizes and records:
                found.append((path, type(node).__name__))
                return
            if not top and len(entries) == rows and records and leaves:
                alike.append((path, type(node).__name__))
            for i, value in enumerate(entries):
                visit(f"{path}[{i}]", value, False)

    visit("", tree, True)
    if alike and not found:
        path, container = alike[0]
        warnings.warn(
            f"{what}: (inputs, targets){path} is a {container} of {rows} dicts of the same keys beside {rows} rows, "
            f"and every tensor in them has {rows} rows too: taken as {rows} views of the batch (each dict the rows' "
            "tensors, as two augmented views in contrastive learning), each cut along its rows. If it is instead "
            "one entry a row (detection targets, [{'boxes': ..., 'labels': ...} for each image], each with as many "
            "boxes as the batch has rows by chance), each part would get every row's entry cut in pieces and the "
            "loss would be another than the single-device step's: give per-row values as tensors with the rows "
            "first, padded to one number a row",
            UserWarning, stacklevel=3,
        )
    if found:
        path, container = found[0]
        raise ValueError(
            f"{what}: (inputs, targets){path} is a {container} of {rows} entries, one a row "
            f"(a dict each: detection targets such as [{{'boxes': ..., 'labels': ...}} for each image]?), beside "
            f"{rows} rows in the inputs. Every transform that cuts the batch cuts dim 0 of each tensor, not the "
            "entries of a list: each part would get every row's entry, each cut in pieces, and the loss would be "
            "another than the single-device step's. Give per-row values as tensors with the rows first, padded to "
            "one number a row (boxes of shape (rows, most boxes, 4) with a count or a mask of the real ones)"
        )


def _refuse_other_rows(tree: Any, what: str) -> None:
    """Refuse a batch tensor whose first dim is neither the batch's rows nor a multiple of them (one row aside: the
    broadcast case, refused where it is cut). Cut along dim 0 alike, a tensor that is no per-row value (a table of
    class prototypes, class weights, detection targets of several boxes an image) would reach each part cut in
    pieces, and the loss would be another (the ranks' mean of losses with part of the table each). A multiple is
    several values a row, laid out row by row (Hugging Face's pixel_values of several images a row: LLaVA's), which
    the cut keeps together; a shared table of such a size cannot be told from it, so the cut warns. The rows: the
    first dim most of the inputs' tensors have (the smaller on a tie). Where the fewest an input has divides every
    tensor's, they may be the rows instead (5 captions an image, laid out image by image: pixel_values of 8 beside
    input_ids of 40) as surely as a shared table (10 prototypes beside 40 rows): refused, naming both readings."""
    rows = _batch_rows(tree)
    if rows is None:
        return
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    others = [("".join(f"[{k!r}]" for k in path), t.shape[0]) for path, t in zip(paths, leaves, strict=True)
              if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] not in (1, rows) and t.shape[0] % rows]
    several = [(where, n) for where, n in (("".join(f"[{k!r}]" for k in path), t.shape[0])
                                            for path, t in zip(paths, leaves, strict=True)
                                            if isinstance(t, torch.Tensor) and t.dim() > 0)
               if n not in (1, rows) and n % rows == 0]
    if not others and several:
        # Several values a row, or a table shared by every row whose size happens to be a multiple of the rows (16
        # prototypes beside 8 rows): the shapes cannot tell, and the cut takes the first. Said once per place.
        where, n = several[0]
        warnings.warn(
            f"{what}: (inputs, targets){where} has {n} beside {rows} rows in the inputs: taken as {n // rows} values "
            "a row, laid out row by row, and cut with the rows (Hugging Face's pixel_values of several images a "
            "row). A table shared by every row (class prototypes, a memory the model attends over) would be cut in "
            "pieces and the loss be another than the single-device step's: keep such a table out of the batch (in "
            "loss_fn, a closure, or in the model, a buffer); give several values a row the shape (rows, k, ...) to "
            "be sure",
            UserWarning, stacklevel=2,
        )
    if not others:
        return
    fewest = _fewest_rows(tree)
    if fewest is not None and fewest < rows:
        # The fewest an input has divides every tensor's: either those are a table shared by the rows (class
        # weights, prototypes) or they are the rows, the others several values a row laid out row by row (5
        # captions an image). The shapes cannot tell: cut either way, the other would train another model.
        sized = [("".join(f"[{k!r}]" for k in path), t.shape[0]) for path, t in zip(paths, leaves, strict=True)
                 if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] != 1]
        few = [w for w, n in sized if n == fewest]
        named = ", ".join(f"(inputs, targets){w}" for w in few[:4])
        raise ValueError(
            f"{what}: {named} {'has' if len(few) == 1 else 'have'} {fewest} beside {rows} rows in the inputs, and "
            f"{rows} is a multiple of {fewest}: the batch's rows cannot be told from its shapes. Either {named} is a "
            "value shared by every row (a table of class prototypes, class weights), which does not belong in the "
            "batch (every batch tensor is cut along dim 0 with the rows: each part would get a piece of it): keep it "
            f"in loss_fn (a closure) or in the model (a buffer); or it holds the batch's {fewest} rows and the other "
            f"tensors {rows // fewest} values a row, laid out row by row ({rows // fewest} captions an image): give "
            f"those the shape ({fewest}, {rows // fewest}, ...) (t.view({fewest}, {rows // fewest}, *t.shape[1:])) "
            "and the cut keeps each row's values together"
        )
    named = ", ".join(f"(inputs, targets){where} has {n}" for where, n in others[:4])
    raise ValueError(
        f"{what}: a batch tensor's first dim is neither the batch's rows nor a multiple of them: {named} beside "
        f"{rows} rows in the inputs. Every batch tensor is cut along dim 0 with the rows, so a tensor that is no "
        "per-row value would reach each part cut in pieces, and the loss would be another than the single-device "
        "step's. A value shared by every row (a table of class prototypes, class weights) does not belong in the "
        "batch: keep it in loss_fn (a closure) or in the model (a buffer); values of their own number a row "
        "(detection targets' boxes) go in tensors padded to one number a row; a time-major batch ((seq, batch, ...), "
        "nn.LSTM's default batch_first=False) holds the sequence on dim 0: give it the rows first"
    )
