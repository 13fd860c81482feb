"""The executor's pipeline actions: activations and gradients between stages on different ranks,
and the gradients of weights tied across pipeline ranks.

A rank posts its receives in the order it waits for them, ``RECEIVES_AHEAD`` at most at once (the k-th
when it waits for the (k - RECEIVES_AHEAD + 1)-th), so transfers land while it computes (gloo moves a
message only once its receive is posted). Every receive of the step was posted at the rank's first: a
buffer per micro-batch each way from there, a middle rank of a 1F1B of 32 micro-batches 2x its peak at 4
(the activations 1F1B bounds were not the most it held). A send is let go of once it is known delivered:
a stage output's when its gradient comes back (the peer computed from it); an input gradient's at the
first receive from that peer that its schedule sends after taking the gradient (``send_delivery.py``),
else at ``wait_sends``. With the stage boundaries predicted for each micro-batch
(``engine/plan/predict.py``),
each tensor travels bare and the receiver rebuilds the stage output's pytree;
otherwise a header goes first: the count, and the structure of an output that is not a tensor or a
flat tuple of them (``wire_structure``). A mixin of
:class:`~shardwise.engine.run.executor.Executor`, whose fields it uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch

from ...collectives import Handle, recv, send
from ...collectives.mesh import Mesh
from ..layout.state_layout import Placement
from ..model.carry import is_absent_layout
from ..plan.actions import RECV_ACTIVATION, RECV_GRAD, Action, Boundary
from . import wire_structure
from .send_delivery import Key
from .wide_grads import WideGrads

if TYPE_CHECKING:
    from .param_source import ParamSource

Layout = tuple[torch.Size, torch.dtype]


def tag_of(kind: str, stage: int, microbatch: int, microbatches: int, leaf: int = 0) -> int:
    """A distinct non-negative message tag per transfer and per tensor in it (gloo needs ints >= 0)."""
    direction = 0 if kind == "activation" else 1
    return (((stage * microbatches + microbatch) * 2 + direction) << 10) + leaf


TIED_TAG_BASE = 1 << 29  # above every activation/gradient tag (tag_of stays far below it)
# How many of a rank's receives are posted at once, the one waited for among them: enough that the next
# micro-batch's activation and gradient land during this one's computes; each holds its buffer from there.
RECEIVES_AHEAD = 4


def _check_predicted(
    leaves: list[Any], spec: Any, boundary: Boundary, s: int, m: int, followed: bool | str
) -> None:
    """Refuse a stage output that is not what the Plan predicted: its receiver posted one receive per
    predicted tensor and rebuilds the predicted structure, so another structure (a value that is None
    in this micro-batch only) would reach it as other tensors in other places, or as ones of the
    same shapes silently swapped. ``followed``: each micro-batch's first layer ran on it (follow_batches); the
    name of a split where follow_batches was asked for and does not run under it."""
    got = tuple((t.shape, t.dtype) if isinstance(t, torch.Tensor) else (type(t).__name__, None) for t in leaves)
    if spec == boundary.spec and got == boundary.leaves:
        return
    got_in, predicted_in = ("", "") if spec == boundary.spec else (f" in {spec}", f" in {boundary.spec}")
    present = _present_where_predicted_absent(got, boundary.leaves) if spec == boundary.spec else None
    if present is not None:
        # Predicted as the example had it (where follow_batches ran the first layer on the micro-batch, the
        # value was decided later): the example is what misled it.
        this, example = ("has one", "had none") if present else ("has none", "had one")
        where = (
            "is predicted on the micro-batch where the model's first layer decides it (follow_batches); one "
            "decided later cannot be read off the fake tensors the Plan runs on, so it is predicted"
            if followed is True else "cannot be read off the fake tensors the Plan runs on, so it is predicted"
        )
        follow = "" if followed is True else (
            f" (pipeline(follow_batches=True) does not run under {followed}: the split's layers run on fake tensors "
            "only inside its own prediction, so each micro-batch is predicted as the example)"
        ) if isinstance(followed, str) else (
            " (or, where the model's first layer decides it, pass sw.pipeline(..., follow_batches=True): each "
            "micro-batch's first layer then also runs on it, once per micro-batch and step)"
        )
        raise ValueError(
            f"stage {s} passes on, for micro-batch {m}, {_describe(got)}, but the Plan predicted "
            f"{_describe(boundary.leaves)}. A value a model leaves out on some inputs (a Hugging Face attention "
            f"mask: None for a batch without a padded row, with sdpa attention and BERT's eager one) {where} as "
            f"functionalize's example_input had it, and this micro-batch {this} where the example {example}. "
            "Give functionalize an example_input like your batches (with a padded row if they are padded), and "
            f"every micro-batch the same structure (a padded row in each, or in none){follow}"
        )
    raise ValueError(
        f"stage {s} passes on, for micro-batch {m}, {_describe(got)}{got_in}, but the Plan predicted "
        f"{_describe(boundary.leaves)}{predicted_in} (from the micro-batch's shapes), which the next "
        "stage receives and rebuilds: what a stage passes on must follow from the micro-batch's shapes, not its "
        "data. A value that is None in some micro-batches and a tensor in others does this: Hugging Face models "
        "leave out the attention mask of "
        "a micro-batch with no padded row (sdpa attention, and BERT's eager one), so give every micro-batch a "
        "padded row, or use attn_implementation='eager' where it always builds the mask (Llama, GPT-2)"
    )


def _present_where_predicted_absent(
    got: Sequence[tuple[Any, Any]], predicted: Sequence[tuple[Any, Any]]
) -> bool | None:
    """Whether the leaves differ from the prediction only by values absent in one and present in the
    other (an attention mask left out), all the same way: True where present only in ``got``, False where
    absent only there, None for any other difference."""
    if len(got) != len(predicted):
        return None
    pairs = [(is_absent_layout(*g), is_absent_layout(*p)) for g, p in zip(got, predicted, strict=True) if g != p]
    if not pairs or any(got_absent == predicted_absent for got_absent, predicted_absent in pairs):
        return None
    ways = {predicted_absent for _, predicted_absent in pairs}
    return ways.pop() if len(ways) == 1 else None


def _describe(leaves: Sequence[tuple[Any, Any]]) -> str:
    shown = ", ".join(
        "None" if is_absent_layout(shape, dtype) else f"{tuple(shape)} {dtype}" if dtype is not None else str(shape)
        for shape, dtype in leaves[:6]
    )
    more = f", ... ({len(leaves)} in all)" if len(leaves) > 6 else ""
    return f"{len(leaves)} tensor{'s' if len(leaves) != 1 else ''} [{shown}{more}]"


def _flat(value: Any) -> bool:
    """A tensor, or a tuple of tensors: what an announced transfer rebuilds."""
    return isinstance(value, torch.Tensor) or (
        type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value)
    )


class TransferActions:
    """send/recv of activations and gradients, wait_sends, send_tied/recv_tied/sum_tied."""

    mesh: Mesh | None
    placement: Placement
    source: ParamSource
    microbatches: Sequence[tuple[Any, Any]]
    boundaries: Sequence[Sequence[Boundary]] | None  # per micro-batch, per stage
    # each micro-batch predicted on itself (pipeline(follow_batches=True)); a split's name where asked for and off
    follow_batches: bool | str
    device: torch.device
    _outputs: dict[tuple[int, int], Any]
    _input_grads: dict[tuple[int, int], list[torch.Tensor]]
    _inbox: dict[tuple[str, int, int], Any]
    _sends: list[Handle]  # the tied weights' gradient sends
    _sent: dict[tuple[str, int, int], list[Handle]]  # the activation and gradient sends not let go of yet
    _posted: dict[tuple[str, int, int], list[Handle]] | None
    _to_post: list[Action]  # the receives not posted yet, the next last
    sends_delivered_by: Mapping[Key, tuple[Key, ...]]  # (send_delivery.grad_sends_delivered)
    _actions: Sequence[Action]
    _tied_parts: dict[int, dict[int, torch.Tensor]]
    _leaves: dict[tuple[str, str], torch.Tensor]
    _wide: WideGrads | None

    def send_activation(self, action: Action) -> None:
        s, m = action.require("stage"), action.mb
        # A stage that runs no backward (Placement.backward_from) has no later use of its output.
        output = self._outputs.pop((s, m)) if s < self.placement.backward_from else self._outputs[(s, m)]
        self._send(output, "activation", s, m, action)

    def send_grad(self, action: Action) -> None:
        s, m = action.require("stage"), action.mb
        self._send(tuple(self._input_grads.pop((s, m))), "grad", s, m, action)

    def _send(self, value: Any, kind: str, s: int, m: int, action: Action) -> None:
        leaves, spec = optree.tree_flatten(value)
        if self.boundaries is not None and kind == "activation":
            _check_predicted(leaves, spec, self.boundaries[m][s], s, m, self.follow_batches)
        if not leaves:
            raise ValueError(f"stage {s} passes no tensor to the next stage; a pipeline boundary carries at least one")
        strange = next((leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)), None)
        if strange is not None:
            raise ValueError(
                f"stage {s} passes a {type(strange).__name__} to the next rank inside {spec}: a pipeline boundary "
                "carries tensors, in the containers optree flattens (tuples, lists, dicts, named tuples, registered "
                "pytree nodes); return its tensors in one of those, or register the class with optree"
            )
        axis, dst, mb = action.require("axis"), action.require("peer"), len(self.microbatches)
        known = self.boundaries is not None
        if len(leaves) >= 1 << 10:
            raise ValueError(f"stage {s} passes {len(leaves)} tensors on; a transfer carries at most 1023")
        handles = self._sent.setdefault((kind, s, m), [])
        if not known:  # the receiver learns how many tensors follow, and what they are rebuilt into
            structure = None if kind == "grad" or _flat(value) else spec
            header = wire_structure.encode(len(leaves), structure)  # host-side control data
            handles.append(send(header, axis, dst, tag=tag_of(kind, s, m, mb), mesh=self.mesh))
        for i, leaf in enumerate(leaves, start=1):
            # No snapshot: nothing modifies a stage output or an input gradient in place once made, and
            # each send is waited for, once proven delivered or at wait_sends (where a peer's later receive is
            # posted as it goes). Unbounded: a backend's own wait for an old send, past many pending, could
            # wait for a receive the peer posts only after one from this rank (review of 52e9636: 1,040 sends).
            handles.append(
                send(leaf.detach(), axis, dst, tag=tag_of(kind, s, m, mb, i), announce=not known, snapshot=False,
                     bounded=False, mesh=self.mesh)
            )

    def _source_of(self, action: Action) -> tuple[str, int, int]:
        """(kind, producing stage, micro-batch) of a receive action."""
        s, m = action.require("stage"), action.mb
        return ("activation", s - 1, m) if action.kind == RECV_ACTIVATION else ("grad", s + 1, m)

    def _expected(self, kind: str, producer: int, m: int) -> Sequence[Layout]:
        """The tensors a transfer of micro-batch ``m`` carries, when predicted: an activation carries the
        producing stage's output, a gradient one tensor per output of the stage below that depends on a
        parameter."""
        assert self.boundaries is not None
        boundary = self.boundaries[m][producer if kind == "activation" else producer - 1]
        return boundary.leaves if kind == "activation" else boundary.grad_leaves()

    def _post_receives(self) -> None:
        """Post the step's first ``RECEIVES_AHEAD`` receives (see the module docstring)."""
        self._posted = {}
        self._to_post = [a for a in reversed(self._actions) if a.kind in (RECV_ACTIVATION, RECV_GRAD)]
        for _ in range(RECEIVES_AHEAD):
            self._post_next()

    def _post_next(self) -> None:
        """Post the next receive, if one is left. With predicted layouts every tensor is received as it is;
        otherwise the count and the first tensor (a transfer has at least one)."""
        if not self._to_post:
            return
        assert self._posted is not None
        action = self._to_post.pop()
        mb = len(self.microbatches)
        kind, producer, m = self._source_of(action)
        axis, src = action.require("axis"), action.require("peer")
        if self.boundaries is not None:
            self._posted[(kind, producer, m)] = [
                recv(axis, src, tag=tag_of(kind, producer, m, mb, i), like=like, device=self.device, mesh=self.mesh)
                for i, like in enumerate(self._expected(kind, producer, m), start=1)
            ]
        else:
            self._posted[(kind, producer, m)] = [
                recv(axis, src, tag=tag_of(kind, producer, m, mb), mesh=self.mesh),
                recv(axis, src, tag=tag_of(kind, producer, m, mb, 1), device=self.device, mesh=self.mesh),
            ]

    def receive(self, action: Action) -> None:
        if self._posted is None:
            self._post_receives()
        else:  # the one RECEIVES_AHEAD on from this one
            self._post_next()
        assert self._posted is not None
        kind, producer, m = self._source_of(action)
        posted = self._posted.pop((kind, producer, m))
        structure = None
        if self.boundaries is not None:
            leaves = [handle.wait() for handle in posted]
        else:
            (count, structure), mb = wire_structure.decode(posted[0].wait()), len(self.microbatches)
            leaves = [posted[1].wait()] + [
                recv(
                    action.require("axis"),
                    action.require("peer"),
                    tag=tag_of(kind, producer, m, mb, i),
                    device=self.device,
                    mesh=self.mesh,
                ).wait()
                for i in range(2, count + 1)
            ]
        if kind == "grad":
            value: Any = leaves
            self._let_go(("activation", action.require("stage"), m))  # the peer computed from it: delivered
        elif self.boundaries is not None:  # the stage output as it was made: a dict, a ModelOutput, ...
            value = optree.tree_unflatten(self.boundaries[m][producer].spec, leaves)
        elif structure is not None:  # unpredicted, and not flat: its structure came with it
            value = optree.tree_unflatten(structure, leaves)
        else:
            value = leaves[0] if len(leaves) == 1 else tuple(leaves)
        self._inbox[(kind, action.require("stage") if kind == "activation" else producer, m)] = value
        for sent in self.sends_delivered_by.get((kind, action.require("stage"), m), ()):
            self._let_go(sent)

    def _let_go(self, key: tuple[str, int, int]) -> None:
        for handle in self._sent.pop(key, ()):
            handle.wait()

    def wait_sends(self, action: Action) -> None:
        for key in list(self._sent):  # delivered: the peers post every receive of this step in theirs
            self._let_go(key)
        for handle in self._sends:
            handle.wait()
        self._sends.clear()

    def _tied_grad(self, i: int) -> torch.Tensor:
        owner, name, _users = self.placement.tied[i]
        leaf = self._leaves.get((owner, name))
        grad = self._wide.fold((owner, name), leaf) if self._wide is not None else (
            None if leaf is None else leaf.grad)
        if grad is not None:
            if self._wide is not None and leaf is not None:
                self._wide.keep((owner, name), leaf, grad)  # (read again: sent, then summed)
            return grad
        return torch.zeros_like(self._held_param(owner, name))  # this rank's layers did not reach it

    def _held_param(self, owner: str, name: str) -> torch.Tensor:
        if self.source.compute is not None:
            return self.source.compute[owner][name]
        sharding = self.source.sharding
        assert sharding is not None, "a rank holds its parameters either as compute copies or as ZeRO units"
        lay = sharding.units[owner]
        shape = lay.shapes[lay.names.index(name)]
        return torch.zeros(shape, dtype=self.source.gather_dtype(owner), device=self.device)

    def send_tied(self, action: Action) -> None:
        i = action.require("tied")
        self._sends.append(
            send(
                self._tied_grad(i),
                action.require("axis"),
                action.require("peer"),
                tag=TIED_TAG_BASE + i,
                mesh=self.mesh,
            )
        )

    def recv_tied(self, action: Action) -> None:
        i = action.require("tied")
        mine = self._tied_grad(i)
        got = recv(
            action.require("axis"), action.require("peer"), tag=TIED_TAG_BASE + i, device=mine.device, mesh=self.mesh
        ).wait()
        self._tied_parts.setdefault(i, {})[action.require("peer")] = got

    def sum_tied(self, action: Action) -> None:
        """Every copy's gradient summed in axis order, so each copy takes the same update."""
        i = action.require("tied")
        owner, name, users = self.placement.tied[i]
        me = self.placement.index_of(self.mesh)
        parts = {**self._tied_parts.pop(i, {}), me: self._tied_grad(i)}
        for handle in self._sends:
            handle.wait()
        self._sends.clear()
        total = parts[users[0]]
        for peer in users[1:]:
            total = total + parts[peer]
        leaf = self._leaves.get((owner, name))
        if leaf is None:
            leaf = self._leaves[(owner, name)] = self._held_param(owner, name).detach().requires_grad_(True)
        if self._wide is not None:
            self._wide.keep((owner, name), leaf, total)
        else:
            leaf.grad = total

