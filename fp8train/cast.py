"""hp -> float8 and back: the one cast path every role and every gemm goes through.

Shapes (M = tokens, K = in_features, N = out_features): input (M, K), weight (N, K),
grad_output (M, N). A rowwise scale is taken along the inner dim of the gemm the operand
feeds, so the same tensor can need a different cast for each of its two gemms.
"""

from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fp8train.config import (
    BLOCK,
    FLOAT8_DTYPES,
    HP_DTYPES,
    CastConfig,
    Float8LinearConfig,
    Gemm,
    Role,
    ScalingGranularity,
    ScalingType,
    parse_enum,
)
from fp8train.kernels import (
    HAS_TRITON,
    amax_partials_2d,
    cast_2d,
    column_major_2d,
    kernel_cast,
)
from fp8train.scaling import amax, amax_to_scale, blocks, raise_amax
from fp8train.tensor import Float8Tensor
from fp8train.toolchain import auto_transpose_roles

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
    if float8_dtype not in FLOAT8_DTYPES:
        raise ValueError(
            f"to_float8: float8_dtype={float8_dtype} is not a float8 dtype: give "
            "torch.float8_e4m3fn or torch.float8_e5m2"
        )
    if hp.dtype not in HP_DTYPES:
        raise TypeError(
            f"to_float8: hp of dtype {hp.dtype} is not float32, bfloat16 or float16, which "
            "float8 casts from: cast it to one of them first"
        )
    if not isinstance(granularity, ScalingGranularity):  # a name ("rowwise"); dynamo cannot
        granularity = parse_enum(ScalingGranularity, granularity)  # construct an enum
    _check_granularity_args(hp, granularity, reduce_dim, block)
    (fp8,) = cast_layouts(
        hp,
        float8_dtype,
        granularity,
        (column_major,),
        reduce_dim=reduce_dim,
        block=block,
        round_scales_to_power_of_2=round_scales_to_power_of_2,
    )
    return fp8


def _check_granularity_args(
    hp: torch.Tensor,
    granularity: ScalingGranularity,
    reduce_dim: int | None,
    block: tuple[int, int] | None,
) -> None:
    """A ValueError naming to_float8's argument that does not fit `granularity` and `hp`."""
    if granularity is ScalingGranularity.ROWWISE and not (
        isinstance(reduce_dim, int) and -hp.dim() <= reduce_dim < hp.dim()
    ):
        raise ValueError(
            f"to_float8: rowwise scaling needs reduce_dim, the dim to take each amax along (a "
            f"gemm's inner dim), within the tensor's {hp.dim()} dims; got {reduce_dim!r}"
        )
    if granularity is ScalingGranularity.BLOCKWISE:
        if not (
            isinstance(block, tuple)
            and len(block) == 2
            and all(isinstance(size, int) and size > 0 for size in block)
        ):
            raise ValueError(
                f"to_float8: blockwise scaling needs block=(rows, cols), two positive ints such "
                f"as (1, {BLOCK}) or ({BLOCK}, {BLOCK}); got {block!r}"
            )
        if hp.dim() != 2 or hp.shape[0] % block[0] or hp.shape[1] % block[1]:
            raise ValueError(
                f"to_float8: blockwise scaling takes a 2-D tensor whose dims the block "
                f"{block} divides; got shape {tuple(hp.shape)}"
            )


def quantize(
    hp: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    *,
    column_major: bool = False,
) -> Float8Tensor:
    """`saturate(hp * scale)` in float8, with a given scale."""
    (fp8,) = cast_layouts(hp, float8_dtype, granularity, (column_major,), scale=scale)
    return fp8


def eager_kernel(hp: torch.Tensor) -> bool:
    """True where the Triton kernels run: eager CUDA, 2-D. Compiled code keeps the torch path,
    which inductor fuses with the amax and with whatever produced hp."""
    return (
        hp.is_cuda
        and hp.dim() == 2
        and hp.numel() > 0  # nothing to launch for: the torch path makes the empty casts
        and HAS_TRITON
        and not torch.compiler.is_compiling()
        # A DTensor (tensor parallelism) has no kernel of ours: it takes the torch path,
        # whose reductions DTensor makes global.
        and not is_traceable_wrapper_subclass(hp)
    )


