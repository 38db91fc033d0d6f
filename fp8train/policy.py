"""The save policy: what a Float8Linear keeps between forward and backward, in eager mode and
under torch.compile.

    weight  recompute_weight_cast=True   the hp weight (the parameter itself: no new memory),
                                         recast in backward
            recompute_weight_cast=False  the float8 weight, cast as the grad_input gemm needs it
    input   recompute_input_cast=False   the float8 input, cast as the grad_weight gemm needs it
            recompute_input_cast=True    the hp input, recast in backward
            recompute_input_cast=None    (default) eager: the float8 input; compiled: the
                                         partitioner's choice, see below
A gemm configured to run in high precision (scaling_type 'disabled') keeps its hp operand.

Eager mode: the matmul's autograd.Function saves exactly these tensors.

torch.compile: the partitioner ignores save_for_backward; it traces forward and backward into
one graph, merges the backward's recast with the forward's cast (common subexpressions) and
chooses what to keep by size, so that left alone it keeps the float8 input and recasts the
weight whatever the config says. So each forward cast that backward shares (tensorwise: the
same float8 tensor serves both gemms of a role) runs in its own selective activation-checkpoint
region, whose policy tags every op of the cast MUST_SAVE (the float8 result is kept) or
MUST_RECOMPUTE (backward recasts from the hp tensor): the tags the partitioner honours. A
recomputed dynamic cast finds its scale before its region, in forward, so backward's recast
reuses it (one pass over hp, no second amax). A cast
that backward does not share (rowwise, and blockwise activations: each gemm casts along its own
inner dim) is made in forward for backward only: untagged where backward keeps float8, tagged
MUST_RECOMPUTE where it keeps the hp tensor. The one choice the partitioner overrides is a
float8 weight kept for backward when the two gemms' casts differ (rowwise keep-fp8-weight): it
treats parameters as free to keep, so it keeps the hp weight and recasts.

With recompute_input_cast=None the input's cast is left untagged: the partitioner then keeps
the float8 input unless the hp input is kept for backward anyway (the input of the attention
output projection, which SDPA's backward needs, say), where a float8 copy would only add memory
(benchmarks/bench_memory.py measures the difference).

Inside a user's activation-checkpoint region the casts are tagged PREFER_RECOMPUTE instead: the
user asked for that region to be recomputed, and forcing float8 copies of every linear input to
be kept there would cost more memory than the checkpoint saves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachingTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.weak import WeakIdKeyDictionary

from fp8train.cast import (
    _COLUMN_MAJOR,
    _column_major,
    cast_for_gemms,
    cast_key,
    dynamic_scale,
    uses_cast_kernels,
    with_layout,
)
from fp8train.config import Float8LinearConfig, Gemm, Role, ScalingGranularity, ScalingType
from fp8train.delayed import DelayedState, stateful_scale
from fp8train.scaling import raise_amax
from fp8train.tensor import Float8Tensor

Observer = Callable[[Role, Gemm, torch.Tensor, Float8Tensor], None]
"""Called with (role, gemm, hp, float8) for each cast, by fp8train.stats."""


def observe_cast(
    observer: Observer | None, role: Role, gemm: Gemm, hp: torch.Tensor, fp8: torch.Tensor | None
) -> None:
    # A tensor that arrived in float8 (cast before an all-gather) has no hp to compare with.
    if observer is not None and isinstance(fp8, Float8Tensor) and not isinstance(hp, Float8Tensor):
        observer(role, gemm, hp, fp8)


# The gemm of backward that each role's kept tensor feeds.
BACKWARD_GEMM = {Role.INPUT: Gemm.GRAD_WEIGHT, Role.WEIGHT: Gemm.GRAD_INPUT}


def _recompute_requested(config: Float8LinearConfig, role: Role) -> bool:
    if role is Role.INPUT:
        return bool(config.recompute_input_cast)
    return config.recompute_weight_cast


def _tag(config: Float8LinearConfig, role: Role, keep: bool) -> bool | None:
    """The tag of a forward cast under torch.compile: True keep, False recompute, None leave
    the choice to the partitioner."""
    if role is Role.INPUT and config.recompute_input_cast is None:
        return None
    return keep


def keeps_float8(config: Float8LinearConfig, role: Role) -> bool:
    """True if backward keeps `role` in float8 from forward, False if it keeps the hp tensor."""
    return not _recompute_requested(config, role) and (
        cast_key(config, role, BACKWARD_GEMM[role]) is not None
    )


def forward_operands(
    hp: torch.Tensor,
    role: Role,
    config: Float8LinearConfig,
    observer: Observer | None = None,
    state: DelayedState | None = None,
    backward: bool = True,
) -> tuple[Float8Tensor | None, Float8Tensor | None]:
    """The casts forward makes of `hp` (input (M, K) or weight (N, K)): for the output gemm
    (None: that gemm runs in high precision on `hp`), and a second cast that backward keeps
    when its gemm needs a different one (None: backward keeps `hp` or the first cast, see
    `kept_for_backward`). None instead of repeats: autograd.Function under torch.compile
    refuses the same tensor twice. `backward=False` (no gradient will be taken): only the
    output gemm's cast."""
    if isinstance(hp, Float8Tensor):
        # Already float8: FSDP's float8 all-gather cast it (tensorwise, for both its gemms).
        return None, None
    backward_gemm = BACKWARD_GEMM[role]
    keep = backward and keeps_float8(config, role)
    shared = _shared(config, role)
    # The output gemm's cast is kept when backward shares it, and recomputed when backward
    # recasts the same cast from hp; a cast that backward never needs is left untagged (a
    # recompute tag would make the partitioner keep the hp tensor for it).
    tag = _tag(config, role, keep) if shared else None
    # Delayed and static scales are found here, outside any checkpoint region: recording the
    # amax is an in-place update, which a region must not hold.
    scale, record_amax = stateful_scale(
        hp, config.cast_config(role, Gemm.OUTPUT), state, config.round_scales_to_power_of_2
    )
    if keep and shared and (not torch.compiler.is_compiling() or _cast_ops_traced(config, role)):
        # One cast writes the output gemm's layout and the backward gemm's, from one read of
        # hp (the kernel on CUDA; a transposed copy elsewhere). Compiled, the region's tag
        # keeps the backward layout; the output gemm's is freed after its gemm.
        for_output, for_backward = _tagged_casts(
            hp, role, (Gemm.OUTPUT, backward_gemm), config, tag, scale, record_amax
        )
        observe_cast(observer, role, Gemm.OUTPUT, hp, for_output)
        return for_output, for_backward
    for_output = _tagged_cast(hp, role, Gemm.OUTPUT, config, tag, scale, record_amax)
    observe_cast(observer, role, Gemm.OUTPUT, hp, for_output)
    if shared or not backward:
        return for_output, None
    # A cast that only backward uses (rowwise, blockwise activations: along the other dim).
    # Compiled, the partitioner places such a cast itself, in forward if it keeps fewer bytes
    # than its hp tensor. Untagged, that keeps a float8 activation (tests/test_compile.py);
    # but a parameter is free to keep, so a float8 weight is never kept, tag or not: its cast
    # moves to backward (torch._functorch.config.treat_parameters_as_free_to_save).
    if keep:
        for_backward = _tagged_cast(hp, role, backward_gemm, config, None)
    elif (
        torch.compiler.is_compiling()
        and _tag(config, role, keep) is not None
        and config.cast_config(role, backward_gemm).scaling_type is ScalingType.DYNAMIC
    ):
        # Recompute asked for: made here in a region tagged MUST_RECOMPUTE, which moves it to
        # backward and keeps the hp tensor it is made from; left to backward's own recast, the
        # partitioner would keep a float8 copy made in forward instead.
        for_backward = _tagged_cast(hp, role, backward_gemm, config, False)
    else:
        return for_output, None
    observe_cast(observer, role, backward_gemm, hp, for_backward)
    return for_output, for_backward


