"""saturate(hp * scale) -> float8 in one pass: read hp once, write float8 once per layout.

The torch path, `(hp.float() * scale).clamp(-max, max).to(float8)`, makes two full-size fp32
temporaries (4 bytes per element each, twice a bf16 tensor) that raise eager mode's peak memory
above bf16 training's, and a transposed copy afterwards (`.t().contiguous()`) is a strided copy
that runs at a fraction of the memory bandwidth. The kernel computes the same values in
registers (fp32 product, the same clamp, round-to-nearest-even conversion, so its bytes are
those of the torch path) and writes them in the layouts the gemms need: row-major, column-major
or both from the one read.

Two more things happen in the same pass where asked:
- the scale itself, from a tensorwise amax (`scale_from_amax`): the arithmetic of
  `fp8train.scaling.amax_to_scale`, op for op, so the scale is the torch path's to the bit; it
  saves the half-dozen tiny kernels of that function in eager mode. The amax may also come as
  the partial maxima of `amax_partials_2d` (a 1-D buffer), which every program reduces
  itself: a few hundred fp32 values, read from cache;
- the amax of hp, folded into an fp32 buffer with an atomic max (`record_amax`): delayed
  scaling's amax for the next step, at no extra read.

Shapes: hp (M, N), any strides; scale broadcastable to (M, N): 0-d (tensorwise), (M, 1) or
(1, N) (rowwise), or a 0-d amax with `scale_from_amax`.
"""

from __future__ import annotations

import torch

from fp8train.config import ScalingGranularity
from fp8train.kernels.amax import amax_partials_2d, partials_count
from fp8train.kernels.launch import HAS_TRITON, cdiv, launch, tl, traced_launch, triton
from fp8train.scaling import EPS, amax, amax_to_scale

