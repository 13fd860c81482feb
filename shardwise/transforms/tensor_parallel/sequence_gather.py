"""A Colwise outside any Region inside a sequence-parallel block: it gathers the sequence itself.

Inside a sequence-parallel block each rank holds its slice of the sequence. A Region gathers the
whole sequence where its module's input enters, so the module's code sees the whole length. A
Colwise outside any Region enters the parallel region itself: it gathers the sequence at its own
input, and the module that calls it still holds the slice. Position-wise code around it (an MLP's
up projection and activation) does not care, but an attention reads the length of its input and
reshapes the gathered projections by it: Hugging Face BERT's and DistilBERT's
``query(hidden_states).view(*hidden_states.shape[:-1], -1, head_dim)`` makes a (batch, slice,
2 * heads, head_dim) view of (batch, whole, heads * head_dim) values, an attention between other
positions, which then fails on the attention mask of the whole sequence (torch's bare "size of
tensor a (4) must match ... b (8)") or, with no mask, trains another model.

:class:`SequenceGather` says which Colwise gathered, and refuses (on the layer's first call, watched
by split_watch.py) a reshape of its output that puts the slice's length where the gathered
sequence was, and explains a failure of torch's that names the two lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class SequenceGather:
    """A Colwise outside any Region that gathered its sequence-parallel block's slice at its input."""

    label: str  # the Colwise, in the model
    block: str | None  # the sequence-parallel block around it, if this layer holds it
    seq_dim: int
    local: int  # the slice's length, which the code around the Colwise holds
    whole: int  # the gathered length, which its output holds
    parts: int  # the tp size

    def reshaped(self, before: Tensor, after: Tensor) -> str | None:
        """The refusal for a reshape of the gathered output by the slice's length, else None."""
        d = self.seq_dim
        if not (before.dim() > d and after.dim() > d and before.shape[d] == self.whole):
            return None
        if after.shape[:d] != before.shape[:d] or after.shape[d] != self.local:
            return None
        return self.message(f"reshapes its output {tuple(before.shape)} to {tuple(after.shape)}")

    def explains(self, err: BaseException) -> bool:
        """Whether torch's error names both lengths: the slice's meeting the gathered sequence's."""
        text = str(err)
        return f"({self.local})" in text and f"({self.whole})" in text

    def message(self, what: str) -> str:
        module = self.label.rpartition(".")[0] or "<the layer's module>"
        block = repr(self.block) if self.block is not None else "around it"
        return (
            f"tensor_parallel: Colwise() on {self.label!r} sits outside any Region inside the sequence-parallel "
            f"block {block}, so it gathers the sequence at its own input ({self.whole} positions from this rank's "
            f"{self.local}), while the code around it ({module!r}) still holds the slice and computes with its "
            f"length: it {what} (Hugging Face BERT's and DistilBERT's attention views its projections by "
            "view(*hidden_states.shape[:-1], -1, head_dim)). Put a Region on the module that holds the Colwise "
            "and its Rowwise, so that the sequence is gathered where that module's input enters (DistilBERT: "
            "plan['distilbert.transformer.layer.*.attention'] = sw.tp.Region(heads=('n_heads',))), or, where "
            "the module holding the Rowwise adds the residual too (BERT's, RoBERTa's attention.output: a Region "
            "there is refused), leave the block out of sequence_parallel"
        )
