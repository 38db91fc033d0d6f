"""max |hp| of a 2-D CUDA tensor in one launch: the amax of a dynamic tensorwise cast.

`torch.linalg.vector_norm(hp, inf)` reads the tensor at full bandwidth, but a reduction to one
value allocates and zeroes a staging buffer and semaphores on every call: on the H200's host
that is four or five CUDA API calls for each of a layer's three amaxes a step. This kernel
needs none of that. Each program folds a grid-stride share of the tiles into a register tile,
raises a running maximum with an atomic max and counts itself done; the last program to finish
moves the maximum to the output and puts the running maximum and the counter back to zero. Both
live in a small buffer kept per device and stream, zero between launches, so a launch needs
nothing initialized.

Values: the amax in fp32, as vector_norm gives it, except that a NaN anywhere gives inf (an
atomic max cannot carry NaN). A cast scale from either is NaN: amax_to_scale turns every
non-finite amax into a NaN scale.
"""

from __future__ import annotations

import functools

import torch

from fp8train.kernels.launch import (
    HAS_TRITON,
    cdiv,
    current_stream,
    launch,
    tl,
    traced_launch,
    triton,
)

if HAS_TRITON:

    @triton.jit
    def _amax_kernel(
        hp_ptr,
        out_ptr,
        running_ptr,
        count_ptr,
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for tile in range(pid, tiles, programs):
            tile_m = tile // tiles_n
            rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
            cols = (tile - tile_m * tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            mask = (rows < M) & (cols < N)
            offsets = rows.to(tl.int64) * stride_hm + cols.to(tl.int64) * stride_hn
            magnitude = tl.abs(tl.load(hp_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
            acc = tl.maximum(acc, tl.where(magnitude == magnitude, magnitude, float("inf")))
        # Non-negative floats order as their bit patterns do, which the atomic max relies on.
        tl.atomic_max(running_ptr, tl.max(tl.max(acc, axis=1), axis=0))
        # acq_rel: the last program's increment sees every earlier program's atomic max.
        if tl.atomic_add(count_ptr, 1) == programs - 1:
            tl.store(out_ptr, tl.atomic_xchg(running_ptr, 0.0))
            tl.atomic_xchg(count_ptr, 0)


TILE = (64, 128, 4, 8)
"""(BLOCK_M, BLOCK_N, programs per multiprocessor, num_warps) of the amax kernel.
benchmarks/bench_cast.py times others."""

_STATE: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _state(device: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running maximum and done-counter of this device's current stream: zero between
    launches. Launches on one stream run in order, so they can share them."""
    key = (device, current_stream(device))
    state = _STATE.get(key)
    if state is None:
        state = _STATE[key] = (
            torch.zeros((), dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
        )
    return state


def amax_2d(
    hp: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    traced: bool = False,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """max |hp| in fp32 (0-d) for a 2-D CUDA tensor, written into `out` (0-d fp32) if given.
    `traced`: the body of a triton op that torch.compile traces; the running maximum and the
    counter are fresh zeros, no state kept between calls. `tile`: instead of TILE."""
    m, n = hp.shape
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=hp.device)
    if hp.numel() == 0:
        return out.zero_()
    device = hp.device.index if traced else torch.cuda.current_device()
    block_m, block_n, programs_per_sm, num_warps = tile or TILE
    tiles_n = cdiv(n, block_n)
    tiles = cdiv(m, block_m) * tiles_n
    if traced:
        # Fresh zeros, each its own tensor: functionalization copies a kernel's mutated
        # arguments one by one, so one tensor passed as two of them could come back as two.
        running = torch.zeros((), dtype=torch.float32, device=hp.device)
        count = torch.zeros((), dtype=torch.int32, device=hp.device)
    else:
        running, count = _state(device)
    (traced_launch if traced else launch)(
        _amax_kernel, (min(tiles, programs_per_sm * _multiprocessors(device)),),
        hp, out, running, count, m, n, hp.stride(0), hp.stride(1), tiles_n, tiles,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return out
