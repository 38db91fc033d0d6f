"""Do a compiled block's float8 casts write the same bytes in both layouts? A GPU check.

    python -m benchmarks.check_layouts                       # the e2e model's block, on CUDA
    python -m benchmarks.check_layouts --device cpu --dim 256 --heads 2 --ffn-dim 704 --tokens 256
    python -m benchmarks.check_layouts --inductor coordinate_descent_tuning=True
    python -m benchmarks.check_layouts --json triton.json
    TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas \\
        python -m benchmarks.check_layouts --against triton.json

Under torch.compile, inductor writes a cast's row-major and column-major float8 bytes from one
kernel. With `compiled_transpose_kernels=True` each of those kernels writes the row-major
bytes only and fp8train's transpose kernel copies them: the same bytes by construction, from
kernels that never store one value in both layouts. So a compiled LLaMA-style block, run
forward and backward a few steps from the same weights and inputs, must give bitwise the
same output, input gradient and weight gradients either way; a difference means that a
kernel wrote a layout wrong. That is what ptxas 12.8/12.9 does to some of those kernels on
sm_90 (fp8train.toolchain, benchmarks/sass_hazards.py); their bytes go into the grad_weight
gemm, so the weight gradients show it. Prints, per config and step, how many elements of each
tensor differ (none: the check passes). Delayed configs are synced after every step, as in
training; no optimizer step, so every step sees the same weights. `--json` and `--against`
compare the bytes with another process's, run with another ptxas (TRITON_PTXAS_PATH): what
each kernel wrote, against a compiler that writes it right.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from benchmarks.saved_by_block import CONFIGS, block_and_inputs, configured
from benchmarks.utils import environment, inductor_options, markdown_table, print_environment
from fp8train import sync_float8_amax_and_scale_history
from fp8train.delayed import delayed_roles
from fp8train.models import ModelArgs


def run_steps(
    block: torch.nn.Module, inputs: tuple[torch.Tensor, ...], steps: int, delayed: bool
) -> list[dict[str, torch.Tensor]]:
    """Forward and backward `steps` times (seeded inputs and output gradients): per step the
    output, the input's gradient and every parameter's gradient."""
    compiled = torch.compile(block, fullgraph=True)
    x, cos, sin = inputs
    results = []
    for step in range(steps):
        generator = torch.Generator(x.device).manual_seed(step)
        x_step = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        x_step.requires_grad_(True)
        out = compiled(x_step, cos, sin)
        grad = torch.randn(out.shape, generator=generator, device=x.device, dtype=out.dtype)
        out.backward(grad)
        found = {"output": out.detach(), "input grad": x_step.grad}
        for name, param in block.named_parameters():
            found[f"{name} grad"] = param.grad
            param.grad = None
        if delayed:
            sync_float8_amax_and_scale_history(block)
        results.append(found)
    return results


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of `a` and `b` differ in their bits (NaN equal to the same NaN)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def digest(tensor: torch.Tensor) -> str:
    """A tensor's bytes as a short hash, to compare runs of other processes (another ptxas)."""
    data = tensor.detach().contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def check(name: str, base: torch.nn.Module, inputs: tuple, steps: int, digests: dict) -> list[dict]:
    """Rows of the tensors that differ between `name` without and with
    compiled_transpose_kernels (and each step's output); every tensor's digest into
    `digests`, keyed "config/variant/step/tensor"."""
    config = dataclasses.replace(CONFIGS[name], compiled_transpose_kernels=False)
    transposed = dataclasses.replace(config, compiled_transpose_kernels=True)
    delayed = bool(delayed_roles(config))
    runs = []
    for variant, variant_config in (("one kernel", config), ("transpose", transposed)):
        torch._dynamo.reset()
        block = configured(base, name, variant_config)
        runs.append(run_steps(block, inputs, steps, delayed))
        for step, found in enumerate(runs[-1]):
            for tensor, value in found.items():
                digests[f"{name}/{variant}/{step}/{tensor}"] = digest(value)
    rows = []
    for step, (one, other) in enumerate(zip(*runs, strict=True)):
        for tensor in one:
            count = differing(one[tensor], other[tensor])
            if count or tensor == "output":
                rows.append(
                    {
                        "config": name,
                        "step": step,
                        "tensor": tensor,
                        "elements differing": count,
                        "fraction": count / one[tensor].numel(),
                    }
                )
    return rows


def main(args: argparse.Namespace) -> list[dict]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "check_layouts checks Triton's compiled kernels on a CUDA GPU; --device cpu runs "
            "the same comparison of inductor's C++ (a check of the harness: "
            "benchmarks/sass_hazards.py reads the GPU's code offline)"
        )
    with torch._inductor.config.patch(inductor_options(args.inductor)):
        return _main(args)


def _main(args: argparse.Namespace) -> list[dict]:
    print_environment()
    block_args = ModelArgs(
        dim=args.dim, n_heads=args.heads, ffn_dim=args.ffn_dim, max_seq_len=args.tokens
    )
    base, inputs = block_and_inputs(block_args, args.tokens, args.device)
    rows, digests = [], {}
    for name in args.configs:
        found = check(name, base, inputs, args.steps, digests)
        rows += found
        differ = sum(row["elements differing"] for row in found)
        print(f"{name}: {'bitwise equal' if not differ else f'{differ} elements differ'}")
    print()
    print(markdown_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "digests": digests}))
    if args.against:
        print()
        print(compare_digests(digests, json.loads(Path(args.against).read_text())["digests"]))
    return rows


def compare_digests(ours: dict[str, str], theirs: dict[str, str]) -> str:
    """Per config and variant, how many of the tensors both runs hold have other bytes."""
    counts: dict[str, list[int]] = {}
    for key in ours.keys() & theirs.keys():
        config, variant, _, _ = key.split("/")
        tally = counts.setdefault(f"{config}, {variant}", [0, 0])
        tally[0] += ours[key] != theirs[key]
        tally[1] += 1
    rows = [
        {"config, variant": key, "tensors differing from the other run": f"{bad} of {total}"}
        for key, (bad, total) in sorted(counts.items())
    ]
    return markdown_table(rows) if rows else "no tensor in common with the other run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn-dim", type=int, default=14336)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["tensorwise", "tensorwise delayed one-pass tied"],
        choices=[name for name, config in CONFIGS.items() if config is not None],
    )
    parser.add_argument(
        "--inductor",
        nargs="+",
        metavar="KEY=VALUE",
        help="torch._inductor.config options for every compile, as examples.train_llama "
        "takes them (coordinate_descent_tuning=True tunes block sizes: other tiles)",
    )
    parser.add_argument(
        "--json", help="write every tensor's digest here, for --against in another process"
    )
    parser.add_argument(
        "--against",
        help="a --json of another run (another ptxas, say): count the tensors whose bytes differ",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
