"""The eager fast path: a Float8Linear with dynamic tensorwise scaling, in straight-line code.

Shapes: input (M, K), weight (N, K), grad_output (M, N); M = tokens.

    forward    input  -> e4m3, row-major (output gemm) and column-major (grad_weight gemm)
               weight -> e4m3, row-major (output gemm); column-major too if it is kept
               output = input_fp8 @ weight_fp8.T
    backward   grad_output -> e5m2, row-major (grad_input) and column-major (grad_weight)
               weight recast column-major with forward's scale (recompute_weight_cast)
               grad_input  = grad_output_fp8 @ weight_fp8
               grad_weight = grad_output_fp8.T @ input_fp8

Eager float8 is bound by the host on thin layers: the GPU finishes the casts and gemms of
attention's projections sooner than Python issues them. The general path (fp8train.matmul
with fp8train.policy) serves every config, compiled or not, and on the way builds Float8Tensors,
looks up each cast's config and asks the save policy. This path makes the same casts with the
same kernels and the same gemms, bit for bit (tests/test_eager.py), from plain tensors: on an
H100 host a small layer's fwd+bwd took 24-39% less host time than on the general path, and a
model of small layers 14% less step time (benchmarks/results/eager_path_h100_2026-12-07.md).

It runs where it can only agree with the general path: eager mode (not traced), CUDA, a plain
input and weight (no DTensor, no Float8Tensor from a float8 all-gather), no dispatch mode
active, no stats observer, no weight cast once for several micro-batches, the token count a
multiple of 16 where a weight gradient will follow (any count otherwise: evaluation,
generation one token at a time), and a config whose six casts are all dynamic tensorwise,
that keeps the input in float8 and does not emulate. Everything else takes the general path,
which also raises the errors for bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

import fp8train.cast
from fp8train.config import (
    ROLE_GEMMS,
    Float8LinearConfig,
    Gemm,
    Role,
    ScalingGranularity,
    ScalingType,
)
from fp8train.gemm import ALIGNMENT, grad_weight_tokens_misaligned
from fp8train.kernels import kernel_cast

EAGER_DEVICES = frozenset({"cuda"})
"""The device types the fast path takes. Elsewhere the host's time is not what bounds a step;
tests add "cpu" to run the path against the general one."""

_TENSORWISE = ScalingGranularity.TENSORWISE
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class EagerPlan:
    """What the fast path needs of a layer's config, read once per config."""

    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_output_dtype: torch.dtype
    fast_accum: dict[Gemm, bool]
    keep_float8_weight: bool
    round_scales_to_power_of_2: bool


def eager_plan(config: Float8LinearConfig, in_features: int, out_features: int) -> EagerPlan | None:
    """The plan of a layer the fast path can take, or None (the general path)."""
    if config.emulate or config.recompute_input_cast:
        return None
    if in_features % ALIGNMENT or out_features % ALIGNMENT:  # padded (pad_inner_dim)
        return None
    dtypes = {}
    for role, gemms in ROLE_GEMMS.items():
        first, second = (config.cast_config(role, gemm) for gemm in gemms)
        if first != second:  # a per-gemm override: two casts of one tensor
            return None
        if first.scaling_type is not ScalingType.DYNAMIC or first.scaling_granularity is not (
            _TENSORWISE
        ):
            return None
        dtypes[role] = first.target_dtype
    return EagerPlan(
        input_dtype=dtypes[Role.INPUT],
        weight_dtype=dtypes[Role.WEIGHT],
        grad_output_dtype=dtypes[Role.GRAD_OUTPUT],
        fast_accum={gemm: config.gemm_config(gemm).use_fast_accum for gemm in Gemm},
        keep_float8_weight=not config.recompute_weight_cast,
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )


