"""The executor's backward actions: a stage's whole backward (``B``), or its input part (``I``, handed
upstream at once, the graph kept) and later its weight part (``W``); runs of whole backwards on
consecutive stages as one autograd call (``run_shape.py``). Weight gradients accumulate in the
step's leaves as ``loss.backward()`` accumulates ``.grad``. A mixin of
:class:`~shardwise.engine.run.executor.Executor`, whose fields it uses.
"""

from __future__ import annotations

import math
import re
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..layout.state_layout import Placement
from ..model.chain import Chain
from ..model.module_call import module_fn
from ..model.split_backward import WeightPart, input_part, recomputes, weight_part
from ..plan.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, Action
from ..torch_api import accumulate_backward, computed_dtype, version_of
from .cut_graphs import refuse_reached_elsewhere
from .wide_grads import WideGrads

_NARROW = (torch.float16, torch.bfloat16)  # (a float32 or wider loss holds any loss scale)


@dataclass
class Saved:
    inputs: list[torch.Tensor]  # leaves that require grad (empty for stage 0, and for a joined stage)
    params: dict[tuple[str, str], torch.Tensor]  # (owner layer, local name) -> the step's leaf
    outputs: list[torch.Tensor]  # float leaves of the stage output (or [loss] on the last stage)
    output_grads: list[torch.Tensor | None] | None = None  # kept between I and W
    weight_part: WeightPart | None = None  # what I left for W (split_backward)
    # A joined stage (its input left on the previous stage's graph): whether a gradient reached that
    # input in the backward (set by a hook on it); None for a stage whose input is cut.
    reached: list[bool] | None = None


def reaches(y: torch.Tensor, x: torch.Tensor, budget: int = 32) -> bool | None:
    """Whether ``y``'s autograd graph leads to ``x`` (its producing node, at ``x``'s output index): True
    or False once the walk is done, None when the graph has more than ``budget`` nodes (then ask a
    hook). A layer's backward reaches its input exactly when its graph leads there."""
    if y is x:
        return True
    target, index, start = x.grad_fn, x.output_nr, y.grad_fn
    if target is None or start is None:
        return None
    # Breadth first: a residual block's output is its input plus a branch, so the input's node is
    # two levels down, where a depth-first walk would spend the budget inside the branch first.
    queue, seen, head = [start], {start}, 0
    while head < len(queue):
        budget -= 1
        if budget < 0:
            return None
        head += 1
        for node, nr in queue[head - 1].next_functions:
            if node is None:
                continue
            if node is target and nr == index:
                return True
            if node not in seen:
                seen.add(node)
                queue.append(node)
    return False


def mark_reached(reached: list[bool], k: int, grad: torch.Tensor) -> None:
    """A joined stage input's gradient hook: note that a gradient reached it (and leave it as it is)."""
    reached[k] = True


_CHECKPOINT_INSIDE = (
    "shardwise: a layer calls torch.utils.checkpoint in its forward (its own call, or a checkpoint_wrapper): "
    "the checkpoint runs the forward again in this backward, outside the pure layer's call, on parameters "
    "the layer does not hold, which cannot work. Take the checkpoint out of the layer and recompute with "
    "sw.remat(step) (for a Hugging Face model: model.activation_checkpointing_disable())."
)


# torch's words for a tensor on the meta device met in an op: a layer's module holds meta stand-ins outside its call.
_META = re.compile(r"\bdevice meta\b|\bmeta tensor|on the meta device|device='meta'|device=meta\b")
_HOOK_READS_MODULE = (
    "shardwise: a tensor on the meta device met in the backward: a hook the forward registered "
    "(h.register_hook(...)) or a module's backward hook likely reads its module's tensors (self.scale, a buffer, "
    "a weight) after the layer's call, where the step's copy of the module holds meta stand-ins. Read the tensor "
    "in forward and let the hook close over the value (scale = self.scale; h.register_hook(lambda g: g * scale))."
)


_BUFFERS: weakref.WeakKeyDictionary[Chain, tuple[tuple[str, str, torch.Tensor], ...]] = weakref.WeakKeyDictionary()


def buffers_of(chain: Chain) -> tuple[tuple[str, str, torch.Tensor], ...]:
    """(layer, name, tensor) of every buffer the chain's layers carry that is state, not a frozen weight (a
    frozen base's are not written, and may be most of the model); read once per chain (a Layer's buffers are
    fixed when it is made)."""
    found = _BUFFERS.get(chain)
    if found is None:
        found = _BUFFERS[chain] = tuple((layer.name, name, t) for layer in chain for name, t in layer.buffers.items()
                                        if name not in layer.frozen and not t.is_meta)
    return found


