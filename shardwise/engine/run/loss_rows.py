"""Whether ``loss_fn`` is a mean over what the step cuts (the batch's rows, each sequence's tokens), or keeps
its ``tokens=`` mode's contract: probed once.

A step that cuts the batch (shard_params' shares, a split's batch axes such as expert parallel's,
accumulation, a pipeline's micro-batches) calls ``loss_fn`` on each part and takes the mean of the parts'
losses. That is the single-device step's loss only when ``loss_fn`` returns the mean of per-row terms
(torch's default ``reduction="mean"``): a sum over the rows (``reduction="sum"``: the step's loss and
gradients shrink by the number of parts), a mean normalised by anything but the rows (a class-weighted
cross-entropy, a pad id as ``ignore_index``) or a loss over the whole batch (a contrastive loss whose
negatives are the batch's other rows) train another model, without an error. A step that cuts each
sequence into parts (context parallel) takes the mean of the parts' losses likewise: it needs the mean
of per-token terms (a loss summed over the tokens, or per sequence, shrinks by the number of parts).
``batch_cut.refuse_padded_mean`` sees one such case in the batch (labels of -100); this probe sees the
loss itself. Under ``train_step(tokens="sum")`` the step sums loss_fn's (summed loss, count) over the
parts and divides the global sum by the global count: both must add up over the parts (a mean returned
with its count does not). Under ``tokens=count_fn`` it multiplies loss_fn's value by the part's count,
sums, and divides by the global count: loss_fn must be the mean over the counted tokens (loss x count
adds up over the parts; a sum, or a mean over other tokens than counted, does not). Under
``tokens="per_shard_mean"`` the step takes the parts' means knowingly: not probed.

On the step's first call (once per layout and rank: ``step/batch_cut.py`` says when it applies), each
rank that computes a loss evaluates ``loss_fn`` once more, under ``no_grad``, on the first rows of its
first micro-batch's output and targets (4 rows, else 2) and on their two halves (of 4 rows, each of
the three ways to halve them: a loss over the batch's hardest rows, OHEM's, agrees on one where its
chosen rows fall one a half), before its own call on the micro-batch: the output is the model's, so
nothing is run again (dropout in the model cannot differ), and the probe's few rows take less memory
than the loss of the whole micro-batch that follows. Where the
step cuts each sequence, the probe also evaluates it on the halves of those rows' tokens (of their first
even number of tokens), along the dim the split cuts the targets on; where the rows are not cut, on the
tokens' halves alone. A mean of per-row (per-token) terms gives the mean of the halves' losses to
rounding; a sum gives twice it; an in-batch contrastive loss another value. A micro-batch of one row
(micro-batch size 1, common in fine-tuning) has no halves: the probe evaluates ``loss_fn`` on the row
and on the row repeated twice along its row dims (output and targets; the inputs too, for a count
function), whose mean is the row's value for a mean of per-row terms and twice it for a sum. Where that
agrees, the row (its output, inputs and targets, detached) is kept and probed with the next one-row
micro-batch's, this step's or a later one's, as two rows (each output leaf's one row dim and the targets' and
inputs' dim 0 joined; not where a leaf has two row dims): a weighted mean, or a loss over the whole batch (the
rows' largest error, a mean plus a variance over the rows), the same on a repeated row, trained another model
there, without an error (0.6 relative loss error, a pipeline of one-row micro-batches). Under ``tokens="sum"``
the whole's summed loss and count must be the halves' sums; under a count function the whole's loss x count
the sum of the halves' (a part that counts no token adds 0, as in the step). Beyond a tolerance of the
dtype (1e-6 relative in float64, else 2e-2: matmuls inside a loss may round differently on fewer rows),
the step is refused, naming the mode, what loss_fn returned and the fix.

Which dims of the output hold the rows: of one tensor whose dim 0 alone has the rows' size, dim 0; else
those whose size follows the rows in the chain's output on half the rows (of one row, on the row
repeated twice), run on fake tensors (no arithmetic): a rows x rows similarity matrix (CLIPModel's
``logits_per_text``) is cut on both, a sequence as long as the batch is not, nor is a tensor whose dim 0
merely equals the rows (prototypes returned beside the features). Where the chain cannot run on fake
tensors, or under a split (whose layers run on fake tensors only inside its predicting block, and note
what they ran: tensor parallel's split head), dim 0 where it is the only dim of the rows' size in every
tensor. Which dim holds the tokens: the targets' sequence dim, where no other dim of any tensor has the
tokens' count (dim 0 aside, where it holds the rows). So a feature dim is never cut (a vocabulary, or a
tensor-parallel rank's slice of it, of the rows' or the tokens' count makes the dims ambiguous: not
probed). A transformers output holding the loss its model computed (over the part it is called on) is refused
before any probing where that loss is known to be no mean over the rows, whatever loss_fn makes of it: beside a
rows x rows matrix (``logits_per_image``: CLIPModel's contrastive loss), or from a CTC head summing over the rows
(``LossProbe.own_loss``). A loss_fn whose values the halving leaves unchanged otherwise reads such a loss too:
refused beside a rows x rows matrix the prediction found, else not probed. Not probed (and not refused): an
output where the rows cannot be told (no dim-0 rows in a chain that cannot run on fake tensors); a
``loss_fn`` that raises on fewer rows, returns no scalar (under
``tokens="sum"``, no pair of a scalar and a count), draws random numbers (what it drew is set back) or
issues a collective. Where a micro-batch of one row has a dim of size 1 beside its rows that cannot be
told from them, the probe waits for a micro-batch of other shapes (more rows) rather than ending. The
probe runs inside ``no_mesh`` (no collective runs there, not even one naming its mesh: it raises at
once, so no rank waits on another)
and ``in_layer.probing_loss``, where a split's loss functions compute without the other ranks: the
vocabulary-parallel cross-entropy on logits split over the vocabulary reduces a per-row term of the
rank's own slice as it reduces its terms (how ``loss_fn`` reduces the rows shows all the same), and
tensor parallel's loss leaves its record of the split head for the step's own call. A probe whose values
are not finite, or all zero (or whose counts all are), says nothing: it runs again on the next call.

The rank that finds a difference raises; every rank computing a loss finds it alike for a sum, and the
others stop as on any error of ``loss_fn`` (a launch aborts them, torchrun ends the job).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from ...collectives.mesh_context import no_mesh
from ..model import host_random
from ..stack import in_layer
from .cut_graphs import ReadsOutsideChain, refuse_fake_loss
from .own_loss_count import OwnCount, refuse_another_count

PROBE_ROWS = 4  # the rows probed where the micro-batch has them (halves of 2), else 2 (halves of 1)
OTHER_HALVES = (((0, 2), (1, 3)), ((0, 3), (1, 2)))  # of 4 rows, beside (0, 1) | (2, 3)
RTOL_FLOAT64 = 1e-6
# float32 where its matmuls are exact float32 (the same rows give the same values; only the loss's own sums round,
# pairwise): a class-weighted cross-entropy (1.2e-3 off a mean) is seen
RTOL_FLOAT32 = 1e-4  # (a mean near zero of terms that cancel, a KL of near-equal distributions, rounds ~3e-5 apart)
RTOL = 2e-2  # below: bf16 rounds each loss to 3 digits; TF32 / bf16 matmuls may round by rows


@dataclass(frozen=True)
class ProbeCut:
    """What cuts a rank's micro-batch where the step probes ``loss_fn``, in words: ``rows``, what cuts
    its rows (shard_params' shares, a split's batch axes, micro-batches; None: nothing), and
    ``sequence``, what cuts each of its sequences into parts (context parallel; None: nothing), along
    ``sequence_dim`` of the inputs and targets; ``tokens``, the step's ``train_step(tokens=...)``:
    None (``loss_fn`` is a mean), ``"sum"`` or a count function (the loss is weighed by counted tokens)."""

    rows: str | None
    sequence: str | None = None
    sequence_dim: int = 1
    tokens: str | Callable[[Any, Any], Any] | None = None


@dataclass(frozen=True)
class Measured:
    """``loss_fn`` on the first ``rows`` rows (``whole``) and on two halves of them (``halves``), in float64:
    halves of the rows (``along="rows"``; ``"rows 0 and 2 | 1 and 3"`` another halving of 4), or of their
    first ``tokens`` tokens (``along="tokens"``); of a
    micro-batch of one row, the row repeated twice (``whole``) and the row itself, twice (``halves``:
    ``along="repeat"``). Under ``tokens="sum"`` the values are the summed losses, and ``counts`` (whole,
    halves) the counts loss_fn returned; under a count function (``mode="count"``) the mean losses, and
    ``counts`` what it counted."""

    rows: int
    whole: float
    halves: tuple[float, float]
    rtol: float
    along: str = "rows"
    tokens: int = 0
    mode: str = "mean"  # "mean" (tokens=None), "sum" (tokens="sum") or "count" (tokens=count_fn)
    counts: tuple[float, float, float] | None = None

    @property
    def mean(self) -> float:
        return (self.halves[0] + self.halves[1]) / 2

    @property
    def total(self) -> float:
        return self.halves[0] + self.halves[1]

    @property
    def weighed(self) -> tuple[float, float, float]:
        """Under a count function: each loss times its count (0 where nothing was counted: the step's own)."""
        assert self.counts is not None
        (cw, c0, c1), (h0, h1) = self.counts, self.halves
        return (self.whole * cw if cw else 0.0, h0 * c0 if c0 else 0.0, h1 * c1 if c1 else 0.0)

    def _close(self, a: float, b: float, *scale: float) -> bool:
        return abs(a - b) <= self.rtol * max(abs(s) for s in scale)

    @property
    def agrees(self) -> bool:
        """Whether loss_fn keeps the step's contract: a mean (the whole's is the halves' mean); under
        tokens='sum', a sum (the whole's is the halves' sum, and so is its count); under a count
        function, a mean over the counted tokens (loss x count adds up over the halves)."""
        if self.mode == "count":
            return _weighed_adds_up(self)
        values = (self.whole, *self.halves)
        if self.mode == "sum":
            counted = self.counts is None or self._close(self.counts[0], self.counts[1] + self.counts[2], *self.counts)
            return counted and self._close(self.whole, self.total, *values)
        return self._close(self.whole, self.mean, *values)

    @property
    def is_sum(self) -> bool:
        """Whether the whole's value is the sum of the halves' (a sum over what was halved)."""
        return self._close(self.whole, self.total, self.whole, *self.halves)

    @property
    def is_mean(self) -> bool:
        """Whether the whole's value is the mean of the halves' (a mean over what was halved)."""
        return self._close(self.whole, self.mean, self.whole, *self.halves)


@dataclass(frozen=True)
class LossProbe:
    """The probe of one rank's step: ``cut`` says what cuts the batch; ``done`` marks the layout probed
    (the step's later calls run without it); ``predict(inputs)`` gives the shape of each leaf of the
    chain's output on ``inputs`` (on fake tensors; None where the chain cannot run on them)."""

    cut: ProbeCut
    done: Callable[[], None]
    predict: Callable[[Any], Sequence[torch.Size | None] | None]
    # A module of the model whose own loss is no mean over the rows (a Hugging Face CTC head summing over them):
    # what it computes and the fix, in words; None where nothing is known.
    own_loss: tuple[str, str] | None = None
    later: set[tuple[Any, ...]] = field(default_factory=set)  # the inputs' shapes that said LATER
    # A micro-batch of one row whose probe (the row repeated) agreed: (output, inputs, targets), detached, kept to
    # be probed with the next one-row micro-batch's as two rows (_two_rows).
    held: list[tuple[Any, Any, Any]] = field(default_factory=list)
    # What the model's own loss counts (a causal LM's shifted labels), to hold a count function to (own_loss_count.py)
    own_count: OwnCount | None = None

    def check(
        self, loss_fn: Callable[[Any, Any], Any], output: Any, inputs: Any, targets: Any,
        generators: Sequence[torch.Generator], restore: bool,
    ) -> None:
        """Probe ``loss_fn`` on ``output`` and ``targets`` (a micro-batch of ``inputs``' rows) and refuse a
        loss that does not keep the step's contract. ``generators``: the ones a draw would advance;
        ``restore``: whether this rank may set them back (it holds them, or they are its own)."""
        model_loss = _model_loss(output)
        if model_loss is not None and callable(self.cut.tokens):
            try:
                refuse_another_count(None if self.own_count is None else self.own_count.model, loss_fn,
                                     self.cut.tokens, output, model_loss, inputs, targets)
            except ValueError:
                self.done()
                raise
        if self.cut.rows is not None and model_loss is not None:
            # The model computed its loss itself, over the part it is called on: refused where it is known to be
            # no mean over the rows (a contrastive model's: its output compares rows with rows; a CTC head summing),
            # whatever loss_fn makes of it (a regularizer added, a (loss x n, n) pair) and however few the rows.
            mixed = tuple(p for p in _leaf_paths(output) if p.rsplit(".", 1)[-1].startswith("logits_per_"))
            if mixed or self.own_loss is not None:
                self.done()
                raise ValueError(own_loss_refusal(self.cut, OwnLoss(mixed), self.own_loss, seen="output"))
        shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in optree.tree_leaves(inputs))
        if shapes in self.later:
            return
        sequence_dim = self.cut.sequence_dim if self.cut.sequence is not None else None
        # The prediction runs the chain's layers (on fake tensors): what they draw from Python's random or
        # numpy's is set back too, or the compute's own draws would depend on whether this step probed.
        host = host_random.capture()
        try:
            found = measure(loss_fn, output, inputs, targets, generators, restore, self.predict,
                            rows_cut=self.cut.rows is not None, sequence_dim=sequence_dim, tokens=self.cut.tokens)
        finally:
            if restore:
                host_random.restore(host)
        if found is LATER:
            self.later.add(shapes)
        if found in (RETRY, LATER):
            return
        if isinstance(found, Measured) and found.agrees and found.along == "repeat" and self.cut.tokens != "sum":
            # One row repeated agrees with a mean of per-row terms, and with a max, a median or a variance over
            # the rows too: probed again on two rows, this one and the next one-row micro-batch's (this step's
            # or a later one's: loss_fn reads only outputs and targets).
            pair = _two_rows(self.held[0], (output, inputs, targets), self.predict) if self.held else None
            if pair is None:
                self.held[:] = [_detached((output, inputs, targets))]
                return
            self.held.clear()
            both = measure(loss_fn, *pair, generators, restore, self.predict, rows_cut=True, tokens=self.cut.tokens)
            if both in (RETRY, LATER):
                return
            found = dataclasses.replace(both, along="pair") if isinstance(both, Measured) else found
        self.done()
        if isinstance(found, OwnLoss) and self.cut.rows is not None and found.mixed:
            raise ValueError(own_loss_refusal(self.cut, found, None))
        if isinstance(found, Measured) and not found.agrees:
            raise ValueError(refusal(self.cut, found))