# Eager mode: the casts of each input tensor, per cast configuration, while the tensor lives.
_INPUT_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shared_input_operands(
    input: torch.Tensor,
    input_2d: torch.Tensor,
    config: Float8LinearConfig,
    observer: Observer | None,
    state: DelayedState | None,
    backward: bool,
) -> tuple[Float8Tensor | None, Float8Tensor | None]:
    """`forward_operands` of a layer's input, shared by every layer that reads the same input
    tensor with the same casts: attention's q, k and v projections, the FFN's gate and up
    projections. Cast once, kept for backward once, instead of once per layer.

    Delayed scaling shares too: the first layer's cast (its scale) serves the others, and each
    of them records the same amax into its own state, so the histories of layers that read one
    input stay equal, and so do their scales. Eager mode only: compiled code needs no lookup
    (the compile partitioner's CSE merges the identical casts, tests/test_compile.py), a
    static cast has its own layer's scale, the stats observer wants every layer's casts, and where
    backward keeps the hp input (recompute_input_cast=True) a shared float8 copy would be
    memory that nothing else keeps. Only for inputs made in this forward (with a grad_fn): a
    leaf the caller feeds again and again (a benchmark's input, a batch kept around) must be
    cast each time, and its casts must not outlive the step. A tensor modified in place (its
    version moved) is cast again. The casts live as long as the input tensor: where something
    else keeps that tensor until backward, the output gemm's float8 copy stays with it (1 byte
    per element, against the 1 byte per element per extra layer that sharing saves)."""
    if (
        torch.compiler.is_compiling()  # first: dynamo cannot read grad_fn
        or input.grad_fn is None
        or observer is not None
        or isinstance(input, Float8Tensor)
        or config.cast_config(Role.INPUT, Gemm.OUTPUT).scaling_type is ScalingType.STATIC
        # Backward keeps the hp input: a shared cast would live with it until backward, a
        # float8 copy that an unshared cast frees as soon as its gemm is done.
        or not keeps_float8(config, Role.INPUT)
    ):
        return forward_operands(input_2d, Role.INPUT, config, observer, state, backward)
    key = (
        input._version,
        tuple(input_2d.shape),
        cast_key(config, Role.INPUT, Gemm.OUTPUT),
        cast_key(config, Role.INPUT, Gemm.GRAD_WEIGHT),
        keeps_float8(config, Role.INPUT),
        config.round_scales_to_power_of_2,
        backward,
        # Delayed: only with the same history rules; dynamic casts have no state.
        None if state is None else config.delayed_scaling_config,
    )
    casts = _INPUT_CASTS.setdefault(input, {})
    if key not in casts:
        for stale in [k for k in casts if k[0] != input._version]:
            del casts[stale]
        operands = forward_operands(input_2d, Role.INPUT, config, None, state, backward)
        casts[key] = (operands, None if state is None else state.amax)
        return operands
    operands, recorded = casts[key]
    if state is not None and state.amax is not recorded:
        # The first layer's cast recorded this input's amax (in the kernel, or before it):
        # this layer's history gets the same.
        with torch.no_grad():
            torch.maximum(state.amax, recorded, out=state.amax)
    return operands


