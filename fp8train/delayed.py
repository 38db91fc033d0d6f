"""Delayed and static scaling: scales that do not come from the tensor being cast.

Delayed: each Float8Linear keeps, per delayed role, four buffers:
    fp8_amax_<role>          max |x| seen since the last sync (forward, or backward for
                             grad_output): a by-product of the step, not a pass before the cast
    fp8_amax_history_<role>  the last history_len synced amaxes, newest first
    fp8_scale_<role>         the scale the casts use, from the history
    fp8_initialized_<role>   False until the first sync: the first step scales from the data
and sync_float8_amax_and_scale_history(model), called once per step after backward, rolls every
history and recomputes every scale at once: stacked tensors and foreach copies, one all-reduce
(MAX) of all amaxes when torch.distributed runs. A non-finite amax is never written into a
history (the old scale stays, with a warning), and the cast that saw it gives NaN, so that the
inf or NaN reaches the loss, as it would in bf16.

Static: CastConfig(scaling_type='static', static_scale=s) casts with s; no state.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fp8train.config import CastConfig, Float8LinearConfig, Gemm, Role, ScalingType
from fp8train.scaling import EPS, amax_to_scale


class DelayedState(NamedTuple):
    amax: torch.Tensor
    history: torch.Tensor
    scale: torch.Tensor
    initialized: torch.Tensor


_FIRST_GEMM = {Role.INPUT: Gemm.OUTPUT, Role.WEIGHT: Gemm.OUTPUT, Role.GRAD_OUTPUT: Gemm.GRAD_INPUT}
_NAMES = ("amax", "amax_history", "scale", "initialized")


def delayed_roles(config: Float8LinearConfig) -> tuple[Role, ...]:
    return tuple(
        role
        for role in Role
        if config.cast_config(role, _FIRST_GEMM[role]).scaling_type is ScalingType.DELAYED
    )


def register_delayed_buffers(
    module: nn.Module, config: Float8LinearConfig, device: torch.device | str | None = None
) -> None:
    """The buffers of every delayed role of `module` (a Float8Linear), initial values."""
    history_len = config.delayed_scaling_config.history_len
    for role in delayed_roles(config):
        values = (
            torch.zeros((), device=device),
            torch.zeros(history_len, device=device),
            torch.ones((), device=device),
            torch.zeros((), dtype=torch.bool, device=device),
        )
        for name, value in zip(_NAMES, values, strict=True):
            module.register_buffer(f"fp8_{name}_{role.value}", value)


def buffer_names(config: Float8LinearConfig) -> list[str]:
    return [f"fp8_{name}_{role.value}" for role in delayed_roles(config) for name in _NAMES]


def role_state(module: nn.Module, role: Role) -> DelayedState:
    return DelayedState(*(getattr(module, f"fp8_{name}_{role.value}") for name in _NAMES))


def stateful_scale(
    hp: torch.Tensor, cast: CastConfig, state: DelayedState | None, round_pow2: bool
) -> torch.Tensor | None:
    """The scale of a delayed or static cast (recording the amax of `hp` for delayed); None
    for a dynamic cast, which scales from its own amax."""
    if cast.scaling_type is ScalingType.STATIC:
        return torch.full((), cast.static_scale, device=hp.device)
    if cast.scaling_type is not ScalingType.DELAYED:
        return None
    if state is None:
        raise ValueError("a delayed cast needs its layer's amax and scale buffers")
    with torch.no_grad():
        current = torch.linalg.vector_norm(hp, ord=float("inf"), dtype=torch.float32)
        state.amax.copy_(torch.maximum(state.amax, current))
        fresh = amax_to_scale(current, cast.target_dtype, round_to_power_of_2=round_pow2)
        scale = torch.where(state.initialized, state.scale, fresh)
        return torch.where(torch.isfinite(current), scale, torch.nan)


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module) -> None:
    """After backward, once per step: push every delayed amax into its history and recompute
    every scale. In a distributed run the amaxes are all-reduced (MAX) in one collective first,
    so every rank casts with the same scales. Call it on the model FSDP/DDP wrapped."""
    from fp8train.linear import Float8Linear

    groups: dict[tuple, list[tuple[str, Role, DelayedState, CastConfig, bool]]] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue
        config = module.config
        for role in delayed_roles(config):
            cast = config.cast_config(role, _FIRST_GEMM[role])
            key = (config.delayed_scaling_config.scale_fn,)
            entry = (fqn, role, role_state(module, role), cast, config.round_scales_to_power_of_2)
            groups.setdefault(key, []).append(entry)
    for (scale_fn,), entries in groups.items():
        _sync_group(entries, scale_fn)


def _sync_group(entries, scale_fn: str) -> None:  # noqa: ANN001
    states = [entry[2] for entry in entries]
    amax = torch.stack([s.amax for s in states])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    finite = torch.isfinite(amax)
    if not torch.compiler.is_compiling() and not bool(finite.all()):
        bad = [
            f"{fqn or '<root>'}:{role.value}"
            for (fqn, role, *_), ok in zip(entries, finite.tolist(), strict=True)
            if not ok
        ]
        warnings.warn(
            f"non-finite amax in {', '.join(bad)}: not written into the history; those casts "
            "keep their previous scale (this step's loss is non-finite)",
            stacklevel=3,
        )
    old_history = _stack_padded([s.history for s in states])
    rolled = torch.roll(old_history, 1, dims=1)
    rolled[:, 0] = amax
    history = torch.where(finite[:, None], rolled, old_history)
    lengths = [s.history.numel() for s in states]
    valid = (
        torch.arange(history.shape[1], device=history.device)[None, :]
        < torch.tensor(lengths, device=history.device)[:, None]
    )
    if scale_fn == "max":
        history_amax = torch.where(valid, history, 0).amax(dim=1)
    else:
        history_amax = history[:, 0]
    fp8_max = torch.tensor(
        [torch.finfo(entry[3].target_dtype).max for entry in entries], device=amax.device
    )
    scale = fp8_max / history_amax.clamp(min=EPS)
    pow2 = torch.tensor([entry[4] for entry in entries], device=amax.device)
    scale = torch.where(pow2, torch.exp2(torch.floor(torch.log2(scale))), scale)
    old_scale = torch.stack([s.scale for s in states])
    scale = torch.where(finite, scale, old_scale)
    initialized = torch.stack([s.initialized for s in states]) | finite
    torch._foreach_copy_(
        [s.history for s in states],
        [row[:n] for row, n in zip(history.unbind(0), lengths, strict=True)],
    )
    torch._foreach_copy_([s.scale for s in states], list(scale.unbind(0)))
    torch._foreach_copy_([s.initialized for s in states], list(initialized.unbind(0)))
    torch._foreach_zero_([s.amax for s in states])


def _stack_padded(histories: list[torch.Tensor]) -> torch.Tensor:
    width = max(h.numel() for h in histories)
    return torch.stack([torch.nn.functional.pad(h, (0, width - h.numel())) for h in histories])


def strip_float8_state(state_dict: dict) -> dict:
    """`state_dict` without the delayed-scaling buffers: what the unconverted model loads."""
    return {k: v for k, v in state_dict.items() if not _is_float8_state(k)}


def _is_float8_state(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    return name.startswith("fp8_") and any(name.startswith(f"fp8_{n}_") for n in _NAMES)