_STAND_INS: weakref.WeakKeyDictionary[Chain, tuple[tuple[str, str, torch.Tensor], ...]] = weakref.WeakKeyDictionary()


def stand_in_buffers(chain: Chain) -> tuple[tuple[str, str, torch.Tensor], ...]:
    """(layer, name, meta tensor) of the buffers each layer's copy of its module holds between its calls (the
    skeleton's, which every thread's copy shares): a hook that writes its module's buffer after the call (in
    backward) writes one of these, and the write is lost. Read once per chain."""
    found = _STAND_INS.get(chain)
    if found is None:
        out = []
        for layer in chain:
            module = getattr(getattr(module_fn(layer.fn), "replicas", None), "module", None)
            if isinstance(module, torch.nn.Module):
                out += [(layer.name, name, t) for name, t in module.named_buffers() if t.is_meta]
        found = _STAND_INS[chain] = tuple(out)
    return found


def _written_after_the_call(written: list[tuple[str, str]]) -> str:
    listed = ", ".join(f"{name!r} of layer {layer!r}" for layer, name in written[:4])
    return (
        f"the buffers {listed} were written during the backward, through the step's copy of the layer's module (a "
        "backward hook it holds as a bound method, or a hook its forward registered on a tensor, keeping a "
        "statistic in self). After the layer's call that copy holds meta stand-ins, so the write is lost and the "
        "forwards reading the buffer would compute another model than torch's loop. Keep the statistic outside "
        "the module (a hook closing over a tensor of your own), or compute it from the gradients after the step."
    )


def _written_in_backward(written: list[tuple[str, str]], cut: str) -> str:
    listed = ", ".join(f"{name!r} of layer {layer!r}" for layer, name in written[:4])
    return (
        f"the buffers {listed} were written during the backward (a module's backward hook, or a hook a forward "
        f"registered on a tensor, that keeps a gradient statistic in its module). This step cuts the batch "
        f"({cut}): each backward sees one share of it, so the buffer would hold a share's statistic (each process "
        "rank its own, thread ranks writing the one tensor at once), where torch's loop computes it from the whole "
        "batch, and the forwards reading it would compute another model. Compute the statistic from the "
        "gradients after the step (step.full_params / the returned metrics), or train without cutting the batch "
        "(one device, no accumulation or pipeline)."
    )


def _raised_in_checkpoint(err: BaseException) -> bool:
    """Whether ``err`` was raised inside torch.utils.checkpoint (its traceback passes through it)."""
    module = sys.modules.get("torch.utils.checkpoint")  # not imported: nothing ran a checkpoint
    where = getattr(module, "__file__", None)
    if where is None:
        return False
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == where:
            return True
        tb = tb.tb_next
    return False