def cast_layouts(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    granularity: ScalingGranularity,
    layouts: tuple[bool, ...],
    *,
    reduce_dim: int | None = None,
    block: tuple[int, int] | None = None,
    round_scales_to_power_of_2: bool = False,
    scale: torch.Tensor | None = None,
    record_amax: torch.Tensor | None = None,
    compiled_kernels: bool = False,
    own_scale: bool = False,
    transpose_kernel: bool = False,
) -> list[Float8Tensor]:
    """One cast of `hp` (one scale), as one Float8Tensor per entry of `layouts` (True:
    column-major). `scale`: given (delayed, static) instead of found from the amax;
    `record_amax`: a 0-d fp32 buffer raised to max |hp| (delayed scaling's next amax), in
    the cast's own pass where the kernel runs. `compiled_kernels`: a tensorwise cast traced
    by torch.compile becomes fp8train's triton ops (uses_cast_kernels). `own_scale`: the
    given `scale` was found from this `hp`'s amax (see cast_for_gemms). `transpose_kernel`:
    traced by torch.compile with both layouts asked, the column-major copy is made from the
    row-major bytes by fp8train's transpose op (Float8LinearConfig.compiled_transpose_kernels)."""
    if (
        compiled_kernels
        and granularity is ScalingGranularity.TENSORWISE
        and hp.dim() == 2
        and torch.compiler.is_compiling()
        and not is_traceable_wrapper_subclass(hp)
    ):
        return _cast_ops(hp, float8_dtype, layouts, round_scales_to_power_of_2, scale, record_amax)
    if granularity is not ScalingGranularity.BLOCKWISE and eager_kernel(hp):
        scale, inverse, *data = kernel_cast(
            hp, float8_dtype, granularity, False in layouts, True in layouts,
            reduce_dim=reduce_dim, round_scales_to_power_of_2=round_scales_to_power_of_2,
            scale=scale, record_amax=record_amax,
        )  # fmt: skip
        casts = [Float8Tensor(data[int(cm)], scale, hp.dtype, granularity) for cm in layouts]
        for fp8 in casts:
            fp8._inv_scale = inverse
        return casts
    if record_amax is not None:
        # A delayed cast with an earlier step's scale (compiled, or without the kernel): the
        # amax is this step's by-product, as in the kernel.
        with torch.no_grad():
            raise_amax(record_amax, hp)
    # A given scale (delayed, static) may not have seen an inf of hp: the cast makes it NaN.
    # hp's own scale did, and is NaN already.
    given_scale = scale is not None and not own_scale
    if scale is None:
        scale = amax_to_scale(
            amax(hp, granularity, reduce_dim, block),
            float8_dtype,
            round_to_power_of_2=round_scales_to_power_of_2,
        )
    if granularity is ScalingGranularity.BLOCKWISE:
        data = _blockwise_saturated_cast(hp, scale, float8_dtype)
    else:
        data = _saturated_cast(hp, scale, float8_dtype, nonfinite_to_nan=given_scale)
    first = data
    relayout = _column_major
    if (
        transpose_kernel
        and False in layouts
        and torch.compiler.is_compiling()
        and not is_traceable_wrapper_subclass(first)
    ):
        relayout = _transpose_op
    casts = []
    for column_major in layouts:
        data = relayout(first) if column_major and first.dim() == 2 else first
        casts.append(Float8Tensor(data, scale, hp.dtype, granularity))
    return casts


def _cast_ops(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    layouts: tuple[bool, ...],
    round_to_power_of_2: bool,
    scale: torch.Tensor | None,
    record_amax: torch.Tensor | None,
) -> list[Float8Tensor]:
    """A tensorwise cast as triton ops, for torch.compile: one for the amax (partial maxima
    on CUDA) and one for the cast writing every layout in `layouts` (which reduces them);
    inductor launches their kernels itself."""
    row, col = False in layouts, True in layouts
    ops = torch.ops.fp8train
    if scale is None:
        hp_amax = ops.amax(hp)
        scale, *data = ops.cast_from_amax(hp, hp_amax, float8_dtype, round_to_power_of_2, row, col)
    else:
        data = ops.saturated_cast(hp, scale, float8_dtype, row, col, record_amax)
    return [
        Float8Tensor(data[int(cm)], scale, hp.dtype, ScalingGranularity.TENSORWISE)
        for cm in layouts
    ]


EAGER_PIECES = 8
"""The torch path's eager fp32 work on a large tensor (its casts, fp8train.float8_swiglu) runs
over this many pieces of its rows, one at a time: the fp32 temporaries, 4-8 bytes per element
at once, then cost at most 1 byte per element of the whole, less than a bf16 copy (float8 must
never cost more memory than bf16). Compiled code takes the whole tensor: inductor fuses the
work into one pass with no temporaries, as the Triton kernels do."""

EAGER_PIECE_MIN_ELEMENTS = 2**16
"""Smaller tensors are worked on whole."""

