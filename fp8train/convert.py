"""convert_to_float8_training: swap nn.Linear for Float8Linear, in place."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fp8train.config import Float8LinearConfig
from fp8train.distributed.fsdp import wrap_weight_for_fsdp
from fp8train.linear import Float8Linear

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
    the layer's dotted name in `module` ("" for the root). A layer that cannot run float8 gemms
    raises a ValueError that names it and says what to do.
    """
    config = config or Float8LinearConfig()

    def convert(child: nn.Module, fqn: str) -> nn.Module:
        if isinstance(child, nn.Linear) and not isinstance(child, Float8Linear):
            if module_filter_fn is None or module_filter_fn(child, fqn):
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
