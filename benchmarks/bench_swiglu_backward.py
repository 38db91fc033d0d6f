"""What SwiGLU's backward costs when it also writes its gradients' float8 casts, and what
layout of the work would approach the memory floor (a GPU diagnostic, not a library path).

    python -m benchmarks.bench_swiglu_backward [--tokens 8192] [--ffn-dim 14336]

In a compiled LLaMA block with one-pass delayed scaling, inductor fuses SwiGLU's backward
with the casts that the three FFN gemms need from it: w2's input `h = silu(gate) * up`
recast to e4m3 in the column-major layout of w2's weight gradient, and the two halves'
gradients `g1`, `g3` cast to e5m2 in both layouts, with their amaxes recorded for the next
step. On the H100 that kernel takes about twice bf16's SwiGLU backward
(`benchmarks/results/e2e_loop_h100_2026-12-06.md`), for the same bytes. This script writes
the same arithmetic as hand-written Triton kernels in a few layouts and times them on the
end-to-end model's shape:

- `bf16`: what bf16 training runs: `g1`, `g3` in bf16, no amax (10 bytes an element);
- `rows`: inductor's layout, one row per program, looping over the hidden dim, every
  column-major byte stored one row apart;
- `rows, row-major only`: the same with the three column-major stores made row-major
  (wrong layout, same bytes): what the strided stores cost;
- `rows, no amax`: the same without the two amaxes: what the reduction costs;
- `tiles`: 2-D tiles (rows x columns per program), each column-major store a tile whose
  bytes Triton can gather on chip, the amaxes as one atomic maximum per program.

Every float8 variant moves 11 bytes an element (three bf16 loads, five float8 stores); the
floor column is those bytes at the `copy` row's bandwidth. Each variant's bytes and amaxes
are checked against the `rows` kernel's before it is timed.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.utils import markdown_table, median_time_s, print_environment

try:
    import triton
    import triton.language as tl
except ImportError:  # the module's docstring and argument parsing stay importable
    triton = None


if triton is not None:

    @triton.jit
    def _swiglu_math(x, u, gh, s_h, s_1, s_3):
        silu = x / (1.0 + tl.exp(-x))
        sig = tl.sigmoid(x)
        h = silu * u
        g1 = (gh * u) * sig * (x * (1.0 - sig) + 1.0)
        g3 = gh * silu
        # Delayed scaling's inf-to-NaN add, as fp8train's inductor pass writes it.
        h8 = (h * s_h + h * 0.0).to(tl.float8e4nv)
        g18 = (g1 * s_1 + g1 * 0.0).to(tl.float8e5)
        g38 = (g3 * s_3 + g3 * 0.0).to(tl.float8e5)
        return h8, g1, g18, g3, g38

    @triton.jit
    def _abs_bits(v):
        return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def swiglu_bf16_kernel(gate, up, grad_h, g1_out, g3_out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(gate + offs, mask).to(tl.float32)
        u = tl.load(up + offs, mask).to(tl.float32)
        gh = tl.load(grad_h + offs, mask).to(tl.float32)
        sig = tl.sigmoid(x)
        silu = x / (1.0 + tl.exp(-x))
        g1 = (gh * u) * sig * (x * (1.0 - sig) + 1.0)
        tl.store(g1_out + offs, g1.to(tl.bfloat16), mask)
        tl.store(g3_out + offs, (gh * silu).to(tl.bfloat16), mask)

    @triton.jit
    def swiglu_rows_kernel(
        gate, up, grad_h, scales, h_col, g1_row, g1_col, g3_row, g3_col, amax1, amax3,
        M, F,
        BLOCK: tl.constexpr, COLUMN_MAJOR: tl.constexpr, AMAX: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        s_h, s_1, s_3 = tl.load(scales), tl.load(scales + 1), tl.load(scales + 2)
        a1 = tl.zeros([BLOCK], tl.int32)
        a3 = tl.zeros([BLOCK], tl.int32)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < F
            at = row * F + cols
            x = tl.load(gate + at, mask).to(tl.float32)
            u = tl.load(up + at, mask).to(tl.float32)
            gh = tl.load(grad_h + at, mask).to(tl.float32)
            h8, g1, g18, g3, g38 = _swiglu_math(x, u, gh, s_h, s_1, s_3)
            col_at = cols * M + row if COLUMN_MAJOR else at
            tl.store(h_col + col_at, h8, mask)
            tl.store(g1_row + at, g18, mask)
            tl.store(g1_col + col_at, g18, mask)
            tl.store(g3_row + at, g38, mask)
            tl.store(g3_col + col_at, g38, mask)
            if AMAX:
                a1 = tl.where(mask, tl.maximum(a1, _abs_bits(g1)), a1)
                a3 = tl.where(mask, tl.maximum(a3, _abs_bits(g3)), a3)
        if AMAX:
            tl.atomic_max(amax1, tl.max(a1, 0))
            tl.atomic_max(amax3, tl.max(a3, 0))

    @triton.jit
    def swiglu_tiles_kernel(
        gate, up, grad_h, scales, h_col, g1_row, g1_col, g3_row, g3_col, amax1, amax3,
        M, F,
        BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < F)
        at = rows[:, None] * F + cols[None, :]
        col_at = cols[None, :] * M + rows[:, None]
        s_h, s_1, s_3 = tl.load(scales), tl.load(scales + 1), tl.load(scales + 2)
        x = tl.load(gate + at, mask).to(tl.float32)
        u = tl.load(up + at, mask).to(tl.float32)
        gh = tl.load(grad_h + at, mask).to(tl.float32)
        h8, g1, g18, g3, g38 = _swiglu_math(x, u, gh, s_h, s_1, s_3)
        tl.store(g1_row + at, g18, mask)
        tl.store(g3_row + at, g38, mask)
        # The column-major tiles, transposed on chip so that each store runs along rows.
        tl.store(h_col + tl.trans(col_at), tl.trans(h8), tl.trans(mask))
        tl.store(g1_col + tl.trans(col_at), tl.trans(g18), tl.trans(mask))
        tl.store(g3_col + tl.trans(col_at), tl.trans(g38), tl.trans(mask))
        a1 = tl.max(tl.max(tl.where(mask, _abs_bits(g1), 0), 1), 0)
        a3 = tl.max(tl.max(tl.where(mask, _abs_bits(g3), 0), 1), 0)
        tl.atomic_max(amax1, a1)
        tl.atomic_max(amax3, a3)


ROWS = [(1024, 4), (1024, 8), (2048, 8), (4096, 8), (512, 4)]
"""(BLOCK, num_warps) configs of the row kernels; the fastest is reported."""
TILES = [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8)]
"""(BM, BN, num_warps) configs of the tile kernel."""


def _outputs(m: int, f: int, device: str) -> list[torch.Tensor]:
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    outs = [torch.empty(m * f, dtype=dt, device=device) for dt in (e4, e5, e5, e5, e5)]
    return [*outs, torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device)]  # fmt: skip


def main(args: argparse.Namespace) -> list[dict]:
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("bench_swiglu_backward times Triton kernels: it needs a CUDA GPU")
    print_environment()
    ptxas = os.environ.get("TRITON_PTXAS_PATH")
    print(f"- ptxas: {ptxas or 'the one Triton ships'} (TRITON_PTXAS_PATH)")
    m, f, device = args.tokens, args.ffn_dim, "cuda"
    torch.manual_seed(0)
    gate, up, grad_h = (torch.randn(m, f, device=device, dtype=torch.bfloat16) for _ in range(3))
    grad_h *= 1e-3
    scales = torch.tensor([64.0, 2.0**14, 2.0**16], device=device)
    n = m * f
    gbytes = n * 11 / 1e9

    copy_src = torch.empty(n * 11 // 2, dtype=torch.bfloat16, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_s = median_time_s(lambda: copy_dst.copy_(copy_src), device)
    bandwidth = 2 * copy_src.numel() * 2 / copy_s  # bytes read + written per second

    def rows_run(outs, block, warps, column_major=True, amax=True):  # noqa: ANN001, ANN202
        def run() -> None:
            swiglu_rows_kernel[(m,)](
                gate, up, grad_h, scales, *outs, m, f,
                BLOCK=block, COLUMN_MAJOR=column_major, AMAX=amax, num_warps=warps,
            )  # fmt: skip

        return run

    def tiles_run(outs, bm, bn, warps):  # noqa: ANN001, ANN202
        def run() -> None:
            grid = (triton.cdiv(m, bm), triton.cdiv(f, bn))
            swiglu_tiles_kernel[grid](
                gate, up, grad_h, scales, *outs, m, f, BM=bm, BN=bn, num_warps=warps
            )

        return run

    reference = _outputs(m, f, device)
    rows_run(reference, *ROWS[0])()

    def check(outs: list[torch.Tensor], name: str, amax: bool = True) -> int:
        """Bytes that differ: each column-major copy against its row-major twin transposed,
        and h's copy and the amaxes against the first rows kernel's."""
        as_bytes = [out.view(torch.uint8) for out in outs]
        pairs = [(as_bytes[2].view(f, m), as_bytes[1].view(m, f).t()),
                 (as_bytes[4].view(f, m), as_bytes[3].view(m, f).t()),
                 (as_bytes[0], reference[0].view(torch.uint8))]  # fmt: skip
        if amax:
            pairs += [(outs[5], reference[5]), (outs[6], reference[6])]
        differ = [int((got != want).sum()) for got, want in pairs]
        if any(differ):
            print(f"{name}: bytes that differ (g1 column-major vs row-major, g3 likewise, h, "
                  f"amaxes): {differ}")  # fmt: skip
        return sum(differ)

    rows = [{"variant": "copy (bandwidth)", "configs with wrong bytes": "-", "config": "",
             "ms": copy_s * 1e3,
             "GB/s": bandwidth / 1e9, "floor ms": ""}]  # fmt: skip

    def best(name: str, runs: dict, amax: bool = True, check_layout: bool = True) -> None:
        results, wrong = [], 0
        for config, (outs, run) in runs.items():
            for out in outs[5:]:
                out.zero_()
            run()
            if check_layout:
                wrong += check(outs, f"{name} {config}", amax) > 0
            results.append((median_time_s(run, device), config))
        seconds, config = min(results)
        rows.append({"variant": name, "configs with wrong bytes": wrong if check_layout else "-",
                     "config": config, "ms": seconds * 1e3,
                     "GB/s": gbytes / seconds, "floor ms": gbytes * 1e12 / bandwidth})  # fmt: skip

    outs = _outputs(m, f, device)
    best("rows", {f"BLOCK={b}, warps={w}": (outs, rows_run(outs, b, w)) for b, w in ROWS})
    best("rows, row-major only", {
        f"BLOCK={b}, warps={w}": (outs, rows_run(outs, b, w, column_major=False))
        for b, w in ROWS}, check_layout=False)  # fmt: skip
    best("rows, no amax", {
        f"BLOCK={b}, warps={w}": (outs, rows_run(outs, b, w, amax=False)) for b, w in ROWS
    }, amax=False)  # fmt: skip
    best("tiles", {
        f"{bm}x{bn}, warps={w}": (outs, tiles_run(outs, bm, bn, w)) for bm, bn, w in TILES
    })  # fmt: skip
    g1, g3 = torch.empty_like(gate), torch.empty_like(gate)
    bf16 = median_time_s(lambda: swiglu_bf16_kernel[(triton.cdiv(n, 1024),)](
        gate, up, grad_h, g1, g3, n, BLOCK=1024, num_warps=4), device)  # fmt: skip
    rows.append({"variant": "bf16 (10 bytes an element)", "configs with wrong bytes": "-",
                 "config": "BLOCK=1024, warps=4",
                 "ms": bf16 * 1e3, "GB/s": n * 10 / bf16 / 1e9,
                 "floor ms": n * 10 / bandwidth * 1e3})  # fmt: skip
    print(f"\nSwiGLU backward with its float8 casts, {m} x {f} (bf16 in; {gbytes:.2f} GB moved)")
    print(markdown_table(rows))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ffn-dim", type=int, default=14336)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