class StageBackward:
    """backward (B, I and W)."""

    chain: Chain
    placement: Placement
    seed: float
    whole_seed: float | None
    static_scale: bool
    poison: bool
    _saved: dict[tuple[int, int], Saved]
    _outputs: dict[tuple[int, int], Any]
    _input_grads: dict[tuple[int, int], list[torch.Tensor]]
    _inbox: dict[tuple[str, int, int], Any]
    _tops: Mapping[tuple[int, int], int]
    _covered: frozenset[tuple[int, int]]
    _wide: WideGrads | None
    graph_watch: Any
    batch_cut: str | None
    _rank: int

    if TYPE_CHECKING:
        def _earlier_layers_own_params(self, s: int) -> bool: ...

    def backward(self, action: Action) -> None:
        # Where the batch is cut, a buffer written in backward (a module's backward hook keeping a gradient
        # statistic) would hold a share's statistic, per rank, or one every thread rank writes: refused.
        watched = buffers_of(self.chain) if self.batch_cut is not None else ()
        # A write through ``.data`` moves another version counter: on the first call (on this thread) the
        # contents are compared too, of the buffers that are state (not frozen weights: a frozen base may be most
        # of the model), and only where the batch is cut.
        contents = [t.clone() for _, _, t in watched if t.is_floating_point()] \
            if watched and self.graph_watch is not None else None
        lost = stand_in_buffers(self.chain)
        # (no list made where there is nothing to watch: the hot path counts its calls, test_step_hot_path)
        versions = [version_of(t) for _, _, t in watched] if watched else None
        lost_versions = [version_of(t) for _, _, t in lost] if lost else None
        try:
            self._backward(action)
        except Exception as err:
            # (sw.remat's regions run torch's checkpoint too: a failure there is not a layer's own call)
            if _raised_in_checkpoint(err) and not recomputes(layer.fn for layer in self.chain):
                err.add_note(_CHECKPOINT_INSIDE)
            elif isinstance(err, RuntimeError) and _META.search(str(err)):
                err.add_note(_HOOK_READS_MODULE)
            raise
        if lost_versions is not None:
            written = [(layer, name) for (layer, name, t), v in zip(lost, lost_versions, strict=True)
                       if version_of(t) != v]
            if written:
                raise ValueError(_written_after_the_call(written))
        if versions is not None:
            written = [(layer, name) for (layer, name, t), v in zip(watched, versions, strict=True)
                       if version_of(t) != v]
            if not written and contents is not None:
                floating = [(layer, name, t) for layer, name, t in watched if t.is_floating_point()]
                written = [(layer, name) for (layer, name, t), c in zip(floating, contents, strict=True)
                           if not torch.equal(t, c)]
            if written:
                raise ValueError(_written_in_backward(written, self.batch_cut or ""))

    def _backward(self, action: Action) -> None:
        s, m = action.require("stage"), action.mb
        if (s, m) in self._covered:  # done by the call of the run's top stage
            return
        lowest = self._tops.get((s, m))
        if lowest is not None:
            self._joined_backward(s, lowest, m)
            return
        saved = self._saved[(s, m)]
        want_inputs = action.kind in (BACKWARD, BACKWARD_INPUT)
        want_weights = action.kind in (BACKWARD, BACKWARD_WEIGHT)
        if saved.weight_part is not None:  # W after its I: only the weights' branches
            self._widen(saved.params.items())
            weight_part(saved.weight_part)
            saved.weight_part = None
            self._weights_done(s, m, saved)
            return
        if saved.output_grads is None:
            saved.output_grads = self._output_grads(s, m, saved)
        pairs = [
            (o, g) for o, g in zip(saved.outputs, saved.output_grads, strict=True) if g is not None and o.requires_grad
        ]
        outputs, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        if self.graph_watch is not None and outputs:
            self._refuse_reached_elsewhere(s, s, outputs, [*saved.inputs, *saved.params.values()])
        got: list[torch.Tensor | None] = [None] * len(saved.inputs)
        if want_inputs and not want_weights and pairs and saved.inputs:  # I: the graph stays for W
            whole = recomputes(self.chain[n].fn for n in self.placement.stages[s])
            got, saved.weight_part = input_part(outputs, seeds, saved.inputs, list(saved.params.values()), whole=whole)
        elif want_weights and pairs:
            # B or W: weight gradients accumulate into the step's leaves (in place after the first);
            # B also leaves each input's gradient in its (per micro-batch) leaf.
            wrt = (saved.inputs if want_inputs else []) + list(saved.params.values())
            self._widen(saved.params.items())
            if wrt:
                accumulate_backward(outputs, seeds, wrt)
            if want_inputs:
                got = [x.grad for x in saved.inputs]
        if want_inputs:
            if saved.inputs and all(g is None for g in got) and self._earlier_layers_own_params(s):
                self._not_reaching(s)
            # An input the stage did not use still gets a (zero) gradient: upstream expects one per output.
            self._input_grads[(s, m)] = [
                g if g is not None else torch.zeros_like(x) for g, x in zip(got, saved.inputs, strict=True)
            ]
        if want_weights:
            self._weights_done(s, m, saved)

    def _weights_done(self, s: int, m: int, saved: Saved) -> None:
        del self._saved[(s, m)]
        if self.poison:
            self._poison(s, saved)

    def _joined_backward(self, top: int, lowest: int, m: int) -> None:
        """The whole backwards of stages ``top`` down to ``lowest`` (micro-batch ``m``) as one autograd
        call: weight gradients into the step's leaves, ``lowest``'s input gradients kept for the stage
        below, as the backwards one by one would leave them."""
        saved = self._saved[(top, m)]
        bottom = self._saved[(lowest, m)]
        grads = self._output_grads(top, m, saved)
        pairs = [(o, g) for o, g in zip(saved.outputs, grads, strict=True) if g is not None and o.requires_grad]
        # Every stage's leaves once (a tied weight is a leaf of each stage that uses it), in stage order.
        leaves = {id(leaf): leaf for s in range(lowest, top + 1) for leaf in self._saved[(s, m)].params.values()}
        wrt = [*bottom.inputs, *leaves.values()]
        if self.graph_watch is not None and pairs:
            self._refuse_reached_elsewhere(top, lowest, [o for o, _ in pairs], wrt)
        self._widen(p for s in range(lowest, top + 1) for p in self._saved[(s, m)].params.items())
        if pairs and wrt:
            accumulate_backward([o for o, _ in pairs], [g for _, g in pairs], wrt)
        for s in range(top, lowest, -1):  # each joined input must have had a gradient, as in backward
            part = self._saved[(s, m)]
            if part.reached and not any(part.reached) and self._earlier_layers_own_params(s):
                self._not_reaching(s)
            self._outputs.pop((s - 1, m), None)
        got = [x.grad for x in bottom.inputs]
        if bottom.inputs and all(g is None for g in got) and self._earlier_layers_own_params(lowest):
            self._not_reaching(lowest)
        self._input_grads[(lowest, m)] = [
            g if g is not None else torch.zeros_like(x) for g, x in zip(got, bottom.inputs, strict=True)
        ]
        saved.output_grads = grads
        for s in range(lowest, top + 1):
            part = self._saved.pop((s, m))
            if self.poison and s in (lowest, top):
                self._poison(s, part)

    def _refuse_reached_elsewhere(
        self, top: int, lowest: int, outputs: list[torch.Tensor], wrt: list[torch.Tensor]
    ) -> None:
        """On a watched step (its first call on this thread): refuse the backward of stages ``lowest`` to
        ``top`` where its graph reaches another stage's leaves, or another rank's (``cut_graphs.py``)."""
        stages = self.placement.stages
        what = "the loss" if top == self.placement.last else f"layer {stages[top][-1]!r}"
        first, last = stages[lowest][0], stages[top][-1]
        alone = f"the step runs the backward of layer {first!r} alone" if first == last else \
            f"the step runs the backward of layers {first!r} to {last!r} alone"
        refuse_reached_elsewhere(outputs, wrt, what, self._rank, alone)

    def _widen(self, leaves: Iterable[tuple[tuple[str, str], torch.Tensor]]) -> None:
        """Before a backward into ``leaves``: an earlier micro-batch's gradients they hold go into their sums in
        the reduce dtype (wide_grads.py), so that torch does not add this one's to them in the compute dtype."""
        if self._wide is not None:
            self._wide.take(leaves)

    def _seed_in(self, dtype: torch.dtype) -> float:
        """The loss gradient of one micro-batch, whose loss was computed in ``dtype`` (before any cast to a wider one):
        its share of the loss scale; or inf where the whole scale is not finite in that dtype (a float16 loss,
        computed inside the model and cast to float32 by the policy's output, under the default
        dynamic scale 65536), as the single-device step's seed is: its step skips, so every layout's does (a
        part's share alone, 32768 at dp 2, would not overflow, and a step one device skips would train)."""
        whole = self.whole_seed
        if whole is None or dtype not in _NARROW or not math.isinf(float(torch.tensor(whole).to(dtype))):
            return self.seed
        if self.static_scale:
            raise ValueError(
                f"the loss is {dtype} (computed inside the model, before the precision policy's output cast) and the "
                f"static loss scale {whole:g} is not finite in {dtype}: the loss gradient the backward starts from "
                "overflows, and every step would be skipped. Give a scale below "
                f"{torch.finfo(dtype).max:g} (loss_scale=32768.0), compute the loss in loss_fn from the model's "
                "output, or compute the last layer in float32 (mixed_precision(overrides={layer: 'compute=f32'}))"
            )
        return math.inf

    def _not_reaching(self, s: int) -> None:
        previous = self.placement.stages[s - 1][-1]
        raise ValueError(
            f"the output of layer {previous!r} does not reach the loss: no gradient flows back through "
            f"layer {self.placement.stages[s][0]!r}, so the layers before it would never train; make the "
            "next layers use their input (a layer that ignores it cuts the chain)"
        )

    def _output_grads(self, s: int, m: int, saved: Saved) -> list[torch.Tensor | None]:
        if s == self.placement.last:
            loss = saved.outputs[0]
            narrowest = computed_dtype(loss) if self.whole_seed is not None else loss.dtype
            return [torch.full_like(loss, self._seed_in(narrowest))]
        if self.placement.stage_rank[s + 1] == self.placement.stage_rank[s]:
            grads: Sequence[torch.Tensor] = self._input_grads.pop((s + 1, m))
        else:
            grads = self._inbox.pop(("grad", s + 1, m))
        self._outputs.pop((s, m), None)
        if len(grads) != len(saved.outputs):
            raise RuntimeError(
                f"stage {s}, micro-batch {m}: {len(grads)} gradients came back for {len(saved.outputs)} outputs"
            )
        return list(grads)

    def _poison(self, s: int, saved: Saved) -> None:
        """Fill what this (stage, micro-batch) received with NaN once it is used up: reusing a stale
        buffer would then show in the result. That is the activations received from another rank
        and the output gradients, also those handed over in memory (nothing uses them after this
        backward); activations handed over in memory are left alone (their producer's graph holds them)."""
        received = list(saved.output_grads or []) if s != self.placement.last else []
        if s > 0 and self.placement.stage_rank[s - 1] != self.placement.stage_rank[s]:
            received += saved.inputs
        with torch.no_grad():
            for t in received:
                if t is not None:
                    t.fill_(float("nan"))
