"""What the call-recording split (``capture.py``) refuses about the model as a whole, and the words it
refuses in: a unit clashing with a layer's name, LayerDrop, a model collecting its layers' outputs, a
unit output beyond the hidden state read by the code around the units, a unit's inside read outside it, a
replay that did not run the units the example did."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from .carry import (
    BRIDGE,
    EMBED,
    HEAD,
)
from .changed_inputs import LeafIndices, leaf_names
from .fx_split import FunctionalizeError


def refuse_clash(paths: list[str], names: Sequence[str]) -> None:
    clash = [path for path in paths if path in names]
    if not clash:
        return
    what = {EMBED: "before the first unit", HEAD: "after the last unit"}.get(clash[0], "between two segments of units")
    raise FunctionalizeError(
        f"functionalize(units=...): the unit {clash[0]!r} has the name of the layer functionalize makes of "
        f"the code {what} ({EMBED!r}, {HEAD!r} and {BRIDGE!r} hold what runs around the units): leave "
        f"{clash[0]!r} out of units, and that layer holds it"
    )


def refuse_collecting(root: nn.Module, collecting: list[tuple[str, str]]) -> None:
    """A model collecting its layers' outputs while they run (``hf_collecting``): split, the layers run one
    by one outside its forward and the code after them would collect nothing."""
    if not collecting:
        return
    unit = collecting[0][0]
    keys = list(dict.fromkeys(key for _, key in collecting))
    flags = ", ".join(f"output_{key.removeprefix('cross_')}=False" for key in keys)
    aux = ("; for the MoE blocks sw.router_aux_loss knows, it adds their load-balancing loss over the whole batch"
           if "router_logits" in keys else "")
    forcing = _forcing_hidden_states(root) if "hidden_states" in keys else None
    way_out = (f"{forcing} forces output_hidden_states=True on its model whatever the config, the call or the batch "
               "say (transformers' filter_output_hidden_states), so it cannot be turned off: split with units=None "
               "(one layer)" if forcing is not None else
               f"Turn it off ({flags}, in the config, the call or the batch), or split with units=None (one layer)")
    raise FunctionalizeError(
        f"functionalize: {type(root).__name__}'s forward collects its layers' {', '.join(keys)} while they run "
        f"(unit {unit!r} among them), through hooks its own call sets up; split into units, the layers run one "
        f"by one and the code after them would collect nothing. {way_out}{aux}"
    )


def _forcing_hidden_states(root: nn.Module) -> str | None:
    """The class of the first module of ``root`` whose forward transformers wraps to always collect the hidden
    states (``filter_output_hidden_states``: Wav2Vec2ForSequenceClassification, the vision backbones), or None."""
    for module in root.modules():
        forward: Any = type(module).forward
        while forward is not None:  # (functools.wraps copies the name: the wrapper's code tells it)
            code = getattr(forward, "__code__", None)
            if "filter_output_hidden_states" in str(getattr(code, "co_qualname", "")):
                return type(module).__name__
            forward = getattr(forward, "__wrapped__", None)
    return None


def extra_refused(unit: str, k: int, user: str) -> FunctionalizeError:
    return FunctionalizeError(
        f"functionalize: unit {unit!r} returns a tensor at output[{k}] besides its hidden state, and {user}; "
        "only the hidden state (output[0]), and what a unit hands the later units of its own loop (T5's "
        "position bias), pass from one unit to the next. If it is an optional output, turn it off "
        "(output_attentions=False, use_cache=False); else split with units=None (one layer) or choose units "
        "that return only the hidden state."
    )


def read_inside_unit(path: str, name: str) -> str:
    return (
        f"functionalize: the model's forward reads {path}.{name} outside the call of unit {path!r} (before, "
        "between or after the units). A unit's parameters and submodules live in its own layer, and the code "
        f"around the units runs without them. Read {name!r} only inside the unit's own forward, or pass units= "
        "that keep this code and what it reads together (a larger unit, or units=None for one layer)"
    )


# Why a replay may run other units than the example did: each layer replays forward apart, and a draw that
# decides which units run draws again there, differently.
WHICH_UNITS_RUN = (
    "; if the model skips layers at random in training (LayerDrop: config.layerdrop, encoder_layerdrop or "
    "decoder_layerdrop > 0; M2M100's and NLLB's default 0.05), each layer of the split would draw which units "
    "run apart: set them to 0, or split with units=None (one layer)"
)


_LAYERDROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def refuse_layerdrop(root: nn.Module) -> None:
    """A model that skips layers at random in training (LayerDrop), whose draws every layer of the split
    would make apart (``WHICH_UNITS_RUN``): refused before the recording, naming the setting. Read where
    forward reads it: a module's own ``layerdrop`` (BART's stacks copy their config's when built) or its
    config's (Wav2Vec2's encoder reads it there)."""
    for path, module in root.named_modules():
        config = getattr(module, "config", None)
        for owner, where in ((module, path or "the model"), (config, f"{path or 'the model'}'s config")):
            for name in _LAYERDROPS:
                value = vars(owner).get(name) if owner is module else getattr(owner, name, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                    raise FunctionalizeError(
                        f"functionalize: {where} has {name}={value}: it skips layers at random in training "
                        "(LayerDrop), and each layer of a split would replay the draws that decide which units run "
                        f"apart, so they would disagree. Build the model with config.{name} = 0.0, or split with "
                        "units=None (one layer)"
                    )


def refuse_changed_in_unit(path: str, x: Any, changed: LeafIndices) -> None:
    """A unit changing the batch's tensors in place: its layer would change the carry it was given, which
    the layers before it still hold for their backward (and a pipeline has sent on already)."""
    if changed:
        raise FunctionalizeError(
            f"functionalize: unit {path!r} changes the input's {leaf_names(x)[changed[0]]!r} in place, but a "
            "unit's layer must leave the value passed to it as it is (the layers before it hold it for their "
            "backward). Change a copy in the unit (x = x.clone() before the in-place op), or split with "
            "units=None (one layer)"
        )
