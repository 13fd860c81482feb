"""Which keys each query may see beyond causality: padding and packed sequences, as Hugging Face decides.

A :class:`TokenMask` describes the whole sequence token by token, in global order: ``segments``
[batch, seq] (a query sees only keys of its own segment: the documents of a packed sequence) and
``valid`` [batch, seq] (a key marked False is seen by no query: padding). With causality, query ``q``
sees key ``k`` when ``k <= q``, ``segments[q] == segments[k]`` and ``valid[k]``. It is per token, so
ring attention builds each block's mask from the two chunks' rows (never a [seq, seq] matrix), and
every rank can hold it whole: two integers a token.

:func:`token_mask` reads it from a Hugging Face batch's whole-sequence ``attention_mask`` and
``position_ids`` the way ``transformers`` builds its sdpa mask (``masking_utils``): a 2-D
``attention_mask`` masks padded keys (left or right; a query with no key left, such as a left pad,
gets a zero output, as torch's sdpa gives it); without one, ``position_ids`` that restart mark packed
sequences (a new segment wherever a position is not the previous one plus one).

>>> import torch
>>> m = token_mask(position_ids=torch.tensor([[0, 1, 2, 0, 1, 0]]))
>>> m.segments.tolist(), m.valid.all().item()
([[0, 0, 0, 1, 1, 2]], True)
>>> token_mask(attention_mask=torch.tensor([[0, 1, 1]])).valid.tolist()
[[False, True, True]]
>>> m.visible(torch.arange(6), torch.arange(6), causal=True)[0, 0].int().tolist()[4]
[0, 0, 0, 1, 1, 0]
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenMask(NamedTuple):
    """Per token of the whole sequence (global order): its segment and whether it may be seen as a key."""

    segments: torch.Tensor  # [batch, seq] int64
    valid: torch.Tensor  # [batch, seq] bool

    def visible(self, q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool) -> torch.Tensor:
        """[batch, 1, len(q_positions), len(k_positions)] bool: which of these keys each of these queries sees
        (global positions; causal: also ``k <= q``)."""
        device = self.segments.device
        q_positions, k_positions = q_positions.to(device), k_positions.to(device)
        seg_q, seg_k = self.segments[:, q_positions], self.segments[:, k_positions]
        seen = (seg_q.unsqueeze(-1) == seg_k.unsqueeze(-2)) & self.valid[:, k_positions].unsqueeze(-2)
        if causal:
            seen = seen & (k_positions.view(1, -1) <= q_positions.view(-1, 1))
        return seen.unsqueeze(1)

    def carried(self) -> torch.Tensor:
        """The mask as one int64 tensor [batch, 1, 2, seq]: what travels between a model's layers in place
        of Hugging Face's 4-D attention mask (which ``transformers`` passes on as it is)."""
        return torch.stack([self.segments, self.valid.to(torch.int64)], dim=1).unsqueeze(1)

    @staticmethod
    def from_carried(t: torch.Tensor) -> TokenMask:
        return TokenMask(t[:, 0, 0], t[:, 0, 1].bool())


def is_carried(t: object) -> bool:
    """Whether ``t`` is a :meth:`TokenMask.carried` tensor (Hugging Face's own masks are bool or float)."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 4 and t.shape[1:3] == (1, 2)


def token_mask(
    attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
) -> TokenMask:
    """The :class:`TokenMask` of a whole-sequence batch: padding from a 2-D ``attention_mask`` (nonzero:
    a token), else packed sequences from ``position_ids`` [batch or 1, seq] (see the module docstring)."""
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"context_parallel: attention_mask has shape {tuple(attention_mask.shape)}; it splits a 2-D "
                "[batch, seq] padding mask (1 for tokens, 0 for padding). A 4-D mask of its own cannot be cut "
                "token by token: express it as padding and restarting position_ids, or leave context_parallel out"
            )
        valid = attention_mask != 0
        return TokenMask(torch.zeros(valid.shape, dtype=torch.int64, device=valid.device), valid)
    if position_ids is None:
        raise ValueError("token_mask: give attention_mask or position_ids")
    if position_ids.dim() != 2:
        raise ValueError(
            f"context_parallel: position_ids has shape {tuple(position_ids.shape)}; it must be [batch, seq]"
        )
    # transformers' find_packed_sequence_indices: a new segment wherever a position is not the previous + 1.
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    segments = (step != 1).cumsum(-1)
    return TokenMask(segments, torch.ones(segments.shape, dtype=torch.bool, device=segments.device))


def check_mask(op: str, mask: object, batch: int, seq: int) -> None:
    """A clear error when ``mask`` is not a :class:`TokenMask` of the whole sequence's ``seq`` tokens."""
    if not isinstance(mask, TokenMask):
        raise TypeError(f"{op}: mask must be a TokenMask (see token_mask), got {type(mask).__name__}")
    for name, t in (("segments", mask.segments), ("valid", mask.valid)):
        if t.dim() != 2 or t.shape[1] != seq or t.shape[0] not in (1, batch):
            raise ValueError(
                f"{op}: mask.{name} has shape {tuple(t.shape)}; it must be [{batch} (or 1), {seq}]: the whole "
                "sequence's tokens, in global order (not this rank's slice)"
            )
