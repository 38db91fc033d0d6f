"""The floor under bench_linear: the three gemms of a linear layer's fwd+bwd alone, float8
(torch._scaled_mm on operands cast beforehand, in the layouts the gemms need) against the
same three gemms in bf16.

    python -m benchmarks.bench_matmul [--shape M K N ...] [--csv out.csv]

    output      (M, K) x (K, N)     grad_input  (M, N) x (N, K)     grad_weight  (N, M) x (M, K)

fp8 uses tensorwise scales, e4m3 operands and an e5m2 grad_output, fast accumulation for the
output gemm only, as Float8Linear does by default; the fast_accum_* columns time the same
gemms with fast accumulation in all three (Float8GemmConfig(use_fast_accum=True) for
grad_input and grad_weight too). Where torch's block-scaled gemm runs (sm90, CUDA >= 12.9), the
blockwise recipe's three gemms are timed too (blockwise_* columns). pct_fp8_peak:
6*M*K*N FLOPs over the float8 time as a share of --fp8-peak-tflops (default 1979 on H100/H200).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_linear import LLAMA_70B_SHAPES
from benchmarks.utils import (
    fp8_peak_tflops,
    markdown_table,
    median_time_s,
    print_environment,
    write_csv,
)
from fp8train import Float8LinearConfig, to_float8
from fp8train.cast import cast_for_gemm
from fp8train.config import BLOCK, E4M3, E5M2, Gemm, Role
from fp8train.gemm import block_scaled_gemm_runs, scaled_mm


def three_gemms(m: int, k: int, n: int, device: str, hp_dtype: torch.dtype) -> dict[str, float]:
    x = torch.randn(m, k, device=device, dtype=hp_dtype)
    w = torch.randn(n, k, device=device, dtype=hp_dtype)
    g = torch.randn(m, n, device=device, dtype=hp_dtype)

    def hp() -> None:
        x @ w.t()
        g @ w
        g.t() @ x

    x8, w8 = to_float8(x, E4M3), to_float8(w, E4M3)
    w8_cm = to_float8(w, E4M3, column_major=True)  # (N, K) column-major: b of grad_input
    g8, g8_cm = to_float8(g, E5M2), to_float8(g, E5M2, column_major=True)
    x8_cm = to_float8(x, E4M3, column_major=True)
    one = torch.ones((), device=device)

    def fp8(fast_backward: bool = False) -> None:
        torch._scaled_mm(x8._data, w8._data.t(), one, one, out_dtype=hp_dtype, use_fast_accum=True)
        torch._scaled_mm(
            g8._data, w8_cm._data, one, one, out_dtype=hp_dtype, use_fast_accum=fast_backward
        )
        torch._scaled_mm(
            g8_cm._data.t(), x8_cm._data, one, one, out_dtype=hp_dtype, use_fast_accum=fast_backward
        )

    times = {
        "hp": median_time_s(hp, device),
        "fp8": median_time_s(fp8, device),
        "fast_accum": median_time_s(lambda: fp8(fast_backward=True), device),
    }
    blockwise = blockwise_gemms(x, w, g)
    if blockwise is not None:
        times["blockwise"] = median_time_s(blockwise, device)
    return times


def blockwise_gemms(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):  # noqa: ANN201
    """The blockwise recipe's three gemms on operands cast as Float8Linear casts them, or None
    where they would be emulated (no block-scaled gemm: CPU, not sm90, CUDA < 12.9) or the
    shape is not in whole blocks."""
    config = Float8LinearConfig.from_recipe_name("blockwise")
    if any(size % BLOCK for size in (*x.shape, w.shape[0])):
        return None
    x_out = cast_for_gemm(x, Role.INPUT, Gemm.OUTPUT, config)
    w_out = cast_for_gemm(w, Role.WEIGHT, Gemm.OUTPUT, config)
    g_in = cast_for_gemm(g, Role.GRAD_OUTPUT, Gemm.GRAD_INPUT, config)
    w_in = cast_for_gemm(w, Role.WEIGHT, Gemm.GRAD_INPUT, config)
    g_w = cast_for_gemm(g, Role.GRAD_OUTPUT, Gemm.GRAD_WEIGHT, config).t()
    x_w = cast_for_gemm(x, Role.INPUT, Gemm.GRAD_WEIGHT, config)
    operands = ((x_out, w_out.t()), (g_in, w_in), (g_w, x_w))
    if not all(block_scaled_gemm_runs(a, b, x.dtype) for a, b in operands):
        return None

    def run() -> None:
        for a, b in operands:
            scaled_mm(a, b, out_dtype=x.dtype)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("M", "K", "N"))
    parser.add_argument("--fp8-peak-tflops", type=float, default=None)
    parser.add_argument("--csv")
    args = parser.parse_args()
    hp_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes = (
        {f"custom{i}": tuple(s) for i, s in enumerate(args.shape)}
        if args.shape
        else LLAMA_70B_SHAPES
    )
    peak = fp8_peak_tflops(args.device, args.fp8_peak_tflops)
    print_environment()
    rows = []
    for name, (m, k, n) in shapes.items():
        runs = [three_gemms(m, k, n, args.device, hp_dtype) for _ in range(3)]
        t = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        flops = 6 * m * k * n
        rows.append(
            {
                "name": name,
                "shape": f"({m}, {k}, {n})",
                "hp_dtype": str(hp_dtype).removeprefix("torch."),
                "hp_time_sec": t["hp"],
                "fp8_time_sec": t["fp8"],
                "fp8_speedup": t["hp"] / t["fp8"],
                "hp_tflops": flops / t["hp"] / 1e12,
                "fp8_tflops": flops / t["fp8"] / 1e12,
                "pct_fp8_peak": 100 * flops / t["fp8"] / (peak * 1e12) if peak else None,
                "fast_accum_time_sec": t["fast_accum"],
                "fast_accum_speedup": t["hp"] / t["fast_accum"],
            }
        )
        if "blockwise" in t:  # torch's block-scaled gemm (sm90): the blockwise recipe's floor
            rows[-1]["blockwise_time_sec"] = t["blockwise"]
            rows[-1]["blockwise_speedup"] = t["hp"] / t["blockwise"]
    print(markdown_table(rows, list(dict.fromkeys(key for row in rows for key in row))))
    print(
        f"\ngeometric mean fp8_speedup: "
        f"{statistics.geometric_mean(r['fp8_speedup'] for r in rows):.3f}x; "
        f"with fast accumulation in all three gemms "
        f"{statistics.geometric_mean(r['fast_accum_speedup'] for r in rows):.3f}x"
    )
    if args.csv:
        write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