def kept_for_backward(
    hp: torch.Tensor,
    for_output: Float8Tensor | None,
    for_backward: Float8Tensor | None,
    role: Role,
    config: Float8LinearConfig,
) -> torch.Tensor:
    """What backward keeps of `role`, from `forward_operands`' results (or the weight's
    casts from fp8train.cast_weights_once: a given `for_backward` is always kept)."""
    if for_backward is not None:
        return for_backward
    if not keeps_float8(config, role):
        return hp
    if isinstance(hp, Float8Tensor):
        # FSDP's float8 all-gather: keep the gathered weight itself, whose storage FSDP frees
        # after forward and refills before backward. A copy in the backward gemm's layout
        # made now would stay alive from forward to backward, one byte per weight element
        # per layer (what recompute_weight_cast avoids): it is made in backward (compiled:
        # relaid_in_backward).
        return hp
    # Kept in the layout of the backward gemm: the transposed copy is made now, while memory
    # is lower than at backward's peak, and the forward layout is freed.
    return with_layout(for_output, role, BACKWARD_GEMM[role])


def relaid_in_backward(fp8: Float8Tensor, role: Role) -> Float8Tensor:
    """`fp8` (a weight from FSDP's float8 all-gather) in its backward gemm's layout, the copy
    tagged for recomputation, for compiled code: the partitioner would otherwise make it in
    forward and keep it, as it cannot see that FSDP frees the gathered weight it comes from.
    Called outside the autograd.Function, where the tags reach the partitioner."""
    data = fp8._data
    column_major = _COLUMN_MAJOR[(role, BACKWARD_GEMM[role])] and data.dim() == 2
    if not column_major or data.t().is_contiguous():
        return fp8  # already in that layout
    data = checkpoint(
        _column_major,
        data,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _SAVE_POLICIES[False]),
    )
    return Float8Tensor(data, fp8._scale, fp8._orig_dtype, fp8._granularity)


