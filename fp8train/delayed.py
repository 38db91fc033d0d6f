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
inf or NaN reaches the loss, as it would in bf16. Layers that read one input may share one
input state (tie_delayed_input_scales), so that compiled code casts that input once.

Static: CastConfig(scaling_type='static', static_scale=s) casts with s; no state.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fp8train.cast import eager_kernel
from fp8train.config import CastConfig, Float8LinearConfig, Gemm, Role, ScalingType
from fp8train.scaling import EPS, amax_to_scale, raise_amax, round_down_to_power_of_2
from fp8train.toolchain import toolchain_problem


class DelayedState(NamedTuple):
    amax: torch.Tensor
    history: torch.Tensor
    scale: torch.Tensor
    initialized: torch.Tensor
    ready: bool = False
    """Known on the host (set by the eager sync): `scale` holds an earlier step's scale, so the
    cast can start without this step's amax and record it in its own pass (one read of hp)."""


_FIRST_GEMM = {Role.INPUT: Gemm.OUTPUT, Role.WEIGHT: Gemm.OUTPUT, Role.GRAD_OUTPUT: Gemm.GRAD_INPUT}
_NAMES = ("amax", "amax_history", "scale", "initialized")
# A tuple, not the Enum class: dynamo on torch 2.11 breaks the graph on iterating an Enum.
_ROLES = tuple(Role)


def delayed_roles(config: Float8LinearConfig) -> tuple[Role, ...]:
    return tuple(
        role
        for role in _ROLES
        if config.cast_config(role, _FIRST_GEMM[role]).scaling_type is ScalingType.DELAYED
    )


def register_delayed_buffers(
    module: nn.Module, config: Float8LinearConfig, device: torch.device | str | None = None
) -> None:
    """The buffers of every delayed role of `module` (a Float8Linear), initial values."""
    history_len = config.delayed_scaling_config.history_len
    # The roles whose scale buffer holds an earlier step's scale, known on the host: set by
    # the eager sync, cleared when a state_dict is loaded.
    module._fp8_ready_roles = set()
    # Eager training calls before the first sync (note_unsynced_call); -1 once synced.
    module._fp8_unsynced_calls = 0
    # Role value -> the Float8Linear whose state this layer's role uses instead of its own
    # (tie_delayed_input_scales). A plain dict, so that the other layer is not registered as
    # a submodule of this one.
    module._fp8_state_sources = {}
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


def role_state(module: nn.Module, role: Role, ready: bool = False) -> DelayedState:
    buffers = (getattr(module, f"fp8_{name}_{role.value}") for name in _NAMES)
    return DelayedState(*buffers, ready=ready)


def state_source(module: nn.Module, role: Role) -> nn.Module:
    """The layer whose delayed state `module` uses for `role`: itself unless tied (followed
    through a layer that was tied to another later)."""
    source = module
    while (next_source := source._fp8_state_sources.get(role.value)) is not None:
        source = next_source
    return source


def tie_delayed_input_scales(layers: Sequence[nn.Module]) -> None:
    """Give Float8Linear layers that read one input tensor (attention's q, k and v projections,
    the feed-forward's gate and up projections) one delayed-scaling state for that input: the
    first layer's amax, history and scale serve them all.

    Their scales are equal anyway (each records the same tensor's amax), but under
    torch.compile only casts with one scale tensor are seen to be the same cast: tied, the
    compiled graph casts the input once and keeps at most one float8 copy of it for backward,
    as with dynamic scaling; untied, each layer keeps its own. Eager mode shares such casts
    either way. Call it after `convert_to_float8_training` and before compiling; the other
    layers' own input buffers stay in their state_dict, unused while the tie lasts.
    `find_shared_inputs(model, example_batch)` finds such groups in any model;
    `fp8train.models.tie_shared_delayed_inputs` ties those of the bundled model."""
    from fp8train.linear import Float8Linear

    layers = list(layers)
    if len(layers) < 2:
        raise ValueError(f"tie_delayed_input_scales needs at least two layers, got {len(layers)}")
    for layer in layers:
        if not isinstance(layer, Float8Linear):
            raise TypeError(
                f"tie_delayed_input_scales takes Float8Linear layers, got {type(layer).__name__}: "
                "convert the model with convert_to_float8_training first"
            )
        if Role.INPUT not in delayed_roles(layer.config):
            raise ValueError(
                f"{_name(layer)} does not scale its input with delayed scaling "
                "(cast_config_input.scaling_type='delayed'): only delayed inputs have a state "
                "to tie"
            )
    first = layers[0]
    for layer in layers[1:]:
        if _input_state_rules(layer.config) != _input_state_rules(first.config):
            raise ValueError(
                f"{_name(layer)} and {_name(first)} scale their inputs by different rules "
                "(cast_config_input, delayed_scaling_config, round_scales_to_power_of_2): "
                "tie only layers whose input casts are configured alike"
            )
        if layer.in_features != first.in_features:
            raise ValueError(
                f"{_name(layer)} has in_features={layer.in_features} and {_name(first)} "
                f"{first.in_features}: layers that read one input have the same in_features"
            )
    source = state_source(first, Role.INPUT)
    for layer in layers:
        if layer is not source:
            layer._fp8_state_sources[Role.INPUT.value] = source


