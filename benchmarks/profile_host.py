"""Host time of one float8 layer's fwd+bwd, and where it goes (cProfile).

    python -m benchmarks.profile_host                      # 256x256x256 bf16 on the GPU
    python -m benchmarks.profile_host --shape 2048 1024 1024 --top 30
    python -m benchmarks.profile_host --device cpu --dtype float32   # the CPU path
    python -m benchmarks.profile_host --compile                      # both layers compiled
    python -m benchmarks.profile_host --compile --compiled-cast-kernels weight grad_output
    python -m benchmarks.profile_host --autograd-threads on off      # where backward runs

On a tiny shape the GPU work is negligible, so the time per step is the host's: Python,
autograd, allocations and kernel launches. A diagnostic, not a benchmark table.

Three layers are timed: nn.Linear, the same matmuls in high precision through a Python
`torch.autograd.Function` (what any layer written as one costs the host: the autograd
engine's call into Python for backward, which on a GPU runs on the engine's device thread),
and Float8Linear, whose three gemms run in such a Function. The middle row is the floor under
Float8Linear that fp8train's own code does not set. In eager mode a fourth row times the same
Float8Linear held to the general path (fp8train.matmul), where the float8 row takes the eager
fast path (fp8train.eager: CUDA, dynamic tensorwise): the fast path's gain on this host, in
the same process. `--autograd-threads` times the rows with
torch's multithreaded backward on (its default: CUDA backward on the engine's thread), off
(backward on the calling thread), or both in turn; on some GPU hosts float8's backward costs
twice the host time on the engine's thread (benchmarks/results/host_threads_h100_2026-12-07.md).
The profile is taken with the first setting.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys

import torch
from torch import nn

from benchmarks.utils import general_path
from fp8train import Float8Linear, Float8LinearConfig
from fp8train.filters import host_seconds_per_step


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def host_us_per_step(layer: nn.Module, x: torch.Tensor, steps: int) -> float:
    """Wall-clock microseconds per fwd+bwd, after a warm-up: the timing the auto filter's
    CostModel.measure_host makes."""
    return host_seconds_per_step(layer, x, steps) * 1e6


class _HighPrecisionMatmul(torch.autograd.Function):
    """`input @ weight.T` and its two gradient gemms, in high precision, as Python."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: torch.autograd.function.FunctionCtx, input: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        return input @ weight.t()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # noqa: ANN001, ANN205, D102
        input, weight = ctx.saved_tensors
        return grad_output @ weight, grad_output.t() @ input


class PythonFunctionLinear(nn.Module):
    """A bias-free linear layer whose matmuls run in `_HighPrecisionMatmul`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _HighPrecisionMatmul.apply(input, self.weight)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs=3, type=int, default=[256, 256, 256], metavar="MKN")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=40, help="rows of the profile to print")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile(fullgraph=True) both layers"
    )
    parser.add_argument(
        "--compiled-cast-kernels",
        nargs="*",
        metavar="ROLE",
        help="with --compile: Float8LinearConfig.compiled_cast_kernels, every role if none is "
        "named (input, weight, grad_output)",
    )
    parser.add_argument(
        "--autograd-threads",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="torch.autograd.set_multithreading_enabled for the timed rows, each setting in "
        "turn (on: torch's default)",
    )
    args = parser.parse_args(argv)
    m, k, n = args.shape
    dtype = getattr(torch, args.dtype)
    base = nn.Linear(k, n, bias=False, device=args.device, dtype=dtype)
    kernels = args.compiled_cast_kernels
    config = Float8LinearConfig(
        compiled_cast_kernels=False if kernels is None else (kernels or True)
    )
    function = PythonFunctionLinear(copy.deepcopy(base))
    fp8 = Float8Linear.from_float(copy.deepcopy(base), config)
    if args.compile:
        base, function, fp8 = (
            torch.compile(layer, fullgraph=True) for layer in (base, function, fp8)
        )
    x = torch.randn(m, k, device=args.device, dtype=dtype, requires_grad=True)
    layers = [(args.dtype, base), (f"{args.dtype} autograd.Function", function), ("float8", fp8)]
    if not args.compile:
        layers.append(("float8 (general path)", general_path(fp8)))
    for threads in args.autograd_threads:
        print(f"autograd threads {threads}:")
        with torch.autograd.set_multithreading_enabled(threads == "on"):
            for name, layer in layers:
                print(f"{name}: {host_us_per_step(layer, x, args.steps):.1f} us per fwd+bwd")
    threads = args.autograd_threads[0]
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(threads == "on"):
        profiler.enable()
        for _ in range(args.steps):
            fp8(x).sum().backward()
        _sync(args.device)
        profiler.disable()
    print(f"\nfloat8, {args.steps} steps under cProfile, autograd threads {threads}:")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
