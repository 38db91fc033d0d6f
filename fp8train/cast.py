"""hp -> float8 and back: the one cast path every role and every gemm goes through.

Shapes (M = tokens, K = in_features, N = out_features): input (M, K), weight (N, K),
grad_output (M, N). A rowwise scale is taken along the inner dim of the gemm the operand
feeds, so the same tensor can need a different cast for each of its two gemms.
"""

from __future__ import annotations

import torch

from fp8train.config import BLOCK, CastConfig, Float8LinearConfig, Gemm, Role, ScalingGranularity
from fp8train.kernels import HAS_TRITON, empty_2d, quantize_2d
from fp8train.scaling import amax, amax_to_scale, blocks
from fp8train.tensor import Float8Tensor

# The dim each operand is reduced along for rowwise scales: its inner dim in that gemm.
_INNER_DIM: dict[tuple[Role, Gemm], int] = {
    (Role.INPUT, Gemm.OUTPUT): -1,  # input @ weight.T: K
    (Role.WEIGHT, Gemm.OUTPUT): -1,  # K
    (Role.GRAD_OUTPUT, Gemm.GRAD_INPUT): -1,  # grad_output @ weight: N
    (Role.WEIGHT, Gemm.GRAD_INPUT): 0,  # N
    (Role.GRAD_OUTPUT, Gemm.GRAD_WEIGHT): 0,  # grad_output.T @ input: M
    (Role.INPUT, Gemm.GRAD_WEIGHT): 0,  # M
}

# The layout each operand must have in memory for torch._scaled_mm (a row-major, b
# column-major): True where it is column-major in its role's shape. Casts write it directly.
_COLUMN_MAJOR: dict[tuple[Role, Gemm], bool] = {
    (Role.INPUT, Gemm.OUTPUT): False,  # a
    (Role.WEIGHT, Gemm.OUTPUT): False,  # b = weight.T, column-major when weight is row-major
    (Role.GRAD_OUTPUT, Gemm.GRAD_INPUT): False,  # a
    (Role.WEIGHT, Gemm.GRAD_INPUT): True,  # b
    (Role.GRAD_OUTPUT, Gemm.GRAD_WEIGHT): True,  # a = grad_output.T, row-major
    (Role.INPUT, Gemm.GRAD_WEIGHT): True,  # b
}


def to_float8(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    *,
    reduce_dim: int | None = None,
    block: tuple[int, int] | None = None,
    round_scales_to_power_of_2: bool = False,
    column_major: bool = False,
) -> Float8Tensor:
    """Cast `hp` to float8 with a dynamic scale from its amax (reduced along `reduce_dim`
    for rowwise, per `block` for blockwise); `column_major` lays a 2-D result out
    column-major."""
    scale = amax_to_scale(
        amax(hp, granularity, reduce_dim, block),
        float8_dtype,
        round_to_power_of_2=round_scales_to_power_of_2,
    )
    return quantize(hp, scale, float8_dtype, granularity, column_major=column_major)


def quantize(
    hp: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    *,
    column_major: bool = False,
) -> Float8Tensor:
    """`saturate(hp * scale)` in float8, with a given scale."""
    if granularity is ScalingGranularity.BLOCKWISE:
        data = _blockwise_saturated_cast(hp, scale, float8_dtype)
        data = _column_major(data) if column_major else data
        return Float8Tensor(data, scale, hp.dtype, granularity)
    if hp.is_cuda and hp.dim() == 2 and HAS_TRITON and not torch.compiler.is_compiling():
        # Eager CUDA: one pass, no fp32 temporaries. Compiled: the torch path, which inductor
        # fuses with the amax and with whatever produced hp.
        data = torch.ops.fp8train.saturated_cast(hp, scale, float8_dtype, column_major)
    else:
        data = _saturated_cast(hp, scale, float8_dtype, column_major)
    return Float8Tensor(data, scale, hp.dtype, granularity)


def _saturated_cast(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, column_major: bool = False
) -> torch.Tensor:
    fp8_max = torch.finfo(float8_dtype).max
    # Saturate before the cast: float8_e4m3fn has no inf, an overflow would become NaN.
    data = (hp.to(torch.float32) * scale).clamp(-fp8_max, fp8_max).to(float8_dtype)
    return _column_major(data) if column_major else data


