"""convert_to_float8_training: swap nn.Linear for Float8Linear, in place."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

from torch import nn

from fp8train.config import Float8LinearConfig, config_or_default
from fp8train.distributed.fsdp import wrap_weight_for_fsdp
from fp8train.linear import Float8Linear
from fp8train.toolchain import warn_once_about_toolchain

ModuleFilter = Callable[[nn.Module, str], bool]


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: ModuleFilter | None = None,
) -> nn.Module:
    """Replace every `nn.Linear` in `module` (the root included) with a `Float8Linear` that
    shares its parameters, and return the module.

    `module_filter_fn(linear, fqn)` returns False for layers to leave in high precision; fqn is
    the layer's dotted name in `module` ("" for the root). A filter that cannot take those two
    arguments, or returns anything but a bool (None: a path without a return), raises a
    TypeError. A layer that cannot run float8 gemms raises a ValueError that names it and says
    what to do, and so does a subclass of nn.Linear with a forward of its own (swapping it
    would drop that forward) or a parametrized layer (weight_norm). A Float8Linear already in
    `module` stays as it is if its config is this call's, and raises a ValueError if not.
    Each new layer takes over its nn.Linear's hooks and what a subclass adds to it.
    nn.MultiheadAttention never calls its `out_proj` as a module: it stays in high precision,
    with a warning. On a GPU whose kernels Triton would compile with a ptxas known to
    miscompile fp8train's casts, the first call warns (fp8train.toolchain).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"convert_to_float8_training takes an nn.Module, got a {type(module).__name__}"
        )
    config = config_or_default(config)
    _check_filter(module_filter_fn)
    warn_once_about_toolchain()

    def wanted(linear: nn.Linear, fqn: str) -> bool:
        if module_filter_fn is None:
            return True
        keep = module_filter_fn(linear, fqn)
        if not isinstance(keep, bool):  # None: most likely a path without a return
            raise TypeError(
                f"module_filter_fn returned {keep!r} ({type(keep).__name__}) for '{fqn}', not a "
                "bool: return True to convert the layer to float8, False to leave it in high "
                "precision"
            )
        return keep

    def convert(child: nn.Module, fqn: str) -> nn.Module:
        if isinstance(child, nn.MultiheadAttention):
            if wanted(child.out_proj, f"{fqn}.out_proj" if fqn else "out_proj"):
                name = f"'{fqn}'" if fqn else "the root module"
                warnings.warn(
                    f"{name} is an nn.MultiheadAttention, which multiplies by its projection "
                    "weights itself and never calls out_proj as a module, so float8 cannot run "
                    "there: it stays in high precision. Attention written with nn.Linear "
                    "projections called as modules trains in float8.",
                    stacklevel=3,
                )
            return child
        if isinstance(child, Float8Linear):
            if child.config != config:
                raise ValueError(
                    f"'{fqn or 'the root module'}' is a Float8Linear already, with another "
                    "config than this call's: convert_to_float8_training does not reconvert. "
                    "Convert the high-precision model once with the config you want (its "
                    "state_dict loads into it), or pass the layer's own config to convert the rest"
                )
            return child
        if isinstance(child, nn.Linear):
            if wanted(child, fqn):
                if type(child).forward is not nn.Linear.forward:
                    raise ValueError(
                        f"'{fqn}': {type(child).__name__} subclasses nn.Linear with a forward of "
                        "its own, which a Float8Linear would replace: leave it out with "
                        "module_filter_fn, or convert the nn.Linear layers it calls"
                    )
                new = Float8Linear.from_float(child, config, fqn=fqn)
                if config.enable_fsdp_float8_all_gather:
                    wrap_weight_for_fsdp(new, config.round_scales_to_power_of_2)
                return new
            return child
        for name, grandchild in list(child.named_children()):
            swapped = convert(grandchild, f"{fqn}.{name}" if fqn else name)
            if swapped is not grandchild:
                setattr(child, name, swapped)
        return child

    return convert(module, "")


def _check_filter(module_filter_fn: object) -> None:
    """A TypeError naming the call convert_to_float8_training makes, for a filter that cannot
    take it (before a TypeError from inside the conversion)."""
    if module_filter_fn is None:
        return
    if not callable(module_filter_fn):
        raise TypeError(
            f"module_filter_fn={module_filter_fn!r} is not callable: give a function "
            "(module, fqn) -> bool, for example lambda module, fqn: fqn != 'output'"
        )
    try:
        signature = inspect.signature(module_filter_fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): call it as it is
        return
    try:
        signature.bind(nn.Linear, "fqn")
    except TypeError:
        raise TypeError(
            f"module_filter_fn{signature} cannot be called as module_filter_fn(module, fqn), "
            "which convert_to_float8_training does for every nn.Linear (fqn: its dotted name "
            "in the model): give it both parameters"
        ) from None