def find_shared_inputs(model: nn.Module, *args: object, **kwargs: object) -> list[list[nn.Module]]:
    """The groups of Float8Linear layers of `model` that read one input tensor, found by
    running `model(*args, **kwargs)` once without gradients (an example batch; any size the
    model takes): attention's q, k and v projections, the gate and up projections, in the
    order they ran. Each group has two or more layers; pass it to `tie_delayed_input_scales`.
    The run leaves no trace: the layers' delayed-scaling state is restored after it."""
    from torch._dynamo.eval_frame import OptimizedModule

    from fp8train.linear import Float8Linear

    if any(isinstance(m, OptimizedModule) for m in model.modules()):
        raise ValueError(
            "find_shared_inputs got a model with torch.compile'd parts, whose layers it cannot "
            "watch: call it (and tie_delayed_input_scales) before compiling"
        )
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    saved = [
        (layer, {name: getattr(layer, name).clone() for name in buffer_names(layer.config)})
        for layer in layers
    ]
    readers: dict[int, list[nn.Module]] = {}
    inputs: list[torch.Tensor] = []  # alive until the end, so that no id is reused

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["input"]
        inputs.append(x)
        group = readers.setdefault(id(x), [])
        if all(module is not other for other in group):  # a layer called twice on it: once
            group.append(module)

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for layer, buffers in saved:
                for name, value in buffers.items():
                    getattr(layer, name).copy_(value)
    return [group for group in readers.values() if len(group) > 1]


def _input_state_rules(config: Float8LinearConfig) -> tuple:
    return (
        config.cast_config(Role.INPUT, Gemm.OUTPUT),
        config.delayed_scaling_config,
        config.round_scales_to_power_of_2,
    )


def _name(layer: nn.Module) -> str:
    return f"Float8Linear '{layer.fqn}'" if getattr(layer, "fqn", "") else "a Float8Linear"