def _blockwise_saturated_cast(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype
) -> torch.Tensor:
    (sr, sc), (r, c) = scale.shape, hp.shape
    blocked = blocks(hp, (r // sr, c // sc)).to(torch.float32) * scale[:, None, :, None]
    return _saturated_cast(blocked, torch.ones((), device=hp.device), float8_dtype).reshape(r, c)


def _column_major(data: torch.Tensor) -> torch.Tensor:
    return data if data.t().is_contiguous() else data.t().contiguous().t()


def with_layout(fp8: Float8Tensor, role: Role, gemm: Gemm) -> Float8Tensor:
    """`fp8` laid out as `gemm` needs it: itself, or a transposed copy of its bytes."""
    if not _COLUMN_MAJOR[(role, gemm)] or fp8._data.dim() != 2:
        return fp8
    data = _column_major(fp8._data)
    if data is fp8._data:
        return fp8
    return Float8Tensor(data, fp8._scale, fp8._orig_dtype, fp8._granularity)


@torch.library.custom_op("fp8train::saturated_cast", mutates_args=())
def _saturated_cast_op(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, column_major: bool
) -> torch.Tensor:
    """The float8 bytes of saturate(hp * scale): the Triton kernel where it runs (2-D, CUDA),
    else the torch path. An op of its own so that a traced graph holds it as one node."""
    if hp.is_cuda and hp.dim() == 2 and HAS_TRITON:
        return quantize_2d(hp, scale, float8_dtype, column_major)
    return _saturated_cast(hp, scale, float8_dtype, column_major)


@_saturated_cast_op.register_fake
def _(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, column_major: bool
) -> torch.Tensor:
    if hp.dim() != 2:
        return torch.empty_like(hp, dtype=float8_dtype)
    return empty_2d(*hp.shape, float8_dtype, hp.device, column_major)


def cast_key(config: Float8LinearConfig, role: Role, gemm: Gemm) -> tuple | None:
    """Two (role, gemm) pairs with the same key need the same float8 tensor, so one cast
    serves both. None: the operand is not cast."""
    cast = config.cast_config(role, gemm)
    if not cast.enabled:
        return None
    if cast.scaling_granularity is ScalingGranularity.TENSORWISE:
        return (cast, None)
    if cast.scaling_granularity is ScalingGranularity.BLOCKWISE:
        return (cast, block_shape(role, gemm))
    return (cast, _INNER_DIM[(role, gemm)])


def block_shape(role: Role, gemm: Gemm) -> tuple[int, int]:
    """Blockwise: the weight in BLOCK x BLOCK blocks (the same cast serves both its gemms);
    activations and gradients in 1 x BLOCK blocks along the gemm's inner dim."""
    if role is Role.WEIGHT:
        return (BLOCK, BLOCK)
    return (1, BLOCK) if _INNER_DIM[(role, gemm)] == -1 else (BLOCK, 1)


def cast_for_gemm(
    hp: torch.Tensor,
    role: Role,
    gemm: Gemm,
    config: Float8LinearConfig,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`hp` (2-D, in its role's shape) as the `gemm` needs it: a Float8Tensor, or `hp`
    itself when that gemm runs in high precision. `scale`: the scale of a delayed or static
    cast (fp8train.delayed); dynamic casts take theirs from the amax of `hp`."""
    cast: CastConfig = config.cast_config(role, gemm)
    if not cast.enabled:
        return hp
    column_major = hp.dim() == 2 and _COLUMN_MAJOR[(role, gemm)]
    if scale is not None:
        return quantize(hp, scale, cast.target_dtype, column_major=column_major)
    rowwise = cast.scaling_granularity is ScalingGranularity.ROWWISE
    blockwise = cast.scaling_granularity is ScalingGranularity.BLOCKWISE
    return to_float8(
        hp,
        cast.target_dtype,
        cast.scaling_granularity,
        reduce_dim=_INNER_DIM[(role, gemm)] if rowwise else None,
        block=block_shape(role, gemm) if blockwise else None,
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        column_major=column_major,
    )


def to_hp(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """float8 -> hp for a Float8Tensor; any other tensor is returned (converted to `dtype`)."""
    if isinstance(tensor, Float8Tensor):
        return tensor.to_hp(dtype)
    return tensor if dtype is None else tensor.to(dtype)
