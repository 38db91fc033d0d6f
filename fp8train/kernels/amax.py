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

Under torch.compile that state cannot persist between calls (a traced op owns only what it
allocates), and zeroing fresh state costs a launch per tensor. There `amax_partials_2d` runs
instead: each program writes the maximum of its own tiles to one slot of an uninitialized
buffer, one slot per program, and the cast kernel that consumes the buffer reduces the slots
itself (fp8train.kernels.cast). A dynamic cast is then two launches and nothing to zero.
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
    def _max_of_tiles(
        hp_ptr, M, N, stride_hm, stride_hn, tiles_n, tiles, pid, programs,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """max |hp| over the tiles pid, pid + programs, ... (0 if none), NaN counted as inf."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for tile in range(pid, tiles, programs):
            tile_m = tile // tiles_n
            rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
            cols = (tile - tile_m * tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            mask = (rows < M) & (cols < N)
            offsets = rows.to(tl.int64) * stride_hm + cols.to(tl.int64) * stride_hn
            magnitude = tl.abs(tl.load(hp_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
            acc = tl.maximum(acc, tl.where(magnitude == magnitude, magnitude, float("inf")))
        return tl.max(tl.max(acc, axis=1), axis=0)

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
        tiles_max = _max_of_tiles(
            hp_ptr, M, N, stride_hm, stride_hn, tiles_n, tiles, pid, programs, BLOCK_M, BLOCK_N
        )
        # Non-negative floats order as their bit patterns do, which the atomic max relies on.
        tl.atomic_max(running_ptr, tiles_max)
        # acq_rel: the last program's increment sees every earlier program's atomic max.
        if tl.atomic_add(count_ptr, 1) == programs - 1:
            tl.store(out_ptr, tl.atomic_xchg(running_ptr, 0.0))
            tl.atomic_xchg(count_ptr, 0)

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
        # A program with no tile (more programs than tiles) writes 0, which no maximum misses.
        tl.store(
            partials_ptr + pid,
            _max_of_tiles(
                hp_ptr, M, N, stride_hm, stride_hn, tiles_n, tiles, pid, programs, BLOCK_M, BLOCK_N
            ),
        )


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
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """max |hp| in fp32 (0-d) for a 2-D CUDA tensor, written into `out` (0-d fp32) if given.
    `tile`: instead of TILE."""
    m, n = hp.shape
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=hp.device)
    if hp.numel() == 0:
        return out.zero_()
    device = torch.cuda.current_device()
    block_m, block_n, programs_per_sm, num_warps = tile or TILE
    tiles_n = cdiv(n, block_n)
    tiles = cdiv(m, block_m) * tiles_n
    running, count = _state(device)
    launch(
        _amax_kernel, (min(tiles, programs_per_sm * _multiprocessors(device)),),
        hp, out, running, count, m, n, hp.stride(0), hp.stride(1), tiles_n, tiles,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return out


def partials_count(device: torch.device, tile: tuple[int, int, int, int] | None = None) -> int:
    """The length of amax_partials_2d's output on `device`: one slot per program, a fixed
    number per device (whatever the tensor's shape, so that no compiled graph guards on it)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return (tile or TILE)[2] * _multiprocessors(index)


def amax_partials_2d(
    hp: torch.Tensor,
    *,
    traced: bool = False,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Partial maxima of |hp| for a 2-D CUDA tensor, in fp32: a 1-D tensor (partials_count
    long) whose maximum is amax_2d(hp), with a NaN anywhere giving inf as there; slots of
    programs that had no tile hold 0. One launch, nothing zeroed: what the cast kernel's
    `scale_from_amax` reduces itself. `traced`: the body of a triton op that torch.compile
    traces. `tile`: instead of TILE."""
    m, n = hp.shape
    programs = partials_count(hp.device, tile)
    partials = torch.empty(programs, dtype=torch.float32, device=hp.device)
    block_m, block_n, _, num_warps = tile or TILE
    tiles_n = cdiv(n, block_n)
    tiles = cdiv(m, block_m) * tiles_n
    (traced_launch if traced else launch)(
        _amax_partials_kernel, (programs,),
        hp, partials, m, n, hp.stride(0), hp.stride(1), tiles_n, tiles,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return partials