EAGER_PIECE_MIN_ELEMENTS_CUDA = 2**22
"""The same on a GPU, where each piece costs kernel launches (the eager torch path runs there
for blockwise casts, DTensors aside): below 16 MiB of fp32 temporaries, whole."""


def eager_rows_per_piece(rows: int, elements: int, device: torch.device) -> int:
    """How many of a tensor's `rows` (of `elements` in all, on `device`) the eager torch path
    takes at a time: all for a small tensor, else 1/EAGER_PIECES of them. Eager only: callers
    take compiled tensors whole before asking, since under dynamic shapes these size tests
    would install guards."""
    smallest = EAGER_PIECE_MIN_ELEMENTS_CUDA if device.type == "cuda" else EAGER_PIECE_MIN_ELEMENTS
    if elements < smallest:
        return max(rows, 1)
    return max(-(-rows // EAGER_PIECES), 1)


def _saturated_cast(
    hp: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
    column_major: bool = False,
    nonfinite_to_nan: bool = False,
) -> torch.Tensor:
    """The torch path of every non-blockwise cast (and the reference of the kernels).
    `nonfinite_to_nan`: an inf in hp becomes NaN, never a saturated finite value (a delayed
    cast whose scale did not see this step's amax; a dynamic cast's scale turns NaN)."""
    rows = hp.shape[0] if hp.dim() else 1
    # Compiled code (whose sizes may be symbolic: no size test, no guard) and DTensors whole.
    whole = torch.compiler.is_compiling() or is_traceable_wrapper_subclass(hp)
    if whole or (step := eager_rows_per_piece(rows, hp.numel(), hp.device)) >= rows:
        data = _saturated_cast_whole(hp, scale, float8_dtype, nonfinite_to_nan)
    else:
        data = torch.empty(hp.shape, dtype=float8_dtype, device=hp.device)
        # A scale with one value per row of hp (rowwise along the last dim) is cut with it.
        per_row = scale.dim() == hp.dim() and scale.shape[0] == rows
        for start in range(0, rows, step):
            piece = slice(start, start + step)
            data[piece] = _saturated_cast_whole(
                hp[piece], scale[piece] if per_row else scale, float8_dtype, nonfinite_to_nan
            )
    return _column_major(data) if column_major else data


def _saturated_cast_whole(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, nonfinite_to_nan: bool
) -> torch.Tensor:
    fp8_max = torch.finfo(float8_dtype).max
    # Saturate before the cast: float8_e4m3fn has no inf, an overflow would become NaN.
    wide = hp.to(torch.float32)
    scaled = (wide * scale).clamp(-fp8_max, fp8_max)
    if nonfinite_to_nan:
        # |inf - inf| is NaN: no NaN constant in the graph, which would keep torch.compile's
        # common-subexpression elimination (it compares arguments with ==) from merging the
        # casts of one input by layers that share its scale (tie_delayed_input_scales). The
        # abs makes it the positive NaN on every device (x86 makes a negative one), as the
        # constant and the kernel are.
        scaled = torch.where(torch.isinf(hp), (wide - wide).abs(), scaled)
    return scaled.to(float8_dtype)


def _blockwise_saturated_cast(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype
) -> torch.Tensor:
    (sr, sc), (r, c) = scale.shape, hp.shape
    # A block row of hp is a row of the blocked view, and its scales one row of the scale.
    blocked = blocks(hp, (r // sr, c // sc))
    return _saturated_cast(blocked, scale[:, None, :, None], float8_dtype).reshape(r, c)


def _column_major(data: torch.Tensor) -> torch.Tensor:
    return data if data.t().is_contiguous() else data.t().contiguous().t()


def with_layout(fp8: Float8Tensor, role: Role, gemm: Gemm) -> Float8Tensor:
    """`fp8` laid out as `gemm` needs it: itself, or a transposed copy of its bytes."""
    if not _COLUMN_MAJOR[(role, gemm)] or fp8._data.dim() != 2:
        return fp8
    data = _column_major(fp8._data)
    if data is fp8._data:
        return fp8
    return fp8.rewrapped(data)


def _layouts_of(data: torch.Tensor, row_major: bool, column_major: bool) -> tuple:
    """(row-major, column-major) copies of `data`; an empty tensor for a layout not asked
    for (an op's outputs are fixed in number)."""
    return (
        data.contiguous() if row_major else _absent(data),
        _column_major(data) if column_major else _absent(data),
    )


def _absent(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype or like.dtype, device=like.device)


def _or_absent(data: torch.Tensor | None, hp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _absent(hp, dtype) if data is None else data


def _triton_op(name: str, *, mutates_args: tuple[str, ...]):  # noqa: ANN202
    """torch.library.triton_op, without the warning torch logs at registration when Triton is
    absent (CPU builds): it looks for kernels in the function and finds none. The op runs the
    torch path there."""

    def register(fn):  # noqa: ANN001, ANN202
        log = logging.getLogger("torch._library.triton")
        level = log.level
        if not HAS_TRITON:
            log.setLevel(logging.ERROR)
        try:
            return torch.library.triton_op(name, mutates_args=mutates_args)(fn)
        finally:
            log.setLevel(level)

    return register


@_triton_op("fp8train::saturated_cast", mutates_args=("record_amax",))
def _saturated_cast_op(
    hp: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
    row_major: bool,
    column_major: bool,
    record_amax: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float8 bytes of saturate(hp * scale), (row-major, column-major), each empty unless
    asked for; `record_amax` raised to max |hp| if given. The Triton kernel where it runs (2-D,
    CUDA), else the torch path. A triton op: a traced graph holds it as one node, and inductor
    launches its kernel from the code it generates; eager casts call the kernel directly
    (cast_layouts)."""
    if hp.is_cuda and hp.dim() == 2 and HAS_TRITON:
        _, row, col = cast_2d(
            hp, scale, float8_dtype, row_major=row_major, column_major=column_major,
            record_amax=record_amax, traced=True,
        )  # fmt: skip
        return _or_absent(row, hp, float8_dtype), _or_absent(col, hp, float8_dtype)
    if record_amax is not None:
        raise_amax(record_amax, hp)
    return _layouts_of(_saturated_cast(hp, scale, float8_dtype), row_major, column_major)


@_triton_op("fp8train::column_major", mutates_args=())
def _column_major_op(data: torch.Tensor) -> torch.Tensor:
    """A column-major copy of the row-major 2-D float8 tensor `data`, the same bytes: the
    Triton transpose kernel on CUDA, else the torch path. A triton op, so that inductor
    neither fuses the copy into the kernel that makes `data` nor recomputes it from `data`'s
    inputs (Float8LinearConfig.compiled_transpose_kernels)."""
    if data.is_cuda and HAS_TRITON:
        return column_major_2d(data.contiguous(), traced=True)
    return column_major_copy(data)


def column_major_copy(data: torch.Tensor) -> torch.Tensor:
    """A column-major copy of the 2-D `data` with torch: a fresh tensor even where `data` is
    column-major too (one row or one column), as an op's output must not alias its input."""
    return data.t().clone(memory_format=torch.contiguous_format).t()


def _transpose_op(data: torch.Tensor) -> torch.Tensor:
    """The column_major op, called through this name so that a CPU probe can stand an opaque
    op in for it (benchmarks/saved_by_block.py --opaque-casts): off CUDA the triton op traces
    into its torch path, which inductor fuses as it fuses `_column_major`."""
    return torch.ops.fp8train.column_major(data)


@_triton_op("fp8train::amax", mutates_args=())
def _amax_op(hp: torch.Tensor) -> torch.Tensor:
    """max |hp| as a 1-D fp32 tensor whose maximum is the amax: on CUDA (2-D) the partial
    maxima of the Triton kernel's programs (one launch, no buffer to zero), else the torch
    path's amax as one element. cast_from_amax takes either."""
    if hp.is_cuda and hp.dim() == 2 and HAS_TRITON:
        return amax_partials_2d(hp, traced=True)
    return amax(hp, ScalingGranularity.TENSORWISE, None).reshape(1)


@_triton_op("fp8train::cast_from_amax", mutates_args=())
def _cast_from_amax_op(
    hp: torch.Tensor,
    hp_amax: torch.Tensor,
    float8_dtype: torch.dtype,
    round_to_power_of_2: bool,
    row_major: bool,
    column_major: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dynamic tensorwise cast from the amax of hp (0-d, or 1-D partial maxima as the amax
    op gives them): (scale, row-major, column-major), a layout empty unless asked for. On CUDA
    the scale is computed inside the cast kernel, bit for bit as amax_to_scale computes it."""
    if hp.is_cuda and hp.dim() == 2 and HAS_TRITON:
        scale, row, col = cast_2d(
            hp, hp_amax, float8_dtype, row_major=row_major, column_major=column_major,
            scale_from_amax=True, round_to_power_of_2=round_to_power_of_2, traced=True,
        )  # fmt: skip
        return scale, _or_absent(row, hp, float8_dtype), _or_absent(col, hp, float8_dtype)
    scale = amax_to_scale(hp_amax.max(), float8_dtype, round_to_power_of_2=round_to_power_of_2)
    data = _saturated_cast(hp, scale, float8_dtype)
    return (scale, *_layouts_of(data, row_major, column_major))


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
    record_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """`hp` (2-D, in its role's shape) as the `gemm` needs it: a Float8Tensor, or `hp`
    itself when that gemm runs in high precision. `scale`: the scale of a delayed or static
    cast (fp8train.delayed), with `record_amax` the buffer a one-pass delayed cast records its
    amax into; dynamic casts take their scale from the amax of `hp`."""
    return cast_for_gemms(hp, role, (gemm,), config, scale, record_amax)[0]


def cast_for_gemms(
    hp: torch.Tensor,
    role: Role,
    gemms: tuple[Gemm, ...],
    config: Float8LinearConfig,
    scale: torch.Tensor | None = None,
    record_amax: torch.Tensor | None = None,
    *,
    own_scale: bool = False,
) -> list[torch.Tensor]:
    """One cast of `hp` for several gemms that share it (the same `cast_key`), each in the
    layout its gemm needs: on CUDA the kernel writes every layout from one read of `hp`.
    `own_scale`: the given `scale` is `dynamic_scale` of this `hp` (a dynamic cast whose amax
    pass ran apart), not a delayed or static one."""
    if isinstance(hp, Float8Tensor):
        # Cast already, before a float8 all-gather (Float8RowwiseParallel's grad_output),
        # with the tensorwise dynamic cast that style requires.
        return [with_layout(hp, role, gemm) for gemm in gemms]
    cast: CastConfig = config.cast_config(role, gemms[0])
    if not cast.enabled:
        return [hp for _ in gemms]
    granularity = cast.scaling_granularity
    return cast_layouts(
        hp,
        cast.target_dtype,
        granularity,
        tuple(hp.dim() == 2 and _COLUMN_MAJOR[(role, gemm)] for gemm in gemms),
        **_scale_shape(role, gemms[0], granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        scale=scale,
        record_amax=record_amax,
        compiled_kernels=uses_cast_kernels(config, role),
        own_scale=own_scale,
        transpose_kernel=role in transpose_kernel_roles(config),
    )


def transpose_kernel_roles(config: Float8LinearConfig) -> frozenset[Role]:
    """The roles config.compiled_transpose_kernels names, "auto" as this process decided it."""
    roles = config.compiled_transpose_kernels
    return auto_transpose_roles() if roles == "auto" else roles


def dynamic_scale(
    hp: torch.Tensor, role: Role, gemm: Gemm, config: Float8LinearConfig
) -> torch.Tensor | None:
    """The scale a dynamic cast of `hp` for `gemm` finds from its amax, the same value
    cast_for_gemm would find; None where that cast is not dynamic or not made at all. For
    casts whose amax pass must run apart from the cast itself (fp8train.policy)."""
    cast = config.cast_config(role, gemm)
    if not cast.enabled or cast.scaling_type is not ScalingType.DYNAMIC:
        return None
    granularity = cast.scaling_granularity
    return amax_to_scale(
        amax(hp, granularity, **_scale_shape(role, gemm, granularity)),
        cast.target_dtype,
        round_to_power_of_2=config.round_scales_to_power_of_2,
    )


def _scale_shape(role: Role, gemm: Gemm, granularity: ScalingGranularity) -> dict:
    """What a cast of `role` for `gemm` reduces its amax over, as amax() and cast_layouts()
    take it: the gemm's inner dim (rowwise) or its blocks (blockwise)."""
    return {
        "reduce_dim": _INNER_DIM[(role, gemm)]
        if granularity is ScalingGranularity.ROWWISE
        else None,
        "block": block_shape(role, gemm) if granularity is ScalingGranularity.BLOCKWISE else None,
    }


def uses_cast_kernels(config: Float8LinearConfig, role: Role) -> bool:
    """True where compiled casts of `role` are fp8train's triton ops
    (Float8LinearConfig.compiled_cast_kernels names the role; tensorwise casts only). Not for
    a float8 weight kept for backward: on the H200 the partitioner kept the hp weight instead
    when its cast was a triton op, and the torch path's cast keeps to the policy."""
    return role in config.compiled_cast_kernels and not (
        role is Role.WEIGHT and not config.recompute_weight_cast
    )


def to_hp(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """float8 -> hp for a Float8Tensor; any other tensor is returned (converted to `dtype`)."""
    if isinstance(tensor, Float8Tensor):
        return tensor.to_hp(dtype)
    return tensor if dtype is None else tensor.to(dtype)
