"""Gradient accumulation: cast each float8 weight once per optimizer step, not once per
micro-batch.

    for step in range(steps):
        with cast_weights_once(model):
            for inputs, targets in micro_batches:
                loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()

On entry every Float8Linear casts its weight for both gemms that use it (the output gemm and
the grad_input gemm, each in its layout); inside, forward and backward use those casts instead
of casting again. The weight must not change inside the block: the optimizer steps after it.
In eager mode a changed weight (its version counter moved) raises; compiled code cannot read
the counter, so there the rule is the caller's.

Memory: the casts live for the block, 1 byte per weight element per layout (2 in all): the
same as `recompute_weight_cast=False` keeps, but once for the model instead of once per
micro-batch. Not for FSDP, whose weights exist unsharded only inside each layer's forward and
backward: there the float8 all-gather (`enable_fsdp_float8_all_gather`) casts once per
all-gather instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fp8train.cast import cast_for_gemms, cast_key
from fp8train.config import ROLE_GEMMS, Gemm, Role
from fp8train.delayed import role_state, stateful_scale


@contextlib.contextmanager
def cast_weights_once(model: nn.Module) -> Iterator[None]:
    """Within the block, every Float8Linear of `model` reuses one cast of its weight (see the
    module docstring)."""
    from fp8train.linear import Float8Linear

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for layer in layers:
        if _is_dtensor(layer.weight):
            raise ValueError(
                f"cast_weights_once: the weight of Float8Linear '{layer.fqn}' is a DTensor "
                "(FSDP or tensor parallel), which is sharded outside forward: use "
                "enable_fsdp_float8_all_gather=True to cast once per all-gather instead"
            )
    try:
        for layer in layers:
            layer._weight_casts = _cast_weight(layer)
            layer._weight_casts_version = layer.weight._version
        yield
    finally:
        for layer in layers:
            layer._weight_casts = layer._weight_casts_version = None


def _cast_weight(layer: nn.Module) -> tuple | None:
    config = layer.config
    weight = layer.weight
    gemms = ROLE_GEMMS[Role.WEIGHT]  # output, grad_input
    if cast_key(config, Role.WEIGHT, gemms[0]) is None:
        return None  # the output gemm runs in high precision: nothing to cache
    state = role_state(layer, Role.WEIGHT) if hasattr(layer, "fp8_scale_weight") else None
    with torch.no_grad():
        scale, record_amax = stateful_scale(
            weight,
            config.cast_config(Role.WEIGHT, Gemm.OUTPUT),
            state,
            config.round_scales_to_power_of_2,
        )
        if cast_key(config, Role.WEIGHT, gemms[0]) == cast_key(config, Role.WEIGHT, gemms[1]):
            for_output, for_grad_input = cast_for_gemms(
                weight, Role.WEIGHT, gemms, config, scale, record_amax
            )
        else:  # rowwise: each gemm scales the weight along its own inner dim
            (for_output,) = cast_for_gemms(weight, Role.WEIGHT, gemms[:1], config, scale)
            (for_grad_input,) = cast_for_gemms(weight, Role.WEIGHT, gemms[1:], config)
    # A grad_input gemm in high precision uses the hp weight: keep nothing for it.
    if for_grad_input is weight:
        for_grad_input = None
    return for_output, for_grad_input


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(tensor, DTensor)
