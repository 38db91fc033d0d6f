"""The casts alone: a dynamic tensorwise cast of one activation (amax, scale, float8 bytes in
both layouts the gemms need), against the memory-bandwidth floor of a device copy.

    python -m benchmarks.bench_cast [--shape M N ...] [--tiles] [--csv out.csv]
    python -m fp8train bench-cast ...                  (the same, from a checkout)

The tensors are the large operands of bench_linear's LLaMA-70B shapes: each input (M, K) and
grad_output (M, N), bf16. A cast in both layouts must move 6 bytes an element at least: the
amax reads the tensor (2), the cast reads it again (2) and writes each layout (1 + 1). Each
row is checked against the torch path, byte for byte, before it is timed.

Rows:
- copy: `dst.copy_(hp)`, 4 bytes an element, the ceiling every other row is a share of;
- eager kernels: what eager Float8Linear runs, and the compiled cast-kernel casts outside
  torch.compile (the amax kernel writing one maximum per program, then one cast kernel that
  reduces them and writes both layouts); `amax kernel` and `cast kernel` time the two apart
  (the cast from a given 0-d amax);
- compiled inductor: `torch.compile` of the torch path (what compiled layers run by default);
  `amax per row first`: the same with the amax reduced per row, then over the rows;
- compiled cast-kernels: `torch.compile` with the casts as fp8train's triton ops
  (Float8LinearConfig(compiled_cast_kernels=True));
- with --tiles: the amax and cast kernels over other tile shapes (fp8train.kernels TILE).
"""

from __future__ import annotations

import argparse

import torch

import fp8train.kernels.amax as amax_kernel
import fp8train.kernels.cast as cast_kernel
from benchmarks.bench_linear import LLAMA_70B_SHAPES
from benchmarks.utils import markdown_table, median_time_s, print_environment, write_csv
from fp8train.cast import _column_major, _saturated_cast, cast_layouts
from fp8train.config import E4M3, ScalingGranularity
from fp8train.kernels import amax_partials_2d, cast_2d
from fp8train.scaling import amax, amax_to_scale

TENSORWISE = ScalingGranularity.TENSORWISE
# (BLOCK_M, BLOCK_N, num_warps) of the cast kernel; (BLOCK_M, BLOCK_N, programs per SM,
# num_warps) of the amax kernel.
CAST_TILES = [
    (16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 64, 4), (64, 128, 4), (64, 128, 8),
    (128, 32, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8),
]  # fmt: skip
AMAX_TILES = [(64, 128, 4, 8), (32, 256, 4, 8), (64, 256, 2, 8), (128, 128, 2, 8), (64, 128, 8, 4)]


def default_tensors() -> dict[str, tuple[int, int]]:
    tensors = {}
    for name, (m, k, n) in LLAMA_70B_SHAPES.items():
        tensors.setdefault((m, k), f"{name} input")
        tensors.setdefault((m, n), f"{name} grad_output")
    return {label: shape for shape, label in tensors.items()}


