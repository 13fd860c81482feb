"""A rank's TrainState from a checkpoint, each tensor read straight into what the rank keeps.

The rank's tensors are made first, empty, as ``step.init`` would lay them out on the mesh (the target's
:class:`StateLayout`): where ZeRO holds shards at rest (stage 3; stages 1-2 under a narrowing precision
policy) one flat shard per unit, else each parameter's tensor-parallel slice; the optimizer's per-parameter
state as flat shards under ZeRO, else slices; the padding of a shard zero. Then every saved record that meets
them is read into them (``regions.placed_boxes`` and ``Reader.read_into``): no tensor of a parameter's global
shape is ever built, so a load's memory is the rank's state plus one read (``record_io``).
Only ZeRO-1/2's optimizer shards are cut, one unit at a time, from the whole parameters those
stages keep anyway (where they keep whole parameters: no narrowing precision policy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...collectives.mesh import Mesh
from ..layout.precision import DynamicLossScale, NoLossScale, StaticLossScale
from ..layout.sharding import FlatSharding
from ..layout.state import TrainState
from ..layout.state_layout import StateLayout
from ..optim.expected_state import expected_opt_states
from .cut import local_keys, rebuild_opt_state, split_opt_state
from .file_format import CheckpointError, Reader, dtype_of
from .opt_structure import mirror_dtypes, template_from_record, update_name
from .regions import placed_boxes

_LOSS_SCALES = {cls.__name__: cls for cls in (NoLossScale, StaticLossScale, DynamicLossScale)}
Params = dict[str, dict[str, torch.Tensor]]


class _Filler:
    """Makes this rank's tensors of one saved tree (``"model"``, or ``"optim.<path>"``) and reads
    the checkpoint into them."""

    def __init__(self, reader: Reader, layout: StateLayout, mesh: Mesh | None,
                 keys: Mapping[tuple[str, str], str], device: torch.device) -> None:
        self.reader, self.layout, self.keys, self.device = reader, layout, keys, device
        self.coords = {} if mesh is None else mesh.coords  # asked once: a mesh works them out per call

    def slices(self, prefix: str, like: Mapping[str, Mapping[str, torch.Tensor]],
               sharding: FlatSharding | None = None) -> Params:
        """Each parameter's tensor-parallel slice (of ``like``'s shapes and dtypes), read whole; a
        ZeRO-1/2 unit's laid out in its flat buffer, as ``init`` lays them (``UnitLayout.laid_out``)."""
        out: Params = {}
        for layer, tensors in like.items():
            unit = None if sharding is None else sharding.units.get(layer)
            laid = None if unit is None or any(t.dtype != unit.dtype for t in tensors.values()) else \
                unit.laid_out_empty(self.device)
            out[layer] = {}
            for name, t in tensors.items():
                into = torch.empty(t.shape, dtype=t.dtype, device=self.device) if laid is None else laid[name]
                self._read(prefix, layer, name, into, shard=False)
                out[layer][name] = into
        return out

    def shards(self, prefix: str, sharding: FlatSharding, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's flat shard of every unit (of ``like``'s dtypes), its padding zero."""
        dp = self.coords[sharding.axis]
        out: dict[str, torch.Tensor] = {}
        for unit, lay in sharding.units.items():
            into = torch.empty(lay.shard_numel, dtype=like[unit].dtype, device=self.device)
            into[max(min(lay.numel - dp * lay.shard_numel, lay.shard_numel), 0) :].zero_()  # padding
            for name in lay.names:
                self._read(prefix, unit, name, into, shard=True)
            out[unit] = into
        return out

    def _read(self, prefix: str, layer: str, name: str, into: torch.Tensor, *, shard: bool) -> None:
        placed = placed_boxes(self.layout, self.coords, layer, name, into, shard=shard)
        self.reader.read_into(f"{prefix}.{self.keys[(layer, name)]}", placed)


def build_state(reader: Reader, meta: Mapping[str, Any], step: Any, mesh: Mesh | None,
                params_meta: Params, keys: Mapping[tuple[str, str], str], device: torch.device
                ) -> tuple[TrainState, list[str]]:
    """This rank's TrainState for ``step`` on ``mesh``, read from the checkpoint of ``meta``
    (whose parameters, as meta tensors, are ``params_meta``, saved under ``keys``), and the paths of
    the optimizer's other tensors it holds (a pipeline stage holds its parameters' only: the ranks
    together must want every one saved, which ``load`` checks)."""
    layout = step.layout(mesh, params_meta)
    local = local_keys(layout, layout.index_of(mesh), {layer: list(ts) for layer, ts in params_meta.items()})
    # What this rank computes with, as meta tensors: its tensor-parallel slices in the master dtype.
    sliced = {layer: {n: torch.empty(layout.leaves[(layer, n)].local_shape, dtype=params_meta[layer][n].dtype,
                                     device="meta") for n in names} for layer, names in local.items()}
    master = step.master_params(sliced)
    filler = _Filler(reader, layout, mesh, keys, device)
    sharding = layout.sharding
    update_meta: Any = master  # what the optimizer updates (and its state mirrors), as meta
    if sharding is None or not sharding.holds_shards:  # ZeRO-1/2 keep whole parameters too
        held: Any = filler.slices("model", master, sharding)
    if sharding is not None:
        unit_like = {u: next(iter(master[u].values())) for u in sharding.units}
        update_meta = {u: torch.empty(lay.shard_numel, dtype=unit_like[u].dtype, device="meta")
                       for u, lay in sharding.units.items()}
        if sharding.holds_shards:
            held = filler.shards("model", sharding, unit_like)
    saved = meta["optimizer"]
    where = f"checkpoint {reader.directory}"

    def mirror_like(path: str) -> Any:  # a mirror of the saved state's record, in the dtypes it was saved in
        if sharding is None:
            return {layer: {n: torch.empty(t.shape, device="meta", dtype=mirror_dtypes(
                meta["tensors"], path, [keys[(layer, n)]], where)) for n, t in ts.items()}
                for layer, ts in master.items()}
        return {u: torch.empty(t.shape, device="meta", dtype=mirror_dtypes(
            meta["tensors"], path, [keys[(u, n)] for n in sharding.units[u].names], where))
            for u, t in update_meta.items()}

    def scalar_like(path: str) -> torch.Tensor:
        spec = meta["tensors"].get(f"optim.{path}")
        if spec is None:
            raise CheckpointError(f"{where}: its optimizer state's {path} is missing from its tensors")
        return torch.empty(spec["shape"], dtype=dtype_of(spec["dtype"], f"{where}: optim.{path}"), device="meta")

    def from_record(record: Any) -> Any:
        ours = update_name(step.optimizer)
        if saved.get("update") != ours:
            raise CheckpointError(
                f"{where}: its optimizer state was saved by the update {saved.get('update')}, this step's is {ours}, "
                "whose state is known only from the record save made of it (its update reads values and cannot "
                "be predicted): load it with the optimizer that saved it"
            )
        return template_from_record(record, mirror_like, scalar_like, where)

    template, wanted_mirrors, wanted_scalars = _template(step.optimizer, update_meta, saved, from_record)
    if wanted_mirrors != saved["mirrors"] or not set(wanted_scalars) <= set(saved["scalars"]):
        raise CheckpointError(
            f"checkpoint {reader.directory}: its optimizer state has per-parameter {saved['mirrors']} and "
            f"{saved['scalars']}, this step's optimizer has {wanted_mirrors} and {wanted_scalars}; "
            + other_optimizer_or_layout(set(saved["scalars"]), set(wanted_scalars), wanted_mirrors == saved["mirrors"])
        )

    def mirror(path: str, like: Any) -> Any:
        if sharding is None:
            return filler.slices(f"optim.{path}", like)
        return filler.shards(f"optim.{path}", sharding, like)

    def scalar(path: str, like: torch.Tensor) -> torch.Tensor:
        t = reader.full(f"optim.{path}")
        if t.shape != like.shape:
            raise CheckpointError(
                f"checkpoint {reader.directory}: optim.{path} has shape {list(t.shape)}, "
                f"this optimizer's {list(like.shape)}"
            )
        return t.to(device=device if like.is_meta else like.device, dtype=like.dtype)

    opt_state = rebuild_opt_state(template, update_meta, mirror, scalar)
    extra = {"rng": meta["rng"]} if "rng" in TrainState._fields and meta.get("rng") is not None else {}
    return TrainState(held, opt_state, int(meta["step"]), _loss_scale(meta, step, reader.directory), mesh=mesh,
                      layout=layout, **extra), wanted_scalars


def _template(optimizer: Any, update_meta: Any, saved: Mapping[str, Any],
              from_record: Callable[[Any], Any]) -> tuple[Any, list[str], list[str]]:
    """The optimizer state to rebuild the saved one as (meta tensors), with its per-parameter and other paths:
    init's, or, for a user's optimizer that makes its state at its first update, what one update makes of
    init's where it runs on meta tensors and matches what was saved (opt_check.expected_opt_states). Where
    that update reads values (it cannot run on meta tensors), nothing predicts its state: it is rebuilt as
    save recorded it (``from_record(saved["structure"])``, opt_structure.py), and the step confirms it by what
    its first update makes of it (state_check.py). A checkpoint saved before that record (or by ranks whose
    states differ in structure) has none: init's is then refused below, naming both layouts. A predicted
    state is never replaced by the record: a checkpoint of another optimizer is refused, not loaded."""
    made: list[tuple[Any, list[str], list[str]]] = []
    known = True
    for after_update in (False, True):  # init's first: predicting the update on meta imports sympy (expected_state.py)
        candidates, known = expected_opt_states(optimizer, update_meta, after_update)
        for template in candidates[len(made):]:
            mirrors, scalars = (sorted(x) for x in split_opt_state(template, update_meta))
            if mirrors == saved["mirrors"] and set(scalars) <= set(saved["scalars"]):
                return template, mirrors, scalars
            made.append((template, mirrors, scalars))
    if not known and saved.get("structure") is not None:
        template = from_record(saved["structure"])
        mirrors, scalars = (sorted(x) for x in split_opt_state(template, update_meta))
        return template, mirrors, scalars
    return made[0]


def _loss_scale(meta: Mapping[str, Any], step: Any, directory: Path) -> Any:
    """The loss scale the loaded state goes on with: where this step scales its loss the same way, a dynamic
    scale carries on from where it was (its scale and count of good steps) under this step's settings (growth,
    backoff, interval, floor), and a static scale is this step's; else this step's own starting value. The
    parameters and the optimizer's state are saved unscaled, so a run that moves to another policy
    (fp16 with a dynamic scale to bf16, which needs none; bf16 to float32) loses nothing but the other
    policy's scale: a checkpoint of a bf16 run was refused by a float32 step, naming a NoLossScale the
    user never chose and cannot name."""
    initial = step.initial_loss_scale()
    saved = meta["loss_scale"]
    if saved is None or initial is None or type(initial).__name__ != saved["type"]:
        return initial  # nothing to restore, or this step scales otherwise (or not at all): its own start
    try:  # a loss scale checks its fields when made, also those a checkpoint carries
        restored = _LOSS_SCALES[saved["type"]](**saved["fields"]).checked()
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {directory} carries a loss scale no step can run with ({saved['type']} with "
            f"{saved['fields']}): {error}. It was saved by a shardwise that did not check loss scales yet, "
            "and the run it comes from skipped or mis-scaled its steps with it"
        ) from error
    # The step's settings (a static scale is one; a dynamic one's growth and backoff), as the optimizer's
    # hyperparameters are the step's: what was saved goes on, the scale a dynamic rule reached and its count of
    # good steps. (Taken whole, a StaticLossScale(128) step resumed at the saved 4096, without a word.)
    if isinstance(restored, DynamicLossScale) and isinstance(initial, DynamicLossScale):
        scale = max(float(restored.scale), float(initial.min_scale))  # (this step's floor may be higher)
        return initial._replace(scale=scale, good_steps=restored.good_steps).checked()
    return initial


def other_optimizer_or_layout(saved: set[str], wanted: set[str], same_mirrors: bool = True) -> str:
    """How to load a checkpoint whose optimizer tensors of its own (not shaped like the parameters) are
    not the ones this step's optimizer wants: with the optimizer that saved it; or, where one side's
    keys are the other's by layer (``step.0`` against ``step.0.weight``: the same optimizer's per-tensor
    value, saved per ZeRO unit and wanted per parameter, or the other way), under the layout that
    saved it."""
    def under(keys: set[str], units: set[str]) -> bool:
        # each key one of a unit's (``t.blocks.0.blocks.0.attn.proj.bias`` of ``t.blocks.0``: a parameter's own
        # name has dots too, so not its last part stripped)
        return bool(keys) and all(any(k.startswith(u + ".") for u in units) for k in keys)

    if same_mirrors and wanted and not wanted <= saved and (under(wanted, saved) or under(saved, wanted)):
        return ("the optimizer keeps a value of its own per tensor it updates (a torch-style step count): one per "
                "ZeRO unit (its flat shard) under shard_params, one per parameter elsewhere, so that state "
                "reshards only between layouts that update the same tensors; load it under the ZeRO stage (or "
                "the absence of one) that saved it")
    return ("load it with the optimizer that saved it, or start this step from its weights alone (a fresh optimizer "
            "state): sw.checkpoint.init_from_dcp(step, path, mesh, prefix='model.')")