def _shared(config: Float8LinearConfig, role: Role) -> bool:
    return cast_key(config, role, Gemm.OUTPUT) == cast_key(config, role, BACKWARD_GEMM[role])


def _cast_ops_traced(config: Float8LinearConfig, role: Role) -> bool:
    """True where a compiled cast of `role` is fp8train's triton ops, which write several
    layouts in one pass (fp8train.cast.uses_cast_kernels)."""
    cast = config.cast_config(role, Gemm.OUTPUT)
    return (
        uses_cast_kernels(config, role)
        and cast.scaling_granularity is ScalingGranularity.TENSORWISE
    )


def _tagged_cast(
    hp: torch.Tensor,
    role: Role,
    gemm: Gemm,
    config: Float8LinearConfig,
    keep: bool | None,
    scale: torch.Tensor | None = None,
    record_amax: torch.Tensor | None = None,
) -> Float8Tensor | None:
    return _tagged_casts(hp, role, (gemm,), config, keep, scale, record_amax)[0]


def _tagged_casts(
    hp: torch.Tensor,
    role: Role,
    gemms: tuple[Gemm, ...],
    config: Float8LinearConfig,
    keep: bool | None,
    scale: torch.Tensor | None = None,
    record_amax: torch.Tensor | None = None,
) -> list[Float8Tensor | None]:
    """One cast of `hp` for `gemms` (the same cast_key), each in its gemm's layout; compiled,
    in a region tagged `keep` (True save, False recompute, None untagged)."""
    cast = config.cast_config(role, gemms[0])
    if not cast.enabled:
        return [None for _ in gemms]
    if keep is None or not torch.compiler.is_compiling():
        with torch.no_grad():
            return cast_for_gemms(hp, role, gemms, config, scale, record_amax)
    if record_amax is not None:
        # Outside the region, which must not hold an in-place update; still independent of
        # the cast, which uses an earlier step's scale.
        with torch.no_grad():
            raise_amax(record_amax, hp)
    own_scale = False
    if not keep and scale is None and not _cast_ops_traced(config, role):
        # A recast in backward needs the amax of the same hp tensor that forward found:
        # found here, outside the region, the partitioner keeps the scale (a reduction's
        # small result) and backward's recast is one pass over hp instead of two.
        with torch.no_grad():
            scale = dynamic_scale(hp, role, gemms[0], config)
        own_scale = scale is not None
    # The region returns plain tensors: a subclass output of a checkpoint region is not traced.
    *data, scale = checkpoint(
        _cast_to_tensors,
        hp,
        role,
        gemms,
        config,
        scale,
        own_scale,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _SAVE_POLICIES[keep]),
    )
    return [Float8Tensor(d, scale, hp.dtype, cast.scaling_granularity) for d in data]


def _cast_to_tensors(
    hp: torch.Tensor,
    role: Role,
    gemms: tuple[Gemm, ...],
    config: Float8LinearConfig,
    scale: torch.Tensor | None,
    own_scale: bool,
) -> tuple[torch.Tensor, ...]:
    # No autograd graph for the cast: gradients reach hp through the matmul's own backward.
    with torch.no_grad():
        casts = cast_for_gemms(hp, role, gemms, config, scale, own_scale=own_scale)
    return (*(fp8._data for fp8 in casts), casts[0]._scale)


def _inside_user_checkpoint() -> bool:
    """True while tracing inside an enclosing activation-checkpoint region (its dispatch mode
    stays on the stack while our region's mode runs the policy)."""
    return any(isinstance(m, _CachingTorchDispatchMode) for m in _get_current_dispatch_mode_stack())


def _policy(tag: CheckpointPolicy, ctx, func, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001
    if _inside_user_checkpoint():
        return CheckpointPolicy.PREFER_RECOMPUTE
    return tag


_SAVE_POLICIES = {
    True: functools.partial(_policy, CheckpointPolicy.MUST_SAVE),
    False: functools.partial(_policy, CheckpointPolicy.MUST_RECOMPUTE),
}
