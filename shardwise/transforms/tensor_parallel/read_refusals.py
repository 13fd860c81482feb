"""What the watch of split-weight reads (weight_reads.py) and of per-head tensors (head_views.py, head_indices.py)
says when it refuses one: the words only.

Each names the parameter (or the module), what the code did with the rank's slice, why that is another
model, and the fix. The model's line (``where``) is found by the watch itself (model_frames.py), from its
own frames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from .split_watch import _Output


def product_refusal(label: str, module: nn.Module, rowwise: bool, refused_view: str | None, fused: int) -> str:
    """A split module's overridden forward returned something else than its product (Colwise: or a per-head view
    of it; ``refused_view`` the reshape or cut it made that is none, ``fused`` its Colwise's blocks)."""
    base = "nn.Embedding" if isinstance(module, nn.Embedding) else "nn.Linear"
    if not rowwise and refused_view is not None:
        style, share = ("Colwise()", "its whole heads, 1/tp of them") if fused == 1 else (
            f"Colwise(fused={fused})", f"its 1/tp of each of {fused} blocks, side by side"
        )
        return (
            f"tensor_parallel: {style} on {label!r}, a {type(module).__name__} whose forward overrides {base}'s: "
            f"run on this rank's slice of its output features ({share}), it "
            f"{'cuts' if refused_view.split(' ', 1)[0] in ('chunk', 'split', 'tensor_split') else 'reshapes'} its "
            f"output ({refused_view}), which is no per-head view tensor parallel can follow: on a rank the "
            "same sizes make other heads, or mix the rank's features with other dims. View them by the head width, "
            f"the heads inferred ({_view_fix(fused)}); "
            f"or return the product and view it in the module around it; or give it a plain "
            f"{base}, or leave it out of the plan (replicated, with its Rowwise partner)"
        )
    if not rowwise:
        return (
            f"tensor_parallel: Colwise() on {label!r}, a {type(module).__name__} whose forward overrides "
            f"{base}'s: run on this rank's slice of its output features, it returned something else than its "
            "weight's product with the input (plus its bias, or a function of each feature alone: tanh, gelu, a "
            "scale by a number or by a 0-d tensor not computed from that product), so what it computed after "
            "that product may have mixed the features of this rank's slice (a norm or a max over them) where it "
            f"meant all of them. Give it a plain {base} (and compute the rest after it, where tensor parallel "
            "follows the split output), or leave it out of the plan (replicated, with its Rowwise partner)"
        )
    return (
        f"tensor_parallel: Rowwise() on {label!r}, a {type(module).__name__} whose forward overrides "
        f"nn.Linear's: run on this rank's slice of its input features (without its bias, added once after the "
        "sum), it returned something else than its weight's product with the input, so what it computes after "
        "that product would act on each rank's partial sum, not on the whole. Give it a plain nn.Linear, or "
        "leave it out of the plan (replicated, with its Colwise partner)"
    )


def _view_fix(fused: int) -> str:
    """The per-head views of a Colwise(fused=N) product that make the rank's heads (product_views.py)."""
    if fused == 1:
        return "view(*x.shape[:-1], -1, head_dim), unflatten(-1, (-1, head_dim)), as Hugging Face's attentions do"
    return (
        f"its {fused} blocks outermost: view(*x.shape[:-1], {fused}, -1, head_dim), unflatten(-1, ({fused}, -1, "
        "head_dim))"
    )


def custom_refusal(path: str, by: str, op: str, where: str, shape: bool = False, scaled: bool = False) -> str:
    """An overridden forward's use of its split parameter other than its product (``where``: the model's line)."""
    what, why = (
        ("reads the shape of", f"a width computed from its shape ({op}: a fan-in scale, weight.shape[1] ** -0.5) "
         "is the rank's part of the whole's") if shape else
        (f"computes {op} (a scale by a tensor that is no number) on",
         "a scale computed from the rank's slice (of the weight, of its product, of a Rowwise's input: "
         "x.abs().max()), or one with dims, differs from the whole's; a number it may scale by is Python's or "
         "a 0-d tensor the same on every rank (a buffer, a 0-d parameter)") if scaled else
        (f"computes {op} on", "a use other than its product with the input (linear, matmul; after casts, "
         "transposes or a scale by a number) would see part of the weight where it means the whole (a "
         "normalized weight's norm)")
    )
    return (
        f"tensor_parallel: the forward of {by}, whose class overrides torch's, {what} its split "
        f"parameter {path!r}{f' (at {where})' if where else ''}: each rank holds a slice of it, so {why}, and "
        "it would train another model without an error. Give it a plain nn.Linear (a width it needs can come "
        "from self.in_features / self.out_features, which stay the whole's), or leave it out of the plan "
        "(replicated, with its Colwise / Rowwise partner)"
    )


