"""max |hp| of a 2-D CUDA tensor as partial maxima: the amax of a dynamic tensorwise cast.

`torch.linalg.vector_norm(hp, inf)` reads the tensor at full bandwidth, but a reduction to one
value allocates and zeroes a staging buffer and semaphores on every call: on the H200's host
that is four or five CUDA API calls for each of a layer's amaxes a step. Here a fixed number
of programs (a few per multiprocessor) each fold a grid-stride share of the tiles into a
register tile and write its maximum to their own slot of an uninitialized buffer. The cast
kernel that consumes the buffer reduces the slots itself (fp8train.kernels.cast, a few hundred
fp32 values read from cache), so a dynamic cast is two launches with nothing to zero and no
state kept between launches, the same in eager mode and inside a compiled graph.

Values: max over the slots is the amax in fp32, as vector_norm gives it, except that a NaN
anywhere gives inf (which the cast turns into a NaN scale, as amax_to_scale does for every
non-finite amax).

An earlier kernel reduced to one value with an atomic max and a done-counter kept per device
and stream; on the H100 (2026-12-06, benchmarks/bench_cast.py) the partial maxima and the cast
that reduces them were as fast or faster on every tensor of the benchmark shapes.
"""

from __future__ import annotations

import functools

import torch

from fp8train.kernels.launch import (
    HAS_TRITON,
    cdiv,
    launch,
    tl,
    traced_launch,
    triton,
)

if HAS_TRITON:

    @triton.jit
    def _amax_partials_kernel(
        hp_ptr,
        partials_ptr,
        M,
        N,
        stride_hm,
        stride_hn,
        tiles_n,
        tiles,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        # max |hp| over the tiles pid, pid + programs, ..., NaN counted as inf. A program with
        # no tile (more programs than tiles) writes 0, which no maximum misses.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for tile in range(pid, tiles, programs):
            tile_m = tile // tiles_n
            rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
            cols = (tile - tile_m * tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            mask = (rows < M) & (cols < N)
            offsets = rows.to(tl.int64) * stride_hm + cols.to(tl.int64) * stride_hn
            magnitude = tl.abs(tl.load(hp_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
            acc = tl.maximum(acc, tl.where(magnitude == magnitude, magnitude, float("inf")))
        tl.store(partials_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


TILE = (64, 128, 4, 8)
"""(BLOCK_M, BLOCK_N, programs per multiprocessor, num_warps) of the amax kernel.
benchmarks/bench_cast.py times others."""


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def partials_count(device: torch.device, tile: tuple[int, int, int, int] | None = None) -> int:
    """The length of amax_partials_2d's output on `device`: one slot per program, a fixed
    number per device (whatever the tensor's shape, so that no compiled graph guards on it)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return (tile or TILE)[2] * _multiprocessors(index)


def amax_partials_2d(
    hp: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    traced: bool = False,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Partial maxima of |hp| for a 2-D CUDA tensor, in fp32: a 1-D tensor (partials_count
    long) whose maximum is max |hp|, with a NaN anywhere giving inf; slots of programs that
    had no tile hold 0 (an empty hp: all of them). One launch, nothing zeroed: what the cast
    kernel's `scale_from_amax` reduces itself. `out`: a contiguous 1-D fp32 buffer of that
    length to write into (its length is taken as the count). `traced`: the body of a triton
    op that torch.compile traces. `tile`: instead of TILE."""
    m, n = hp.shape
    if out is None:
        out = torch.empty(partials_count(hp.device, tile), dtype=torch.float32, device=hp.device)
    programs = out.numel()
    block_m, block_n, _, num_warps = tile or TILE
    tiles_n = cdiv(n, block_n)
    tiles = cdiv(m, block_m) * tiles_n
    (traced_launch if traced else launch)(
        _amax_partials_kernel, (programs,),
        hp, out, m, n, hp.stride(0), hp.stride(1), tiles_n, tiles,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return out