def stateful_scale(
    hp: torch.Tensor, cast: CastConfig, state: DelayedState | None, round_pow2: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(scale, record_amax) of a delayed or static cast; (None, None) for a dynamic cast,
    which scales from its own amax.

    Delayed: once the scale is known on the host to be an earlier step's (`state.ready`) and
    the cast runs in the eager CUDA kernel, that scale is used as it is and the cast records
    this step's amax into `record_amax` in its own pass: one read of hp; compiled code does the
    same with `DelayedScalingConfig(compiled_one_pass=True)`. Otherwise (first step, compiled
    code by default, the eager CPU path) the amax is recorded here, a pass of its own, and the
    first step scales from the data."""
    if cast.scaling_type is ScalingType.STATIC:
        # The cast turns an inf into NaN (never a saturated finite value) under any given
        # scale, in the kernel and on the torch path.
        return torch.full((), cast.static_scale, device=hp.device), None
    if cast.scaling_type is not ScalingType.DELAYED:
        return None, None
    if state is None:
        raise ValueError("a delayed cast needs its layer's amax and scale buffers")
    if state.ready and (eager_kernel(hp) or torch.compiler.is_compiling()):
        # A copy: the sync updates the buffer in place, and a cast kept for backward must keep
        # the scale it was made with. Compiled (DelayedScalingConfig.compiled_one_pass), the
        # scale does not depend on this step's amax either, so inductor may take both in one
        # read of hp.
        return state.scale.clone(), state.amax
    with torch.no_grad():
        current = raise_amax(state.amax, hp)
        fresh = amax_to_scale(current, cast.target_dtype, round_to_power_of_2=round_pow2)
        scale = torch.where(state.initialized, state.scale, fresh)
        # |current - current|: the positive NaN where current is inf or NaN, without a NaN
        # constant (which torch.compile's common-subexpression elimination cannot match, see
        # _saturated_cast_whole).
        return torch.where(torch.isfinite(current), scale, (current - current).abs()), None


# Per model, the previous sync's flags still to be read (kept off the module, which may be
# deep-copied or pickled). A value must not reach its key: under FSDP2 every layer reaches the
# root through the shared FSDP state, so the check holds its layers by weak reference, or a
# model dropped on CUDA would stay alive, parameters and all, waiting for a next sync.
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


UNSYNCED_CALLS_TO_WARN = 64
"""Eager training calls of a delayed-scaling layer without any sync, after which it warns."""
_WARNED_UNSYNCED = False


def note_unsynced_call(module: nn.Module, fqn: str) -> None:
    """Count an eager training call of a delayed-scaling Float8Linear that no sync has seen,
    and warn once at UNSYNCED_CALLS_TO_WARN: without the sync its casts scale from each
    tensor's own amax, as dynamic scaling does (right, but with delayed scaling's costs and
    none of its gains), and no amax history is kept."""
    global _WARNED_UNSYNCED
    calls = getattr(module, "_fp8_unsynced_calls", -1)  # -1: a layer pickled before it existed
    if calls < 0:
        return
    module._fp8_unsynced_calls = calls + 1
    if calls + 1 == UNSYNCED_CALLS_TO_WARN and not _WARNED_UNSYNCED:
        _WARNED_UNSYNCED = True  # once per process: every layer of the model would say it
        name = f"Float8Linear '{fqn}'" if fqn else "A Float8Linear"
        warnings.warn(
            f"{name} has delayed scaling and has run {UNSYNCED_CALLS_TO_WARN} training calls "
            "without a sync: call fp8train.sync_float8_amax_and_scale_history(model) once per "
            "step, after backward. Until then each cast scales from its tensor's own amax, "
            "as dynamic scaling does, and no amax history is kept",
            stacklevel=_caller_level(),
        )


def _caller_level() -> int:
    """The warnings.warn stacklevel, for its caller here, of the first frame outside fp8train
    and torch.nn's modules: the user's code that called the model (or the layer)."""
    inside = (os.path.dirname(__file__), os.path.dirname(nn.modules.module.__file__))
    frame, level = sys._getframe(2), 2  # that of _getframe(2): the caller of our caller
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module) -> None:
    """After backward, once per step: push every delayed amax into its history and recompute
    every scale. In a distributed run the amaxes are all-reduced (MAX) in one collective first,
    so every rank casts with the same scales. Call it on the model FSDP/DDP wrapped."""
    from fp8train.linear import Float8Linear

    require_module(model, "sync_float8_amax_and_scale_history")
    groups: dict[tuple, list[tuple[str, Role, DelayedState, CastConfig, bool]]] = {}
    owners: dict[tuple, list[nn.Module]] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue
        config = module.config
        if not torch.compiler.is_compiling():
            module._fp8_unsynced_calls = -1
        for role in delayed_roles(config):
            if state_source(module, role) is not module:
                continue  # tied: its source's state is synced once, as its own
            cast = config.cast_config(role, _FIRST_GEMM[role])
            key = (config.delayed_scaling_config.scale_fn,)
            entry = (fqn, role, role_state(module, role), cast, config.round_scales_to_power_of_2)
            groups.setdefault(key, []).append(entry)
            owners.setdefault(key, []).append(module)
    pending = _PENDING.pop(model, None)
    if pending is not None and not torch.compiler.is_compiling():
        pending.report()  # the previous step's, finished on the GPU long ago: no stall
    checks = []
    for key, entries in groups.items():
        finite, initialized = _sync_group(entries, key[0])
        checks.append((owners[key], entries, finite, initialized))
    if torch.compiler.is_compiling() or not checks:
        return
    pending = _PendingCheck(checks)
    if pending.on_cpu:
        pending.report()
    else:
        _PENDING[model] = pending


class _PendingCheck:
    """What a sync must tell the host, read without stalling it: which amaxes were non-finite
    (a warning) and which scales are now an earlier step's (`_fp8_ready_roles`, which lets the
    next eager casts run in one pass). On CUDA the flags are copied to pinned memory behind an
    event and read at the next sync, one step later, when the copy is long done: a host read
    now would wait for the whole step and leave the GPU idle while the next one is launched."""

    def __init__(self, checks: list) -> None:  # noqa: ANN001
        self.checks = [
            ([weakref.ref(m) for m in owners], [(fqn, role) for fqn, role, *_ in entries])
            for owners, entries, _, _ in checks
        ]
        flags = torch.cat([torch.cat([f, i]) for _, _, f, i in checks])
        self.on_cpu = flags.device.type != "cuda"
        if self.on_cpu:
            self.flags, self.event = flags, None
        else:
            self.flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.flags.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def report(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        flags, offset, bad = self.flags.tolist(), 0, []
        for owners, entries in self.checks:
            n = len(entries)
            finite, initialized = flags[offset : offset + n], flags[offset + n : offset + 2 * n]
            offset += 2 * n
            for module_ref, (fqn, role), ok, ready in zip(
                owners, entries, finite, initialized, strict=True
            ):
                module = module_ref()
                if module is None:  # the model was dropped since
                    continue
                if not ok:
                    bad.append(f"{fqn or '<root>'}:{role.value}")
                module._fp8_ready_roles.discard(role)
                if ready:
                    module._fp8_ready_roles.add(role)
        if bad:
            when = "this step" if self.event is None else "the previous step"
            warnings.warn(
                f"non-finite amax in {', '.join(bad)} in {when}: not written into the history; "
                f"those casts kept their previous scale (that step's loss is non-finite)"
                f"{_weights_hint(bad)}",
                stacklevel=3,
            )


def _weights_hint(bad: list[str]) -> str:
    """What a non-finite weight amax says: the weight itself is non-finite, so a non-finite
    gradient reached the optimizer; and, where it applies, the compiler fp8train.toolchain
    knows to miscompile float8 casts."""
    if not any(entry.endswith(f":{Role.WEIGHT.value}") for entry in bad):
        return ""
    hint = (
        ". A weight's amax is non-finite only if the weight is: a non-finite gradient reached "
        "the optimizer (check the loss, the learning rate, gradient clipping)"
    )
    if toolchain_problem() is not None:
        hint += (
            ", or, on this GPU, Triton's ptxas miscompiled a float8 cast: see "
            "fp8train.toolchain_problem()"
        )
    return hint


def _sync_group(entries, scale_fn: str) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Sync one group in place; returns which amaxes were finite and which states are
    initialized now."""
    states = [entry[2] for entry in entries]
    amax = torch.stack([s.amax for s in states])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    finite = torch.isfinite(amax)
    old_history = _stack_padded([s.history for s in states])
    rolled = torch.roll(old_history, 1, dims=1)
    rolled[:, 0] = amax
    history = torch.where(finite[:, None], rolled, old_history)
    lengths = [s.history.numel() for s in states]
    valid = (
        torch.arange(history.shape[1], device=history.device)[None, :]
        < _constant(lengths, torch.int64, history.device)[:, None]
    )
    if scale_fn == "max":
        history_amax = torch.where(valid, history, 0).amax(dim=1)
    else:
        history_amax = history[:, 0]
    fp8_max = _constant(
        [torch.finfo(entry[3].target_dtype).max for entry in entries], torch.float32, amax.device
    )
    scale = fp8_max / history_amax.clamp(min=EPS)
    pow2 = _constant([entry[4] for entry in entries], torch.bool, amax.device)
    scale = torch.where(pow2, round_down_to_power_of_2(scale), scale)
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
    return finite, initialized


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values)` on `device`, made once: a copy from pageable host memory to the
    GPU waits for the GPU's queue to drain, which would stall every step's sync."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=dtype, device=device)  # a constant of the graph
    key = (tuple(values), dtype, torch.device(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return _CONSTANTS[key]


def _stack_padded(histories: list[torch.Tensor]) -> torch.Tensor:
    """The histories as rows, zero-padded to the longest: one stack, with a pad (a kernel of
    its own) only for a history shorter than the longest."""
    width = max(h.numel() for h in histories)
    return torch.stack(
        [h if h.numel() == width else torch.nn.functional.pad(h, (0, width - h.numel()))
         for h in histories]
    )  # fmt: skip


def require_module(model: object, caller: str) -> None:
    """A TypeError naming `caller` for a model that is not an nn.Module (a list of model parts,
    a state_dict), before an AttributeError from inside it."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{caller} takes the model (an nn.Module), got a {type(model).__name__}: for "
            "several model parts, call it once per part"
        )


def strip_float8_state(state_dict: dict) -> dict:
    """`state_dict` without the delayed-scaling buffers: what the unconverted model loads."""
    if isinstance(state_dict, nn.Module):
        raise TypeError(
            f"strip_float8_state takes a state_dict, got a {type(state_dict).__name__}: pass "
            "model.state_dict()"
        )
    return {k: v for k, v in state_dict.items() if not _is_float8_state(k)}


def _is_float8_state(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    return name.startswith("fp8_") and any(name.startswith(f"fp8_{n}_") for n in _NAMES)