def takes_eager_path(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """True if these operands of a layer with an EagerPlan take the fast path (see the module
    docstring). Not for traced code: the caller asks outside torch.compile only."""
    return (
        type(input) is torch.Tensor
        and type(weight) in _PLAIN
        and input.device.type in EAGER_DEVICES
        and not grad_weight_tokens_misaligned(input, weight)
        and not torch._C._len_torch_dispatch_stack()
    )


def eager_matmul(input: torch.Tensor, weight: torch.Tensor, plan: EagerPlan) -> torch.Tensor:
    """`input @ weight.T` through the float8 gemms, any leading dims, no bias."""
    input_2d = input.reshape(-1, input.shape[-1])
    backward = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    # The grad_weight gemm's column-major copy only where that gemm will run.
    input_casts = _input_casts(input, input_2d, plan, backward and weight.requires_grad)
    if backward:
        output = _EagerMatmul.apply(input_2d, weight, plan, *input_casts)
    else:  # no backward: the output gemm's casts only
        input_inverse, input_row, _ = input_casts
        _, weight_inverse, weight_row, _ = _cast(weight, plan.weight_dtype, True, False, plan)
        output = torch._scaled_mm(
            input_row, weight_row.t(), input_inverse, weight_inverse,
            out_dtype=input.dtype, use_fast_accum=plan.fast_accum[Gemm.OUTPUT],
        )  # fmt: skip
    return output.reshape(*input.shape[:-1], output.shape[-1])


# The casts of each input tensor made in forward, while the tensor lives.
_INPUT_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _input_casts(
    input: torch.Tensor, input_2d: torch.Tensor, plan: EagerPlan, column_major: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inverse scale, row-major bytes, column-major bytes or None) of the input, shared by
    the layers that read the same input tensor, as the general path shares them
    (fp8train.policy.shared_input_operands, which says when and why): attention's q, k and v
    projections cast their input once and keep one float8 copy for backward."""
    if input.grad_fn is None:  # a leaf the caller may feed again: cast each time
        return _cast(input_2d, plan.input_dtype, True, column_major, plan)[1:]
    key = (
        input._version,
        input_2d.shape,
        plan.input_dtype,
        plan.round_scales_to_power_of_2,
        column_major,
    )
    casts = _INPUT_CASTS.setdefault(input, {})
    found = casts.get(key)
    if found is None:
        for stale in [k for k in casts if k[0] != input._version]:
            del casts[stale]
        found = casts[key] = _cast(input_2d, plan.input_dtype, True, column_major, plan)[1:]
    return found


def _cast(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    row_major: bool,
    column_major: bool,
    plan: EagerPlan,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A tensorwise cast of `hp` as the general path makes it (a dynamic scale, or `scale`):
    (scale, inverse scale, row-major bytes or None, column-major bytes or None)."""
    pow2 = plan.round_scales_to_power_of_2
    # Through the module: a test's stand-in for either function serves both paths.
    if fp8train.cast.eager_kernel(hp):
        return kernel_cast(
            hp, float8_dtype, _TENSORWISE, row_major, column_major,
            round_scales_to_power_of_2=pow2, scale=scale,
        )  # fmt: skip
    layouts = (False,) * row_major + (True,) * column_major
    with torch.no_grad():  # gradients reach hp through the gemms' backward
        casts = fp8train.cast.cast_layouts(
            hp, float8_dtype, _TENSORWISE, layouts, round_scales_to_power_of_2=pow2, scale=scale
        )
    data = {column: fp8._data for column, fp8 in zip(layouts, casts, strict=True)}
    row = data.get(False)
    scale = casts[0]._scale
    return scale, scale.reciprocal(), None if row is None else row.contiguous(), data.get(True)


class _EagerMatmul(torch.autograd.Function):
    """The three gemms on plain tensors. Backward keeps what the general path keeps under the
    same config: the float8 input (column-major, as the grad_weight gemm takes it) and the hp
    weight with forward's scale, or the float8 weight where it is kept."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: torch.autograd.function.FunctionCtx,
        input: torch.Tensor,
        weight: torch.Tensor,
        plan: EagerPlan,
        input_inverse: torch.Tensor,
        input_row: torch.Tensor,
        input_col: torch.Tensor | None,
    ) -> torch.Tensor:
        need_grad_input = ctx.needs_input_grad[0]
        keep_weight = plan.keep_float8_weight and need_grad_input
        weight_scale, weight_inverse, weight_row, weight_col = _cast(
            weight, plan.weight_dtype, True, keep_weight, plan
        )
        output = torch._scaled_mm(
            input_row, weight_row.t(), input_inverse, weight_inverse,
            out_dtype=input.dtype, use_fast_accum=plan.fast_accum[Gemm.OUTPUT],
        )  # fmt: skip
        weight_kept = weight_col if keep_weight else weight if need_grad_input else None
        # What the general path saves: each float8 tensor (or the hp weight) and one scale;
        # the weight's inverse scale (4 bytes) rides on ctx, as there.
        ctx.save_for_backward(input_col, input_inverse, weight_kept, weight_scale)
        ctx.weight_inverse = weight_inverse
        ctx.plan = plan
        ctx.dtypes = input.dtype, weight.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # noqa: ANN001, ANN205, D102
        input_col, input_inverse, weight_kept, weight_scale = ctx.saved_tensors
        weight_inverse, plan = ctx.weight_inverse, ctx.plan
        need_grad_input, need_grad_weight = ctx.needs_input_grad[:2]
        _, grad_inverse, grad_row, grad_col = _cast(
            grad_output, plan.grad_output_dtype, need_grad_input, need_grad_weight, plan
        )
        grad_input = grad_weight = None
        if need_grad_input:
            if plan.keep_float8_weight:
                weight_col = weight_kept
            else:
                *_, weight_col = _cast(
                    weight_kept, plan.weight_dtype, False, True, plan, scale=weight_scale
                )
            grad_input = torch._scaled_mm(
                grad_row, weight_col, grad_inverse, weight_inverse,
                out_dtype=ctx.dtypes[0], use_fast_accum=plan.fast_accum[Gemm.GRAD_INPUT],
            )  # fmt: skip
            # Free what the grad_weight gemm does not need before it allocates its output.
            del grad_row, weight_col
        if need_grad_weight:
            grad_weight = torch._scaled_mm(
                grad_col.t(), input_col, grad_inverse, input_inverse,
                out_dtype=ctx.dtypes[1], use_fast_accum=plan.fast_accum[Gemm.GRAD_WEIGHT],
            )  # fmt: skip
        return grad_input, grad_weight, None, None, None, None
