"""SQNR of Float8Linear's three gemms against an fp32 reference, on the real scaled gemm
(cuBLAS on CUDA) and in emulation.

    python benchmarks/check_numerics.py [--device cuda] [--fast-accum] [--csv out.csv]

For each granularity, high-precision dtype and shape it runs fwd+bwd of one layer and prints
the SQNR in dB (higher is better; 20 dB = 10% error) of output, grad_input and grad_weight
against nn.Linear in fp32, and of the real gemm against emulation of the same float8 bytes.
--fast-accum adds the same rows with Hopper's fast accumulation in the grad_input and
grad_weight gemms too (the output gemm has it in both), column `backward accum`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
from torch import nn

from benchmarks.utils import markdown_table, print_environment, write_csv
from fp8train import (
    CastConfig,
    Float8GemmConfig,
    Float8Linear,
    Float8LinearConfig,
    compute_error,
)

# (tokens, in_features, out_features): LLaMA-70B-like layers scaled to a quick check, plus a
# misaligned shape that goes through padding.
SHAPES = [(4096, 8192, 1280), (4096, 1024, 8192), (4096, 3584, 8192), (1000, 1000, 1000)]


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return [out, x.grad, layer.weight.grad]


def run(device: str, fast_accum: bool = False) -> list[dict]:
    rows = []
    for granularity in ("tensorwise", "rowwise"):
        cast = CastConfig(scaling_granularity=granularity)
        for hp_dtype in (torch.bfloat16, torch.float16, torch.float32):
            for tokens, k, n in SHAPES:
                reference = nn.Linear(k, n, bias=False, device=device)
                x = torch.randn(tokens, k, device=device)
                grad = torch.randn(tokens, n, device=device)
                ref = fwd_bwd(reference, x, grad)
                for fast_backward in (False, True) if fast_accum else (False,):
                    row = {
                        "granularity": granularity,
                        "hp_dtype": str(hp_dtype).removeprefix("torch."),
                        "M,K,N": f"{tokens},{k},{n}",
                    }
                    if fast_accum:
                        row["backward accum"] = "fast" if fast_backward else "exact"
                    backward_gemm = Float8GemmConfig(use_fast_accum=fast_backward)
                    config = Float8LinearConfig(
                        cast_config_input=cast,
                        cast_config_weight=cast,
                        cast_config_grad_output=cast,
                        gemm_config_grad_input=backward_gemm,
                        gemm_config_grad_weight=backward_gemm,
                        pad_inner_dim=True,
                    )
                    rows.append(compare(reference, ref, x, grad, hp_dtype, config, row))
    return rows


def compare(
    reference: nn.Linear,
    ref: list[torch.Tensor],
    x: torch.Tensor,
    grad: torch.Tensor,
    hp_dtype: torch.dtype,
    config: Float8LinearConfig,
    row: dict,
) -> dict:
    """`row` with the SQNR of the layer's three results under `config` against `ref`, and of
    the real gemm against emulation, or the error of a gemm this GPU or torch cannot run."""
    results = {}
    for emulate in (False, True):
        layer = Float8Linear.from_float(
            copy.deepcopy(reference).to(hp_dtype), dataclasses.replace(config, emulate=emulate)
        )
        try:
            results[emulate] = fwd_bwd(layer, x.to(hp_dtype), grad.to(hp_dtype))
        except RuntimeError as error:  # a gemm this GPU or torch cannot run
            row["error"] = str(error).splitlines()[0][:120]
            return row
    real, emulated = results[False], results[True]
    for name, r, a, e in zip(
        ("output", "grad_input", "grad_weight"), ref, real, emulated, strict=True
    ):
        row[f"{name} dB"] = compute_error(r, a).item()
        row[f"{name} vs emulation dB"] = compute_error(e, a).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--fast-accum",
        action="store_true",
        help="also run every case with fast accumulation in the backward gemms",
    )
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()
    torch.manual_seed(0)
    print_environment()
    rows = run(args.device, args.fast_accum)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(markdown_table(rows, columns))
    if args.csv:
        write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