def gain_refusal(layer: str, path: str, by: str, op: str, where: str) -> str:
    """A split module's 0-d gain read outside its forward."""
    return (
        f"tensor_parallel: layer {layer!r} reads the 0-d gain {path!r} outside the forward of its module, "
        f"{by} ({op}{f', at {where}' if where else ''}): tensor parallel sums the gain's gradient over the "
        "axis, as each rank's use inside that forward meets the rank's slice of the weight, but a use outside "
        "it is the same on every rank, and its gradient would be summed too (counted once per rank), training "
        "another model without an error. Keep the gain inside the module (its forward may scale the weight or "
        "the product by it; give the code outside a parameter of its own), or leave the module out of the plan "
        "(replicated, with its Colwise / Rowwise partner)"
    )


def read_refusal(layer: str, path: str, by: str, op: str, where: str) -> str:
    """A split parameter read outside the forward of the module that splits it."""
    return (
        f"tensor_parallel: layer {layer!r} reads parameter {path!r} outside the forward of the module that "
        f"splits it, {by} ({op}{f', at {where}' if where else ''}): each rank holds a slice of it, so that code "
        "would compute with the slice where it means the whole (a norm of part of the weight, a regularizer "
        "over part of it, another width), and train another model (or report another loss) without an error. "
        "Only the split module's own forward may use its split parameters: call the module instead of reading "
        "its weight, leave the module out of the plan (replicated, with its Colwise / Rowwise partner), or, "
        "for a penalty on the weights, use the optimizer's weight decay (sw.optim.adamw(weight_decay=...))"
    )


def head_number_message(entry: _Output | str, what: str, t: Tensor, dim: int) -> str:
    """Refuses a head picked by its number (``entry``: the output, or a Colwise Linear subclass's own words)."""
    if isinstance(entry, str):
        whose = entry
    else:
        module = entry.label.rsplit(".", 1)[0] if "." in entry.label else entry.label
        whose = (
            f"{'PerHead' if entry.parameter else 'Colwise'}() on {entry.label!r} gives each rank its own heads, "
            f"{t.shape[dim]} of them here (dim {dim}), 1/tp of all, and the module that takes them ({module!r})"
        )
    return (
        f"tensor_parallel: {whose} picks heads by their number: {what}. Head n on a rank is another head than "
        "head n of all of them, so a fixed head number takes another head on each rank, another model trained "
        "without an error. "
        "Index the heads only in a loop that reads (and writes) each of the rank's heads equally often (for h in "
        "range(q.size(1)), or over the count a Region divides); or leave this module's projections out of the plan "
        "(replicated)"
    )


def head_value_message(what: str) -> str:
    """Refuses a per-head value computed from head numbers (head_numbers.py, head_loop_values.py)."""
    return (
        f"tensor_parallel: {what}. Each rank holds 1/tp of the heads, numbered from 0 on each, and counts only its "
        "own: as sizes and as indices of the heads such numbers name the rank's heads in their places, but as "
        "values (a slope, a scale, a mask by head number combined with the heads' values) they are the first "
        "heads' on every rank, another model trained without an error. Compute such per-head values once at init, "
        "as a tensor of one value per head along dim 0 given sw.tp.PerHead() in the plan, inside a Region naming "
        "the head count: a buffer (register_buffer) or a frozen parameter for fixed values such as ALiBi's slopes, "
        "a parameter for trained ones (each rank then computes with its own heads' values); or leave this "
        "module's projections out of the plan (replicated)"
    )


def head_count_message(what: str) -> str:
    """Refuses the rank's head count used as a scalar value (``q / q.size(1)``: head_numbers.py)."""
    return (
        f"tensor_parallel: {what}. Each rank holds 1/tp of the heads and counts only its own, so a number "
        "computed from that count (a scale 1 / h, a fill value) is the rank's H/tp where one device's is H, "
        "another model trained without an error. Compute it once at init from the whole count, before tensor "
        "parallel divides anything (self.scale = 1 / config.num_attention_heads in __init__), and use that "
        "attribute, one the Region does not name in heads= or local=; or leave this module's projections out of "
        "the plan (replicated)"
    )
