"""The column-major copy of a row-major float8 tensor: one read and one write of its bytes.

A compiled cast that writes both layouts (grad_output's: row-major for the grad_input gemm,
column-major for grad_weight) leaves both stores to inductor, which puts them in the kernel
that makes the values. When that kernel is a reduction (delayed scaling's one-pass cast
records the amax as it casts), inductor walks the tensor by rows and the column-major store
writes one byte per row per column: on the H100 the SwiGLU-backward kernel that does so took
twice bf16's time for the same bytes (benchmarks/results/e2e_loop_h100_2026-12-06.md).
Float8LinearConfig.compiled_transpose_kernels lets that kernel write the row-major bytes only
and makes the column-major copy here, from those bytes, in square tiles whose loads and stores
are both contiguous runs: 2 more bytes of traffic per element, with no strided store.
Measured on the H100 it saves inductor's kernel less than the copy costs
(benchmarks/results/e2e_transpose_h100_2026-12-06.md): that kernel is bound by the
instructions it issues, not by its stores
(benchmarks/results/kernel_instructions_cpu_2026-12-06.md).

The bytes are copied, never converted: the copy is the row-major tensor's, bit for bit.
"""

from __future__ import annotations

import torch

from fp8train.kernels.cast import empty_2d
from fp8train.kernels.launch import HAS_TRITON, cdiv, launch, tl, traced_launch, triton

if HAS_TRITON:

    @triton.jit
    def _transpose_kernel(
        src_ptr,
        dst_ptr,
        M,
        N,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < M) & (cols < N)
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        tile = tl.load(src_ptr + rows64 * N + cols64, mask=mask)
        # Stored as the transposed tile, whose fast dim is the destination's contiguous one
        # (the source's rows): Triton moves the tile through shared memory in between.
        tl.store(
            dst_ptr + tl.trans(cols64) * M + tl.trans(rows64), tl.trans(tile), mask=tl.trans(mask)
        )


TILE = (64, 64, 4)
"""(BLOCK_M, BLOCK_N, num_warps): 64-byte runs on both sides. Not tuned on a GPU yet."""


def column_major_2d(data: torch.Tensor, *, traced: bool = False) -> torch.Tensor:
    """A column-major copy of the 2-D row-major CUDA tensor `data` (float8 or any 1-byte
    dtype): same shape and values, strides (1, rows). `traced`: the body of a triton op that
    torch.compile traces (launched through wrap_triton)."""
    if data.dim() != 2 or data.element_size() != 1:
        raise ValueError(
            f"column_major_2d takes a 2-D tensor of 1-byte elements, got {tuple(data.shape)} "
            f"{data.dtype}"
        )
    if not data.is_contiguous():
        raise ValueError("column_major_2d copies a row-major (contiguous) tensor")
    m, n = data.shape
    out = empty_2d(m, n, data.dtype, data.device, column_major=True)
    if data.numel() == 0:
        return out
    # The kernel moves bytes: both sides as uint8, whatever float8 dtype they hold.
    src, dst = data.view(torch.uint8), out.t().view(torch.uint8)
    block_m, block_n, num_warps = TILE
    (traced_launch if traced else launch)(
        _transpose_kernel, (cdiv(m, block_m), cdiv(n, block_n)),
        src, dst, m, n,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return out
