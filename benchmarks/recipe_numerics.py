"""SQNR against fp32 of every recipe, on LLaMA-shaped layers whose input has outlier channels.

    python -m benchmarks.recipe_numerics [--tokens 4096] [--outlier 1e4] [--device cuda]

The input is a LLaMA-like activation: per-token magnitudes spread over two decades and a few
channels --outlier times larger than the rest (LLM activations grow such channels). For each
recipe and layer it runs one fwd+bwd of Float8Linear and nn.Linear in fp32 from the same
weights and prints the SQNR in dB of output, grad_input and grad_weight, and of the input's
float8 cast on the channels that are not outliers (what outliers cost the other values).
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from benchmarks.utils import markdown_table, print_environment, write_csv
from fp8train import Float8Linear, Float8LinearConfig, Float8LinearRecipeName, compute_error
from fp8train.cast import cast_for_gemm
from fp8train.config import Gemm, Role

# LLaMA-70B layers (K, N), the shapes of the per-layer benchmark users compare.
LAYERS = {
    "attn.wqkv": (8192, 1280),
    "attn.w0": (1024, 8192),
    "ffn.w13": (8192, 7168),
    "ffn.w2": (3584, 8192),
}
OUTLIER_CHANNELS = 4


def activation(tokens: int, features: int, outlier: float, device: str) -> torch.Tensor:
    rows = torch.logspace(-2, 0, tokens, device=device)[torch.randperm(tokens, device=device)]
    x = torch.randn(tokens, features, device=device) * rows[:, None]
    x[:, torch.randperm(features, device=device)[:OUTLIER_CHANNELS]] *= outlier
    return x


def run(tokens: int, outlier: float, device: str, hp_dtype: torch.dtype) -> list[dict]:
    rows = []
    for layer_name, (k, n) in LAYERS.items():
        torch.manual_seed(0)
        reference = nn.Linear(k, n, bias=False, device=device)
        x = activation(tokens, k, outlier, device)
        grad = torch.randn(tokens, n, device=device)
        normal = x.abs().amax(0) < outlier / 10  # the channels without outliers
        expected = _fwd_bwd(reference, x, grad)
        for recipe in Float8LinearRecipeName:
            config = Float8LinearConfig.from_recipe_name(recipe)
            layer = Float8Linear.from_float(copy.deepcopy(reference).to(hp_dtype), config)
            actual = _fwd_bwd(layer, x.to(hp_dtype), grad.to(hp_dtype))
            cast = cast_for_gemm(x.to(hp_dtype), Role.INPUT, Gemm.OUTPUT, config)
            back = cast.to_hp(torch.float32)
            row = {"recipe": recipe.value, "layer": layer_name, "M,K,N": f"{tokens},{k},{n}"}
            for name, e, a in zip(
                ("output", "grad_input", "grad_weight"), expected, actual, strict=True
            ):
                row[f"{name} dB"] = compute_error(e, a.float()).item()
            row["input cast, other channels dB"] = compute_error(
                x[:, normal], back[:, normal]
            ).item()
            rows.append(row)
    return rows


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return [out.detach(), x.grad, layer.weight.grad]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096, help="M (default %(default)s)")
    parser.add_argument(
        "--outlier", type=float, default=1e4, help="outlier channel factor (default %(default)g)"
    )
    parser.add_argument(
        "--hp-dtype",
        choices=["bfloat16", "float32"],
        help="default: bfloat16 on CUDA, float32 on the CPU (where bf16 matmul is slow)",
    )
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()
    hp_name = args.hp_dtype or ("bfloat16" if args.device == "cuda" else "float32")
    print_environment()
    print(f"- input: outlier channels x{args.outlier:g}, hp dtype {hp_name}\n")
    rows = run(args.tokens, args.outlier, args.device, getattr(torch, hp_name))
    print(markdown_table(rows))
    if args.csv:
        write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
