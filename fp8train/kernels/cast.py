"""saturate(hp * scale) -> float8 in one pass: read hp once, write float8 once.

The torch path, `(hp.float() * scale).clamp(-max, max).to(float8)`, makes two full-size fp32
temporaries (4 bytes per element each, twice a bf16 tensor) that raise eager mode's peak memory
above bf16 training's. The kernel computes the same values in registers: fp32 product, the same
clamp, round-to-nearest-even conversion, so its bytes are those of the torch path.

Shapes: hp (M, N), any strides; scale broadcastable to (M, N): 0-d (tensorwise), (M, 1) or
(1, N) (rowwise). Output: (M, N), row-major or column-major (the layout the gemm operand needs,
written directly instead of cast then transposed: one float8 copy less in memory).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the CPU wheels of torch come without Triton
    HAS_TRITON = False

if HAS_TRITON:

    @triton.jit
    def _quantize_kernel(
        hp_ptr,
        scale_ptr,
        out_ptr,
        M,
        N,
        stride_hm,
        stride_hn,
        stride_sm,
        stride_sn,
        stride_om,
        stride_on,
        fp8_max,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < M) & (cols < N)
        # 64-bit offsets: activations of more than 2**31 elements exist.
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        hp = tl.load(hp_ptr + rows64 * stride_hm + cols64 * stride_hn, mask=mask)
        scale = tl.load(scale_ptr + rows64 * stride_sm + cols64 * stride_sn, mask=mask)
        scaled = hp.to(tl.float32) * scale
        # NaN stays NaN, as torch.clamp keeps it; e4m3fn has no inf, so saturate first.
        scaled = tl.minimum(
            tl.maximum(scaled, -fp8_max, propagate_nan=tl.PropagateNan.ALL),
            fp8_max,
            propagate_nan=tl.PropagateNan.ALL,
        )
        tl.store(
            out_ptr + rows64 * stride_om + cols64 * stride_on,
            scaled.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
            mask=mask,
        )


_BLOCK_M, _BLOCK_N = 32, 128


def quantize_2d(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, column_major: bool = False
) -> torch.Tensor:
    """The float8 bytes of `saturate(hp * scale)` for a 2-D CUDA tensor `hp` (see the module
    docstring for the shapes)."""
    m, n = hp.shape
    out = empty_2d(m, n, float8_dtype, hp.device, column_major)
    if out.numel() == 0:
        return out
    scale_strides = scale.expand(m, n).stride()
    grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _quantize_kernel[grid](
        hp,
        scale,
        out,
        m,
        n,
        hp.stride(0),
        hp.stride(1),
        scale_strides[0],
        scale_strides[1],
        out.stride(0),
        out.stride(1),
        torch.finfo(float8_dtype).max,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        num_warps=4,
    )
    return out


def empty_2d(
    m: int, n: int, dtype: torch.dtype, device: torch.device, column_major: bool
) -> torch.Tensor:
    """An uninitialized (m, n) tensor, row-major or column-major."""
    if column_major:
        return torch.empty((n, m), dtype=dtype, device=device).t()
    return torch.empty((m, n), dtype=dtype, device=device)