def _model_loss(output: Any) -> Any:
    """The ``loss`` a Hugging Face model's output holds (a ModelOutput's: the model computed it), when not None;
    a dict of one's own is loss_fn's business, and probed."""
    if isinstance(output, Mapping) and type(output).__module__.startswith("transformers."):
        return output.get("loss")
    return None


def _leaf_paths(output: Any) -> list[str]:
    return [".".join(map(str, path)) for path in optree.tree_paths(output)]


def _detached(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _two_rows(
    first: tuple[Any, Any, Any], second: tuple[Any, Any, Any],
    predict: Callable[[Any], Sequence[torch.Size | None] | None],
) -> tuple[Any, Any, Any] | None:
    """Two one-row micro-batches' (output, inputs, targets) as one of two rows: each output leaf's row dim (at
    most one) and the inputs' and targets' dim 0 concatenated; None where they cannot be (other shapes, a leaf of
    two row dims such as a rows x rows similarity, one without rows that differs)."""
    (out_a, in_a, tg_a), (out_b, in_b, tg_b) = first, second
    leaves_a, tree = optree.tree_flatten(out_a)
    leaves_b, tree_b = optree.tree_flatten(out_b)
    if tree != tree_b:
        return None
    dims = _row_dims(leaves_a, 1, in_a, predict)
    if dims is None or any(len(d) > 1 for d in dims):
        return None
    joined = []
    for a, b, d in zip(leaves_a, leaves_b, dims, strict=True):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a is not b and a != b:
                return None
            joined.append(a)
        elif a.shape != b.shape or a.dtype != b.dtype:
            return None
        elif d:
            joined.append(torch.cat([a, b.detach()], d[0]))
        elif torch.equal(a, b):
            joined.append(a)
        else:
            return None

    def rows_of(x: Any, y: Any) -> Any:
        xs, spec = optree.tree_flatten(x)
        ys, spec_y = optree.tree_flatten(y)
        if spec != spec_y or any(not isinstance(t, torch.Tensor) or not isinstance(u, torch.Tensor) or t.dim() == 0
                                 or t.shape != u.shape or t.shape[0] != 1 for t, u in zip(xs, ys, strict=True)):
            return None
        return optree.tree_unflatten(spec, [torch.cat([t, u.detach()]) for t, u in zip(xs, ys, strict=True)])

    inputs, targets = rows_of(in_a, in_b), rows_of(tg_a, tg_b)
    if inputs is None or targets is None:
        return None
    return optree.tree_unflatten(tree, joined), inputs, targets


@dataclass(frozen=True)
class OwnLoss:
    """Cutting the output changed nothing loss_fn returned: it reads a loss the model computed itself (a Hugging
    Face model's scalar ``out.loss``), over the part of the batch the model is called on. ``mixed``: the output's
    leaves (their paths) that hold the rows on two dims, a rows x rows matrix (CLIPModel's ``logits_per_image``)."""

    mixed: tuple[str, ...]


RETRY = "retry"  # the values say nothing (not finite, or all zero): probe again on the next call
LATER = "later"  # a micro-batch of one row whose row dims cannot be told: again on one of other shapes
UNKNOWN = "unknown"  # cannot be probed on this step's outputs: not again


@dataclass(frozen=True)
class _Part:
    """A part of the micro-batch the probe evaluates loss_fn on: rows ``rows`` (start, stop; None: every
    row) along the row dims, repeated ``twice`` along them (a micro-batch of one row), and tokens
    ``tokens`` (start, stop; None: every token) along the token dims."""

    rows: tuple[int, int] | None = None
    twice: bool = False
    tokens: tuple[int, int] | None = None
    picked: tuple[int, ...] | None = None  # these rows (not a span): a halving that is no first and second half


def measure(
    loss_fn: Callable[[Any, Any], Any], output: Any, inputs: Any, targets: Any,
    generators: Sequence[torch.Generator], restore: bool,
    predict: Callable[[Any], Sequence[torch.Size | None] | None],
    *, rows_cut: bool = True, sequence_dim: int | None = None, tokens: str | Callable[[Any, Any], Any] | None = None,
) -> Measured | OwnLoss | str:
    """``loss_fn`` on the first rows of ``output`` and ``targets`` and on their halves (``rows_cut``; of one
    row, on the row repeated twice and on the row), and on the halves of their tokens along
    ``sequence_dim`` (not None); or why not. ``tokens``: the step's ``train_step(tokens=...)``, whose
    contract is probed (None: a mean). Of what was measured, the first that disagrees, else the first."""
    rows = _rows(inputs)
    if rows is None or not _rows_first(targets, rows):
        return UNKNOWN
    leaves, tree = optree.tree_flatten(output)
    n = PROBE_ROWS if rows >= PROBE_ROWS else min(rows, 2)
    row_dims = _row_dims(leaves, rows, inputs, predict) if rows_cut or n >= 2 else None
    first = None if row_dims is None or n == rows else (0, n)  # where the row dims are not known: every row
    halvings: list[tuple[str, int, list[_Part]]] = []
    if rows_cut and row_dims is not None and n >= 2:
        halvings.append(("rows", 0, [_Part(first), _Part((0, n // 2)), _Part((n // 2, n))]))
    elif rows_cut and row_dims is not None:  # one row: a mean of per-row terms is the same on the row repeated
        halvings.append(("repeat", 0, [_Part(None, twice=True), _Part(), _Part()]))
    if rows_cut and row_dims is not None and n == 4:
        # The other two ways to halve 4 rows: a loss over the batch's hardest rows (OHEM's mean of the top half) or
        # weighted by the batch's own class counts agrees on one halving where its chosen rows fall one a half
        # (2 in 3 for OHEM); on the three, no two rows are together in every one.
        for a, b in OTHER_HALVES:
            along = f"rows {a[0]} and {a[1]} | {b[0]} and {b[1]}"
            halvings.append((along, 0, [_Part(first), _Part(picked=a), _Part(picked=b)]))
    token_count = None if sequence_dim is None else _tokens(targets, sequence_dim)
    token_dims = None if token_count is None else _token_dims(leaves, rows, sequence_dim or 0, token_count)
    if token_count is not None and token_dims is not None:
        h = token_count // 2
        whole = None if 2 * h == token_count else (0, 2 * h)
        halvings.append(("tokens", 2 * h, [_Part(first, tokens=whole), _Part(first, tokens=(0, h)),
                                           _Part(first, tokens=(h, 2 * h))]))
    if not halvings:
        # A micro-batch of one row whose row dims cannot be told (a dim of size 1 elsewhere): a later
        # call's micro-batch may have more rows.
        return LATER if rows_cut and rows == 1 and any(_has_dims(t) for t in leaves) else UNKNOWN
    dims = _Dims(row_dims or [() for _ in leaves], token_dims or [() for _ in leaves], sequence_dim or 0, token_count)
    states = [g.get_state() for g in generators]
    host = host_random.capture()  # Python's random and numpy's, which a loss may draw from too
    values: dict[_Part, tuple[torch.Tensor, Any]] = {}
    try:
        with torch.no_grad(), no_mesh(), in_layer.probing_loss(), _MatmulWatch() as matmuls:
            for _, _, parts in halvings:
                for part in parts:
                    if part in values:
                        continue
                    cut = optree.tree_unflatten(tree, [_take(t, r, k, part) for t, r, k in zip(
                        leaves, dims.rows, dims.tokens, strict=True)])
                    part_targets = optree.tree_map(lambda t, p=part: dims.take_batch(t, p), targets)
                    got = loss_fn(cut, part_targets)
                    refuse_fake_loss(got)  # (raised past this try: the step's own call would fail as torch does)
                    if any(not torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True)) or (
                        host_random.moved(host)
                    ):
                        return UNKNOWN  # it draws random numbers: its parts would differ by their draws
                    value = _value(got, tokens, inputs, part_targets, dims, part)
                    if value is None:
                        return UNKNOWN  # the step's own call says what it must return
                    values[part] = value
    except ReadsOutsideChain:
        raise
    except Exception:  # a loss that cannot run on fewer rows is not probed; its own call runs next
        return UNKNOWN
    finally:
        if restore:
            for g, s in zip(generators, states, strict=True):
                g.set_state(s)
            host_random.restore(host)
    read = dict(zip(values, torch.stack([v.detach().double() for v, _ in values.values()]).tolist(), strict=True))
    counted = dict(zip(values, torch.stack([torch.as_tensor(c).detach().double().cpu() for _, c in values.values()])
                       .tolist(), strict=True)) if tokens is not None else None
    if tokens is not None and not isinstance(tokens, str):  # a mean over no counted tokens is 0/0: the step's 0
        assert counted is not None
        read = {p: v if counted[p] != 0 else 0.0 for p, v in read.items()}
    if counted is not None and (not all(map(_finite_number, counted.values())) or not any(counted.values())):
        return RETRY
    partial = next(((along, count, parts) for along, count, parts in halvings
                    if _finite_number(read[parts[0]]) and not all(_finite_number(read[p]) for p in parts[1:])), None)
    if partial is not None and tokens != "sum":
        # Finite on the whole, not on a half that counts something: loss_fn needs rows the half lacks (an unbiased
        # std of one row, a row paired with another, DPO's chosen and rejected halves): refused, not probed again
        # (every later call's halves are alike, and the step would train on meanwhile).
        along, count, (on_whole, on_a, on_b) = partial
        return Measured(n if along != "tokens" or row_dims is not None else rows, read[on_whole],
                        (read[on_a], read[on_b]), RTOL_FLOAT64, along, count, "mean" if tokens is None else "count",
                        None if counted is None else (counted[on_whole], counted[on_a], counted[on_b]))
    if not all(map(_finite_number, read.values())) or not any(read.values()):
        return RETRY
    same_counts = {along: counted is None or counted[whole] == counted[a] == counted[b]
                   for along, _, (whole, a, b) in halvings}
    if all(read[whole] == read[a] == read[b] and (same_counts[along] or callable(tokens))
           and (along != "repeat" or tokens == "sum") for along, _, (whole, a, b) in halvings):
        # Cutting changed nothing: loss_fn reads only what each half gets whole (a model's own scalar
        # loss, passed whole beside its logits), which says nothing of how it combines rows or tokens,
        # whatever a count function counted on the halves (under tokens='sum' the counts must agree too: a mean
        # returned with a count that halves is probed, and refused; on one row repeated, a mean equals the row's
        # by design, and is probed). Where the output holds a rows x rows matrix, the model compared its rows with
        # each other: its loss is over the whole batch.
        return OwnLoss(() if row_dims is None else
                       tuple(p for p, d in zip(_leaf_paths(output), row_dims, strict=True) if len(d) > 1))
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    dtypes = {v.dtype for v, _ in values.values()} | {t.dtype for t in floats}
    rtol = RTOL_FLOAT64 if dtypes <= {torch.float64} else \
        RTOL_FLOAT32 if dtypes <= {torch.float32, torch.float64} and (
            not matmuls.ran or exact_float32_matmuls(floats)) else RTOL
    mode = "mean" if tokens is None else "sum" if isinstance(tokens, str) else "count"
    found = [
        Measured(n if along != "tokens" or row_dims is not None else rows, read[whole], (read[a], read[b]), rtol,
                 along, count, mode, None if counted is None else (counted[whole], counted[a], counted[b]))
        for along, count, (whole, a, b) in halvings
    ]
    return next((m for m in found if not m.agrees), found[0])


# The functions that run a matmul or convolution, which a float32 matmul precision setting (TF32, bf16 passes)
# changes: a loss calling none computes in float32. By name, as a function mode sees them (the outermost call: a
# composite's inner matmuls are not seen apart, so composites are named too).
_MATMULS = frozenset((
    "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
    "inner", "einsum", "tensordot", "chain_matmul", "multi_dot", "linear", "bilinear", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "cdist",
    "scaled_dot_product_attention", "multi_head_attention_forward", "lstm", "gru", "rnn_tanh", "rnn_relu",
))


class _MatmulWatch(TorchFunctionMode):
    """Notes whether loss_fn ran a matmul or convolution while the probe evaluated it (``ran``): a loss without
    one (a class-weighted cross-entropy, a sum) computes in float32 whatever the matmul precision says, and is
    judged at float32's tolerance (under TF32's, a weighted mean 0.08-1% off a mean passed). A function mode, not a
    dispatch mode: entering one of those imports sympy (36 MiB), on every rank's first step."""

    ran = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) in _MATMULS:
            self.ran = True
        return func(*args, **(kwargs or {}))


def exact_float32_matmuls(tensors: list[torch.Tensor]) -> bool:
    """Whether a float32 matmul (or convolution) in loss_fn computes in float32 (not TF32 on CUDA, nor bf16 under
    ``torch.set_float32_matmul_precision("medium")`` or the backends' ``fp32_precision``): then rows give the same
    values whatever rows are beside. Read through torch's legacy and new settings alike (the legacy getter raises
    once the new ones are used: then only the new ones are read)."""
    try:
        if torch.get_float32_matmul_precision() != "highest":
            return False
    except RuntimeError:  # (torch >= 2.9 refuses the legacy question after the new settings were used)
        pass
    for backend in (getattr(torch.backends.mkldnn, "matmul", None), torch.backends.cuda.matmul):
        if getattr(backend, "fp32_precision", "none") not in ("none", "ieee"):
            return False
    if any(t.device.type == "cuda" for t in tensors):
        return not (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
    return True


def _value(
    got: Any, tokens: str | Callable[[Any, Any], Any] | None, inputs: Any, targets: Any, dims: _Dims, part: _Part,
) -> tuple[torch.Tensor, Any] | None:
    """What loss_fn returned on ``part``, as (its loss, the part's count: 0 where no tokens are counted);
    None where it is not what the step's mode asks (a scalar loss; under tokens='sum', a pair)."""
    count: Any = 0
    if tokens == "sum":
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return None
        got, count = got
    elif tokens is not None and not isinstance(tokens, str):
        count = tokens(optree.tree_map(lambda t: dims.take_batch(t, part), inputs), targets)
    if not (isinstance(got, torch.Tensor) and got.dim() == 0 and got.is_floating_point()):
        return None
    count = torch.as_tensor(count)
    if count.dim() != 0 or count.dtype.is_complex:
        return None
    return got, count


@dataclass(frozen=True)
class _Dims:
    """Where the probe cuts: the row dims (``rows``) and token dims (``tokens``) of each output leaf, and
    the sequence dim ``sequence`` of the inputs' and targets' leaves holding ``token_count`` tokens there
    (their rows are on dim 0)."""

    rows: list[tuple[int, ...]]
    tokens: list[tuple[int, ...]]
    sequence: int
    token_count: int | None

    def take_batch(self, t: Any, part: _Part) -> Any:
        """Input or target leaf ``t``'s ``part``: rows along dim 0, tokens along the sequence dim."""
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        along = t.dim() > self.sequence and t.shape[self.sequence] == self.token_count
        return _take(t, (0,), (self.sequence,) if along else (), part)


def _take(t: Any, row_dims: tuple[int, ...], token_dims: tuple[int, ...], part: _Part) -> Any:
    """``part`` of ``t``: its rows along ``row_dims`` (repeated twice along them where it says so), its
    tokens along ``token_dims``."""
    if not isinstance(t, torch.Tensor):
        return t
    index: list[slice] = [slice(None)] * t.dim()
    for dims, span in ((row_dims, part.rows), (token_dims, part.tokens)):
        if span is not None:
            for d in dims:
                index[d] = slice(span[0], span[1])
    t = t[tuple(index)]
    for d in row_dims if part.picked is not None else ():
        t = t.index_select(d, torch.tensor(part.picked, device=t.device))
    for d in row_dims if part.twice else ():
        t = torch.cat([t, t], dim=d)
    return t


def _tokens(targets: Any, dim: int) -> int | None:
    """The length of the targets' sequences along ``dim`` (one for every leaf, at least 2), or None."""
    if dim < 1:
        return None
    lengths = {int(t.shape[dim]) for t in optree.tree_leaves(targets) if isinstance(t, torch.Tensor) and t.dim() > dim}
    if len(lengths) != 1 or len(optree.tree_leaves(targets)) == 0:
        return None
    if any(not isinstance(t, torch.Tensor) or t.dim() <= dim for t in optree.tree_leaves(targets)):
        return None
    (length,) = lengths
    return length if length >= 2 else None


def _token_dims(leaves: list[Any], rows: int, dim: int, tokens: int) -> list[tuple[int, ...]] | None:
    """The dim of each output leaf that holds the tokens of the targets' sequence dim ``dim``: ``dim``
    itself, where no other dim of the leaf has the tokens' count (dim 0 aside, where it holds the rows),
    in every tensor; None where that cannot be told. A feature dim (a vocabulary, or a rank's slice of
    it) is never cut: where it has the tokens' count, the leaf's dims cannot be told."""
    dims: list[tuple[int, ...]] = []
    for t in leaves:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:  # a scalar beside (an aux term): passed whole
            dims.append(())
            continue
        if t.dim() <= dim or t.shape[dim] != tokens:
            return None
        others = [d for d in range(t.dim()) if d != dim and t.shape[d] == tokens and not (d == 0 and tokens == rows)]
        if others:
            return None
        dims.append((dim,))
    return dims if any(dims) else None


def _row_dims(
    leaves: list[Any], rows: int, inputs: Any, predict: Callable[[Any], Sequence[torch.Size | None] | None],
) -> list[tuple[int, ...]] | None:
    """The dims of each output leaf that hold the micro-batch's rows (() for a leaf that is no tensor,
    or one that does not follow the rows: each half's loss gets it whole), or None where that cannot
    be told. One tensor whose dim 0 alone has the rows' size (the usual output, ``[rows, ...]``): dim
    0. Else those whose size follows the rows in the chain's output on half the rows, on fake
    tensors: a tensor whose dim 0 merely equals the rows (a class table or prototypes the model
    returns beside its features) is not cut. Where the chain cannot run on fake tensors, dim 0 where
    it is the only dim of the rows' size in every tensor. A tensor without such a dim (a scalar loss
    the model computed over the batch) cannot be halved."""
    # A scalar beside the rows' tensors (an aux loss term the model computed on its micro-batch) has no
    # rows to cut: each half's loss gets it whole.
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors or not any(rows in t.shape for t in tensors):
        return None
    dim_0 = all(t.shape[0] == rows and rows not in t.shape[1:] for t in tensors)
    on_dim_0: list[tuple[int, ...]] = [(0,) if isinstance(t, torch.Tensor) and t.dim() > 0 else () for t in leaves]
    if dim_0 and len(tensors) == 1:  # the usual output, [rows, ...]: no fake run (its first imports sympy)
        return on_dim_0
    other = rows // 2 if rows >= 2 else 2  # half the rows; of one row, the row twice
    shapes = predict(optree.tree_map(functools.partial(_other_rows, rows=other), inputs))
    if shapes is None or len(shapes) != len(leaves):
        return on_dim_0 if dim_0 else None
    dims: list[tuple[int, ...]] = []
    for t, shape in zip(leaves, shapes, strict=True):
        if not isinstance(t, torch.Tensor):
            dims.append(())
            continue
        if shape is None or len(shape) != t.dim():
            return None
        follows = tuple(d for d, (a, b) in enumerate(zip(t.shape, shape, strict=True)) if a != b)
        if any(t.shape[d] != rows or shape[d] != other for d in follows):
            return None
        dims.append(follows)
    return dims if any(dims) else None


def refusal(cut: ProbeCut, found: Measured) -> str:
    """The refusal of a ``loss_fn`` that is not a mean over rows (or over tokens), or that does not keep its
    ``tokens=`` mode's contract: what was measured and the fixes."""
    if found.mode != "mean":
        return _weighed_refusal(cut, found)
    return _token_refusal(cut, found) if found.along == "tokens" else _row_refusal(cut, found)


def _measured_on(found: Measured) -> tuple[str, str]:
    """Where the whole's and the halves' values were measured, in words."""
    if found.along == "repeat":
        return ("the one row of this rank's first micro-batch (a micro-batch of one row) repeated twice",
                "on the row itself (each of the two halves of the repeated rows)")
    if found.along == "tokens":
        return (f"the first {found.tokens} tokens of the first {found.rows} rows of this rank's part",
                "on the two halves of those tokens")
    if found.along == "pair":
        return ("two rows of this rank's, each a micro-batch of one row, together", "on each row alone")
    if found.along.startswith("rows "):  # "rows 0 and 2 | 1 and 3"
        a, b = found.along[5:].split(" | ")
        return (f"the first {found.rows} rows of this rank's first micro-batch",
                f"on two halves of them (rows {a}; rows {b})")
    return f"the first {found.rows} rows of this rank's first micro-batch", "on their two halves"


def _weighed_adds_up(found: Measured) -> bool:
    """Whether loss x count adds up over the halves: a mean over the counted tokens."""
    whole, first, second = found.weighed
    return abs(whole - first - second) <= found.rtol * max(abs(whole), abs(first), abs(second))


def _weighed_refusal(cut: ProbeCut, found: Measured) -> str:
    """The refusal of a ``loss_fn`` that does not return what its ``tokens=`` mode asks."""
    what = " x ".join(w for w in (cut.rows, cut.sequence) if w)
    whole_on, halves_on = _measured_on(found)
    assert found.counts is not None
    cw, c0, c1 = found.counts
    if found.mode == "sum":
        problems = []
        if not found.is_sum:
            mean = found.is_mean or _weighed_adds_up(found)
            problems.append(f"the summed loss is not the sum of the halves' ({found.total:.6g})"
                            + (" (loss_fn returns a mean, not the sum?)" if mean else ""))
        if abs(cw - (c0 + c1)) > found.rtol * max(abs(cw), abs(c0), abs(c1)):
            problems.append(f"the count is not the sum of the halves' ({c0 + c1:g})")
        return (
            "train_step(tokens='sum') needs loss_fn to return (the sum of the token losses, their count or total "
            f"weight): the step sums both over the parts it computes ({what}) and divides the global sum by the "
            "global count, the single-device step's loss only when both add up over the parts. On "
            f"{whole_on}, loss_fn returned ({found.whole:.6g}, {cw:g}), and ({found.halves[0]:.6g}, {c0:g}) and "
            f"({found.halves[1]:.6g}, {c1:g}) {halves_on}: {'; '.join(problems)}. This step would train another "
            "model than the single-device step. Return (the summed token losses, e.g. cross_entropy(..., "
            "reduction='sum'), their count, e.g. (targets != -100).sum()); for a loss_fn that returns the mean "
            "over counted tokens, pass tokens=count_fn instead, with count_fn(inputs, targets) counting them"
        )
    name = getattr(cut.tokens, "__name__", "")
    name = name if name.isidentifier() else "count_fn"
    whole, first, second = found.weighed
    hint = (" (loss_fn's values add up over the halves: a loss summed over the tokens, reduction='sum'?)"
            if found.is_sum else " (loss_fn is a mean over other tokens than those counted?)")
    return (
        f"train_step(tokens={name}) needs loss_fn to return the mean loss over the tokens {name}(inputs, targets) "
        f"counts: the step multiplies it by the count, sums over the parts it computes ({what}) and divides by the "
        f"global count. On {whole_on}, loss_fn returned {found.whole:.6g} over {cw:g} counted tokens, and "
        f"{found.halves[0]:.6g} over {c0:g} and {found.halves[1]:.6g} over {c1:g} {halves_on}: the loss x count "
        f"is {whole:.6g} for the whole and {first + second:.6g} summed over the halves{hint}. This step would train "
        "another model than the single-device step. Return the mean over the counted tokens (cross_entropy with "
        "reduction='mean', its default, and ignore_index the label the count leaves out, e.g. -100 with "
        "(targets != -100).sum()); for a summed loss, pass tokens='sum' with loss_fn returning (the sum, the count)"
    )


def own_loss_refusal(cut: ProbeCut, found: OwnLoss, own_loss: tuple[str, str] | None, seen: str = "probe") -> str:
    """Why a loss the model computes itself over the part of the batch it is called on is refused: ``seen`` in the
    output (a model's ``loss`` beside what makes it no mean over the rows), or by the ``probe`` (loss_fn's value
    unchanged on halves of the output's rows)."""
    if found.mixed or own_loss is None:
        why = (f"the model's output holds the rows on two dims ({', '.join(found.mixed)}: a rows x rows matrix, "
               "each row compared with the batch's others), so its loss is over the whole batch it is called on (a "
               "contrastive loss with in-batch negatives, as CLIPModel's and SiglipModel's with return_loss=True)")
        fix = "compute the loss in loss_fn from the model's output instead (the step checks that one)"
    else:
        why, fix = own_loss
    how = ("the model's output holds a loss it computed itself" if seen == "output" else
           "loss_fn returned the same value on halves of the output's rows as on all of them: it reads a loss the "
           "model computed itself")
    return (
        f"{how}, over the part of the batch the model is called on (this step cuts the batch: {cut.rows}), and "
        f"{why}: what the step makes of the parts' losses is not the single-device step's loss, and it would train "
        f"another model without an error. Either {fix}; or do not cut the batch (one device, tensor_parallel alone, "
        "a pipeline of one micro-batch); or pass train_step(tokens='per_shard_mean') to train on the mean of the "
        "parts' losses knowingly"
    )


def _row_refusal(cut: ProbeCut, found: Measured) -> str:
    if found.along == "repeat":
        sums = " (twice it: a loss summed over the rows, reduction='sum'?)" if found.is_sum else ""
        measured = (f"On the one row of this rank's first micro-batch (a micro-batch of one row) it gave "
                    f"{found.halves[0]:.6g}, and {found.whole:.6g} on that row repeated twice{sums}, where a mean "
                    "of per-row terms gives the same value")
    else:
        sums = " (their sum: a loss summed over the rows, reduction='sum'?)" if found.is_sum else ""
        whole_on, halves_on = _measured_on(found)
        paired = (" (a loss over the batch's hardest rows, OHEM's, or weighted by the batch's own class counts, "
                  "cannot be computed on a part of it; one that pairs each row with its neighbour, rows 2i and "
                  "2i + 1, where every part the step cuts holds whole pairs, trains with tokens='per_shard_mean', "
                  "the mean of the parts' losses being then the single-device step's)"
                  ) if found.along.startswith("rows ") and not sums else ""
        measured = (f"On {whole_on} it gave {found.whole:.6g}, and {found.halves[0]:.6g} and {found.halves[1]:.6g} "
                    f"{halves_on}, whose mean is {found.mean:.6g}{sums}{_needs_rows(found)}{paired}")
    return (
        f"loss_fn is not a mean over the batch's rows, which a step that cuts the batch ({cut.rows}) needs: the step "
        "takes the mean of the losses of the parts it computes, the single-device step's loss only when loss_fn "
        f"returns the mean of per-row terms. {measured}: this step would train another model than the "
        "single-device step. "
        "Return the mean over the rows (torch's losses with reduction='mean', their default); for a mean over "
        "counted tokens or a weighted mean (cross_entropy(weight=...), a pad id as ignore_index), pass "
        "train_step(tokens='sum') with loss_fn returning (the summed losses, their count or total weight), or "
        "tokens=count_fn with loss_fn the mean over count_fn(inputs, targets) tokens; a loss over the whole "
        "batch (a contrastive loss with in-batch negatives) cannot be computed on a part of it: do not cut the "
        "batch (one device, tensor_parallel alone, a pipeline of one micro-batch), or pass "
        "tokens='per_shard_mean' to train on the mean of the parts' losses knowingly (what DDP computes)"
    )


def _needs_rows(found: Measured) -> str:
    """Where a half's value is not finite and the whole's is: what that says, in words."""
    if all(map(_finite_number, found.halves)):
        return ""
    return (" (not finite on a part where it is on the whole: it needs rows that part lacks, a statistic of "
            "several rows such as an unbiased std, rows paired with other rows such as DPO's chosen and rejected "
            "halves, or a mean over no tokens; a part this small cannot be probed further: where every part the "
            "step cuts holds whole groups of the rows the loss pairs, laid out together (rows 2i and 2i + 1), the "
            "mean of the parts' losses is the single-device step's, and tokens='per_shard_mean' trains it)")


def _token_refusal(cut: ProbeCut, found: Measured) -> str:
    sums = " (their sum: a loss summed over the tokens, reduction='sum' or a sum per sequence?)" if found.is_sum else ""
    return (
        f"loss_fn is not a mean over the tokens of the batch's sequences, which a step that cuts each sequence "
        f"({cut.sequence}) needs: each rank computes the loss of its part of every sequence, and the step takes "
        "the mean of the parts' losses, the single-device step's loss only when loss_fn returns the mean of "
        f"per-token terms. On the first {found.tokens} tokens of the first {found.rows} rows of this rank's part "
        f"it gave {found.whole:.6g}, and {found.halves[0]:.6g} and {found.halves[1]:.6g} on the two halves of "
        f"those tokens, whose mean is {found.mean:.6g}{sums}: this step would train another model than the "
        "single-device step. Return the mean over the tokens (cross_entropy over the flattened tokens with "
        "reduction='mean', its default; a loss summed per sequence divided by the tokens); for a mean over "
        "counted tokens or a weighted mean (padding, cross_entropy(weight=...)), pass train_step(tokens='sum') "
        "with loss_fn returning (the summed losses, their count or total weight), or tokens=count_fn with "
        "loss_fn the mean over count_fn(inputs, targets) tokens; a loss that shifts or drops tokens itself "
        "(logits[:, :-1] against targets[:, 1:]) needs targets shifted on the whole sequence before the step; "
        "or pass tokens='per_shard_mean' to train on the mean of the parts' losses knowingly"
    )


def _other_rows(t: Any, rows: int) -> Any:
    """Input leaf ``t`` with ``rows`` rows: its first (fewer), or its one row repeated."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    return t[:rows] if rows <= t.shape[0] else t.repeat(rows, *(1,) * (t.dim() - 1))


def _has_dims(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


def _rows(inputs: Any) -> int | None:
    """The micro-batch's rows: dim 0 of its inputs (the step cut every leaf along it)."""
    for t in optree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def _rows_first(tree: Any, rows: int) -> bool:
    """Whether every leaf of ``tree`` (the targets) is a tensor with the rows along dim 0, as the step cut them."""
    return all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows for t in optree.tree_leaves(tree))


def _finite_number(x: float) -> bool:
    return x == x and abs(x) != float("inf")