def reference(hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax_to_scale(amax(hp, TENSORWISE, None), E4M3)
    return scale, _saturated_cast(hp, scale, E4M3)


def compiled_cast(kernels: bool):  # noqa: ANN201
    def cast(hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row, col = cast_layouts(hp, E4M3, TENSORWISE, (False, True), compiled_kernels=kernels)
        return row._scale, row._data, col._data

    # Static shapes, as a compiled layer has them: after a second shape dynamo would
    # otherwise compile a dynamic kernel, which inductor splits in two (the cast, then a
    # transposed copy of its float8 bytes).
    return torch.compile(cast, fullgraph=True, dynamic=False)


def compiled_row_amax_cast():  # noqa: ANN201
    """The torch path's cast with its amax taken per row first, then over the rows: the same
    value (a maximum is exact in any order), as a reduction shape inductor may read faster than
    one reduction of the whole tensor to a scalar."""

    def cast(hp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hp_amax = torch.linalg.vector_norm(hp, float("inf"), dim=1, dtype=torch.float32).amax()
        scale = amax_to_scale(hp_amax, E4M3)
        data = _saturated_cast(hp, scale, E4M3)
        return scale, data, _column_major(data)

    return torch.compile(cast, fullgraph=True, dynamic=False)


def check(name: str, out: tuple, want_scale: torch.Tensor, want: torch.Tensor) -> bool:
    """True if `out` = (scale, row-major or None, column-major or None) is the torch path's."""
    scale, row, col = out
    ok = torch.equal(scale, want_scale)
    for data, column_major in ((row, False), (col, True)):
        if data is None:
            continue
        ok &= (data.t() if column_major else data).is_contiguous()
        ok &= torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    if not ok:
        print(f"!! {name}: bytes or scale differ from the torch path")
    return bool(ok)


def bench_tensor(label: str, m: int, n: int, tiles: bool) -> list[dict]:
    # Each compiled variant compiles once per shape: without a reset, dynamo's recompile
    # limit (8 graphs per function) is reached by the fifth tensor.
    torch._dynamo.reset()
    torch.manual_seed(0)
    hp = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3
    want_scale, want = reference(hp)
    dst = torch.empty_like(hp)
    hp_amax = amax(hp, TENSORWISE, None)
    rows: list[dict] = []

    def row(variant: str, fn, bytes_per_element: int, ok: bool | None, tile=None) -> None:  # noqa: ANN001
        """`tile`: (kernel, tile) of a row that times one kernel alone, for fastest_tile."""
        seconds = median_time_s(fn, "cuda")
        rows.append(
            {
                "tensor": label,
                "shape": f"({m}, {n})",
                "variant": variant,
                "time_us": seconds * 1e6,
                "bytes_per_element": bytes_per_element,
                "GBps": bytes_per_element * m * n / seconds / 1e9,
                "bitwise_ok": ok,
                "tile": tile,
            }
        )

    def eager(amax_tile=None, cast_tile=None, row_major=True, column_major=True):  # noqa: ANN001, ANN202
        def run() -> tuple:
            found = amax_partials_2d(hp, tile=amax_tile)
            return cast_2d(
                hp, found, E4M3, row_major=row_major, column_major=column_major,
                scale_from_amax=True, tile=cast_tile,
            )  # fmt: skip

        return run

    def cast_only(tile=None):  # noqa: ANN001, ANN202
        return lambda: cast_2d(
            hp, hp_amax, E4M3, column_major=True, scale_from_amax=True, tile=tile
        )

    row("copy", lambda: dst.copy_(hp), 4, None)
    run = eager()
    row("eager kernels, both layouts", run, 6, check("eager", run(), want_scale, want))
    run = eager(column_major=False)
    row("eager kernels, row-major only", run, 5, check("eager row", run(), want_scale, want))
    row("amax kernel", lambda: amax_partials_2d(hp), 2,
        torch.equal(amax_partials_2d(hp).max(), hp_amax), ("amax", amax_kernel.TILE))  # fmt: skip
    run = cast_only()
    row("cast kernel, both layouts", run, 4, check("cast", run(), want_scale, want),
        ("cast", cast_kernel.TILE))  # fmt: skip
    for kernels in (False, True):
        run = compiled_cast(kernels)
        out = run(hp)
        name = "compiled " + ("cast-kernels" if kernels else "inductor")
        row(name, lambda run=run: run(hp), 6, check(name, out, want_scale, want))
    run = compiled_row_amax_cast()
    name = "compiled inductor, amax per row first"
    row(name, lambda: run(hp), 6, check(name, run(hp), want_scale, want))
    if tiles:
        for tile in AMAX_TILES:
            if tile == amax_kernel.TILE:
                continue
            ok = torch.equal(amax_partials_2d(hp, tile=tile).max(), hp_amax)
            row(f"amax kernel {tile}", lambda t=tile: amax_partials_2d(hp, tile=t), 2, ok,
                ("amax", tile))  # fmt: skip
        for tile in CAST_TILES:
            if tile == cast_kernel.TILE:
                continue
            run = cast_only(tile)
            name = f"cast kernel {tile}"
            row(name, run, 4, check(name, run(), want_scale, want), ("cast", tile))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", nargs=2, type=int, action="append", metavar=("M", "N"))
    parser.add_argument("--tiles", action="store_true", help="time other tile shapes too")
    parser.add_argument("--csv")


def main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_cast times the CUDA kernels: run it on a GPU")
    tensors = (
        {f"custom{i}": tuple(s) for i, s in enumerate(args.shape)}
        if args.shape
        else default_tensors()
    )
    print_environment()
    print(f"- cast kernel TILE {cast_kernel.TILE}, amax kernel TILE {amax_kernel.TILE}\n")
    rows = []
    for label, (m, n) in tensors.items():
        found = bench_tensor(label, m, n, args.tiles)
        copy_gbps = found[0]["GBps"]
        for r in found:
            r["pct_of_copy"] = 100 * r["GBps"] / copy_gbps
        rows += found
        print(markdown_table(found), "\n", flush=True)
    if args.csv:
        write_csv(rows, args.csv)
    if args.tiles:
        for kind, default in (("cast", cast_kernel.TILE), ("amax", amax_kernel.TILE)):
            tile, seconds = fastest_tile(rows, kind)
            print(f"fastest {kind} tile over these tensors: {' '.join(map(str, tile))} "
                  f"({seconds * 1e6:.0f} us in all; the default {default})")  # fmt: skip


def fastest_tile(rows: list[dict], kind: str) -> tuple[tuple, float]:
    """The tile of `kind` ('cast' or 'amax') whose rows take the least time over every tensor,
    and that time; rows of a tile that failed the byte check do not count."""
    totals: dict[tuple, float] = {}
    failed = set()
    for row in rows:
        if row.get("tile") is None or row["tile"][0] != kind:
            continue
        tile = row["tile"][1]
        totals[tile] = totals.get(tile, 0.0) + row["time_us"] / 1e6
        if row["bitwise_ok"] is False:
            failed.add(tile)
    return min(((t, s) for t, s in totals.items() if t not in failed), key=lambda ts: ts[1])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