if HAS_TRITON:

    @triton.jit
    def _cast_kernel(
        hp_ptr,
        scale_ptr,
        row_ptr,
        col_ptr,
        scale_out_ptr,
        inverse_out_ptr,
        amax_out_ptr,
        M,
        N,
        stride_hm,
        stride_hn,
        stride_sm,
        stride_sn,
        amax_count,
        FP8_MAX: tl.constexpr,
        EPS: tl.constexpr,
        SCALE_FROM_AMAX: tl.constexpr,
        WRITE_INVERSE: tl.constexpr,
        POW2: tl.constexpr,
        WRITE_ROW: tl.constexpr,
        WRITE_COL: tl.constexpr,
        RECORD_AMAX: tl.constexpr,
        AMAX_BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        # Constexprs, not runtime floats: inductor's launch of the triton ops would pass those
        # as fp64 (and its mutation analysis cannot trace a conversion of them).
        fp8_max, eps = FP8_MAX, EPS
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < M) & (cols < N)
        # 64-bit offsets: activations of more than 2**31 elements exist.
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        hp = tl.load(hp_ptr + rows64 * stride_hm + cols64 * stride_hn, mask=mask).to(tl.float32)
        if SCALE_FROM_AMAX:
            if AMAX_BLOCK > 1:  # partial maxima, amax_count of them
                slots = tl.arange(0, AMAX_BLOCK)
                partials = tl.load(scale_ptr + slots, mask=slots < amax_count, other=0.0)
                amax = tl.max(partials, axis=0)
            else:
                amax = tl.load(scale_ptr)
            # amax_to_scale: fp8_max / amax.clamp(min=EPS), which torch computes as
            # reciprocal (IEEE division) times fp8_max.
            scale = tl.math.div_rn(1.0, tl.maximum(amax, eps)) * fp8_max
            if POW2:  # round down to a power of 2: keep the exponent bits only
                scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
            scale = tl.where((amax == amax) & (amax != float("inf")), scale, float("nan"))
            if (pid_m == 0) & (pid_n == 0):
                tl.store(scale_out_ptr, scale)
                if WRITE_INVERSE:
                    tl.store(inverse_out_ptr, tl.math.div_rn(1.0, scale))
        else:
            scale = tl.load(scale_ptr + rows64 * stride_sm + cols64 * stride_sn, mask=mask)
            # A tensorwise scale: the same value in every lane. (Triton needs the constexpr
            # test apart from the tensor one.)
            if WRITE_INVERSE:  # noqa: SIM102
                if (pid_m == 0) & (pid_n == 0):
                    tl.store(inverse_out_ptr, tl.math.div_rn(1.0, tl.load(scale_ptr)))
        scaled = hp * scale
        # NaN stays NaN, as torch.clamp keeps it; e4m3fn has no inf, so saturate first.
        scaled = tl.minimum(
            tl.maximum(scaled, -fp8_max, propagate_nan=tl.PropagateNan.ALL),
            fp8_max,
            propagate_nan=tl.PropagateNan.ALL,
        )
        if RECORD_AMAX:
            magnitude = tl.abs(hp)
            # NaN counts as inf: the amax is then non-finite, which the delayed sync refuses.
            magnitude = tl.where(magnitude == magnitude, magnitude, float("inf"))
            tile_amax = tl.max(tl.max(tl.where(mask, magnitude, 0.0), axis=1), axis=0)
            tl.atomic_max(amax_out_ptr, tile_amax)
        if not SCALE_FROM_AMAX:
            # A given scale (delayed, static) never saw this input: an inf becomes NaN in
            # float8, as a dynamic cast makes it (there the whole tensor turns NaN through its
            # scale), never a saturated finite value. As the torch path does.
            scaled = tl.where(tl.abs(hp) == float("inf"), float("nan"), scaled)
        fp8 = scaled.to(row_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        if WRITE_ROW:
            tl.store(row_ptr + rows64 * N + cols64, fp8, mask=mask)
        if WRITE_COL:
            tl.store(col_ptr + rows64 + cols64 * M, fp8, mask=mask)


TILE = (32, 128, 4)
"""(BLOCK_M, BLOCK_N, num_warps) of the cast kernel: each program casts a BLOCK_M x BLOCK_N
tile. benchmarks/bench_cast.py times others."""


def cast_2d(
    hp: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    row_major: bool = True,
    column_major: bool = False,
    scale_from_amax: bool = False,
    round_to_power_of_2: bool = False,
    record_amax: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    inverse_out: torch.Tensor | None = None,
    traced: bool = False,
    tile: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The float8 bytes of `saturate(hp * scale)` for a 2-D CUDA tensor `hp`, in the layouts
    asked for: (scale, row-major data or None, column-major data or None).

    `scale_from_amax`: `scale` is a 0-d amax, or a 1-D tensor of partial maxima
    (amax_partials_2d), and the scale is computed from it (returned, in `scale_out` if given);
    otherwise the given scale is returned. `record_amax`: a 0-d fp32
    buffer that is raised to max |hp| in place. `inverse_out`: a 0-d fp32 tensor that receives
    1 / scale (the gemm's fp8 -> hp scale, as `reciprocal` computes it) for a tensorwise cast.
    `traced`: the body of a triton op that torch.compile traces (launched through wrap_triton).
    `tile`: (BLOCK_M, BLOCK_N, num_warps) instead of TILE.
    """
    m, n = hp.shape
    if not (row_major or column_major):
        raise ValueError("cast_2d needs at least one layout to write")
    if row_major and column_major and (hp.dtype == torch.float32 or not scale_from_amax):
        # Both stores from one tile are exact on the H200 (torch 2.11's Triton) only for a
        # 16-bit input with the scale computed in the kernel. From fp32 the column-major copy
        # came out wrong: Triton's ptxas 12.x miscompiles that kernel's byte extraction for
        # the column-major store (fp8train.toolchain; benchmarks/sass_hazards.py flags it in
        # every tile). With a given scale (delayed, static, rowwise) a bf16 grad_output came
        # out with NaNs. Everything else: two launches, one store each.
        scale, row, _ = cast_2d(
            hp, scale, float8_dtype, scale_from_amax=scale_from_amax,
            round_to_power_of_2=round_to_power_of_2, record_amax=record_amax,
            scale_out=scale_out, inverse_out=inverse_out, traced=traced, tile=tile,
        )  # fmt: skip
        _, _, col = cast_2d(
            hp, scale, float8_dtype, row_major=False, column_major=True, traced=traced, tile=tile
        )
        return scale, row, col
    if inverse_out is not None and not scale_from_amax and scale.numel() != 1:
        raise ValueError("inverse_out needs a tensorwise (one-element) scale")
    row = empty_2d(m, n, float8_dtype, hp.device, column_major=False) if row_major else None
    col = empty_2d(m, n, float8_dtype, hp.device, column_major=True) if column_major else None
    if scale_from_amax and scale_out is None:
        scale_out = empty_scalar(hp.device)
    if hp.numel() == 0:
        if scale_from_amax:
            pow2 = round_to_power_of_2
            scale_out.copy_(amax_to_scale(scale.max(), float8_dtype, round_to_power_of_2=pow2))
        if inverse_out is not None:
            inverse_out.copy_((scale_out if scale_from_amax else scale).reciprocal())
        return (scale_out if scale_from_amax else scale), row, col
    scale_strides = (0, 0) if scale_from_amax else scale.expand(m, n).stride()
    # Partial maxima: the kernel loads a power-of-2 block of them, the rest masked.
    amax_count = scale.numel() if scale_from_amax and scale.dim() == 1 else 1
    amax_block = 1 << (amax_count - 1).bit_length()
    any_out = row if row is not None else col
    block_m, block_n, num_warps = tile or TILE
    (traced_launch if traced else launch)(
        _cast_kernel, (cdiv(m, block_m), cdiv(n, block_n)),
        hp,
        scale,
        any_out if row is None else row,
        any_out if col is None else col,
        scale if scale_out is None else scale_out,
        scale if inverse_out is None else inverse_out,
        scale if record_amax is None else record_amax,
        m, n, hp.stride(0), hp.stride(1), scale_strides[0], scale_strides[1], amax_count,
        FP8_MAX=torch.finfo(float8_dtype).max,
        EPS=EPS,
        SCALE_FROM_AMAX=scale_from_amax,
        WRITE_INVERSE=inverse_out is not None,
        POW2=round_to_power_of_2,
        WRITE_ROW=row is not None,
        WRITE_COL=col is not None,
        RECORD_AMAX=record_amax is not None,
        AMAX_BLOCK=amax_block,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip
    return (scale_out if scale_from_amax else scale), row, col


def kernel_cast(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    granularity: ScalingGranularity,
    row_major: bool,
    column_major: bool,
    *,
    reduce_dim: int | None = None,
    round_scales_to_power_of_2: bool = False,
    scale: torch.Tensor | None = None,
    record_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """A tensorwise or rowwise cast of a 2-D CUDA tensor `hp` by the Triton kernels, as plain
    tensors: (scale, inverse scale or None, row-major bytes or None, column-major bytes or
    None), for eager mode (fp8train.cast.eager_kernel says where). The inverse (what the gemm
    takes) comes with tensorwise casts only. The kernels are launched directly, not through
    the fp8train ops that wrap them for tracing: an op's Python dispatch costs ~30 us a call
    on the host, and a layer casts 4 times a step."""
    inverse = None
    if granularity is ScalingGranularity.TENSORWISE:
        # One allocation for the scale, its inverse (what the gemm takes, written by the
        # cast kernel: no reciprocal launch per gemm) and the amax's partial maxima, 16
        # bytes apart: cuBLAS refuses a scale that is not 16-byte aligned
        # (CUBLAS_STATUS_NOT_SUPPORTED).
        slots = torch.empty(8 + partials_count(hp.device), device=hp.device)
        new_scale, inverse, partials = slots[0], slots[4], slots[8:]
    if scale is None and granularity is ScalingGranularity.TENSORWISE:
        scale, row, col = cast_2d(
            hp, amax_partials_2d(hp, partials), float8_dtype, row_major=row_major,
            column_major=column_major, scale_from_amax=True,
            round_to_power_of_2=round_scales_to_power_of_2, scale_out=new_scale,
            inverse_out=inverse,
        )  # fmt: skip
        return scale, inverse, row, col
    if scale is None:
        scale = amax_to_scale(
            amax(hp, granularity, reduce_dim),
            float8_dtype,
            round_to_power_of_2=round_scales_to_power_of_2,
        )
    _, row, col = cast_2d(
        hp, scale, float8_dtype, row_major=row_major, column_major=column_major,
        record_amax=record_amax, inverse_out=inverse,
    )  # fmt: skip
    return scale, inverse, row, col


def quantize_2d(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, column_major: bool = False
) -> torch.Tensor:
    """The float8 bytes of `saturate(hp * scale)` in one layout."""
    _, row, col = cast_2d(
        hp, scale, float8_dtype, row_major=not column_major, column_major=column_major
    )
    return col if column_major else row


def empty_scalar(device: torch.device) -> torch.Tensor:
    """An uninitialized 0-d fp32 tensor, as a view of a one-element buffer. Traced, a 0-d
    `torch.empty` costs a launch: inductor (torch 2.11 to 2.13) lowers it to a kernel that
    fills it with zero (its no-kernel marker is an empty range per dim, and a 0-d tensor has
    none), one launch per compiled cast; a one-element buffer is allocated without one."""
    return torch.empty((1,), dtype=torch.float32, device=device).view(())


def empty_2d(
    m: int, n: int, dtype: torch.dtype, device: torch.device, column_major: bool
) -> torch.Tensor:
    """An uninitialized (m, n) tensor, row-major or column-major."""
    if column_major:
        return torch.empty((n, m), dtype=dtype, device=device).t()
    return torch.empty((m, n), dtype=dtype, device=device)
