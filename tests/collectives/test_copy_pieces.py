"""``copy_pieces``: the elements of pieces laid end to end copied into other pieces laid end to end
(an all-gather's rows into the caller's pieces, collectives/backends/base.py), with a part that already
lies where it goes left unwritten."""

from __future__ import annotations

import pytest
import torch

from shardwise.collectives.backends.base import copy_pieces


def _pieces(dest: torch.Tensor, lengths: list[int], gap: int) -> list[torch.Tensor]:
    out, at = [], 0
    for n in lengths:
        out.append(dest[at: at + n])
        at += n + gap
    return out


@pytest.mark.parametrize("cut_source", [False, True], ids=["one source", "source in pieces"])
def test_each_element_lands_in_order_and_nothing_between_the_pieces_is_written(cut_source: bool) -> None:
    lengths = [5, 1, 2, 0, 7, 1, 1, 3]
    values = torch.arange(1.0, sum(lengths) + 1)
    source = list(values.split([4, 6, 1, 9])) if cut_source else [values]
    dest = torch.full((sum(lengths) + 2 * len(lengths),), float("nan"))
    into = _pieces(dest, lengths, gap=2)
    copy_pieces(source, into)
    assert torch.equal(torch.cat(into), values)
    written = torch.zeros_like(dest, dtype=torch.bool)
    at = 0
    for n in lengths:
        written[at: at + n] = True
        at += n + 2
    assert bool(dest[~written].isnan().all()), "an element between two pieces was written"


@pytest.mark.parametrize("cut_source", [False, True], ids=["one source", "source in pieces"])
def test_a_piece_that_already_lies_where_it_goes_is_not_written(cut_source: bool) -> None:
    row = torch.arange(12.0)
    into = list(row.split([3, 4, 5]))  # the row's own views: every element already lies where it goes
    versions = [p._version for p in into]
    copy_pieces(list(row.split([6, 6])) if cut_source else [row], into)
    assert [p._version for p in into] == versions, "a piece that held its values in place was written"
    elsewhere = torch.zeros(12)
    into[1] = elsewhere[:4]
    copy_pieces(list(row.split([6, 6])) if cut_source else [row], into)
    assert torch.equal(elsewhere[:4], row[3:7]) and into[0]._version == versions[0]


def test_a_source_of_another_length_than_the_pieces_is_refused() -> None:
    with pytest.raises(RuntimeError, match="split_with_sizes expects split_sizes to sum exactly"):
        copy_pieces([torch.zeros(5)], [torch.zeros(2), torch.zeros(2)])


@pytest.mark.parametrize("sizes", [(3, 2), (1, 2)], ids=["longer", "shorter"])
def test_a_source_of_several_pieces_and_another_length_is_refused(sizes: tuple[int, int]) -> None:
    """The verify review: the walk stopped quietly, leaving elements uncopied or a piece's tail unwritten (3
    elements into 4 left the last one 0)."""
    into = [torch.zeros(2), torch.zeros(2)]
    with pytest.raises(ValueError, match=rf"hold {sum(sizes)} elements, the pieces to fill 4"):
        copy_pieces([torch.ones(n) for n in sizes], into)
