"""How many instructions per element the Triton kernels of a compiled LLaMA-style block's
backward execute, per config, on a machine without a GPU:

    python -m benchmarks.kernel_instructions --configs bf16 "tensorwise delayed one-pass"

Needs Triton (3.6) beside a CPU build of torch. Forward runs compiled with inductor's C++
backend; for backward inductor generates Triton code for the CPU (`cpu_backend="triton"`), and
every generated kernel is compiled here for sm_90 and its PTX counted. The last step fails
when inductor tries to run that code (stock Triton has no CPU backend); the sources are
collected before that. Inductor's heuristics see the CPU's properties, not a GPU's, so its
choice of kernels and fusions may differ from the GPU's in places, but each kernel's body
(loads, arithmetic, stores) is what a GPU gets.

For each kernel: its kind and size, its loads and stores, its static PTX instruction count
with fixed block sizes (pointwise 1024 elements by 4 warps, reductions 1 x 1024 by 8 warps,
tiled pointwise 64 x 64 by 4 warps), and that count per element a thread handles. A kernel
whose arithmetic takes more issue slots than its bytes take memory time is bound by
instructions, and a store's layout does not decide its speed. A diagnostic: the GPU's kernel
times remain the measurement that counts.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import logging
import math
import re
import tempfile
from pathlib import Path

import torch

from benchmarks.saved_by_block import CONFIGS, block_and_inputs, configured
from benchmarks.utils import markdown_table, print_environment
from fp8train import sync_float8_amax_and_scale_history
from fp8train.inductor import SatfinitePass
from fp8train.models import ModelArgs

BLOCKS = {
    "pointwise": ({"XBLOCK": 1024}, 4),
    "tiled pointwise": ({"YBLOCK": 64, "XBLOCK": 64}, 4),
    "reduction": ({"XBLOCK": 1, "R0_BLOCK": 1024}, 8),
}
"""Per kind of kernel: the block sizes it is compiled with, and its warps."""


def generated_backward_kernels(
    block: torch.nn.Module,
    steps: int,
    *inputs,  # noqa: ANN002
    graph_pass: SatfinitePass | None = None,
) -> list[str]:
    """The Triton sources inductor generates for the backward of `block` compiled, in its
    last of `steps` steps (delayed scaling needs a step with recorded scales), with
    `graph_pass` as inductor's post-grad pass, whatever the layers installed."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils
    from torch._inductor.codegen import triton as triton_codegen

    sources: list[str] = []
    codegen_kernel = triton_codegen.TritonKernel.codegen_kernel

    def record(kernel, name=None):  # noqa: ANN001, ANN202
        source = codegen_kernel(kernel, name)
        sources.append(source)
        return source

    # The kernels' metadata hashes the active Triton backend, which a CPU does not have.
    patches = [
        (triton_codegen.TritonKernel, "codegen_kernel", record),
        (triton_utils, "triton_hash_with_backend", lambda: "0" * 64),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    compiled = torch.compile(block, fullgraph=True)
    try:
        options = {"fx_graph_cache": False, "post_grad_custom_post_pass": graph_pass}
        with inductor_config.patch(cpu_backend="cpp", **options):
            for step in range(steps):
                if step == steps - 1:
                    torch._dynamo.reset()  # the last step compiles forward and backward anew
                out = compiled(*inputs)
                if step < steps - 1:
                    out.float().sum().backward()
                    sync_float8_amax_and_scale_history(block)
        # Inductor logs each kernel it cannot compile for the CPU (all of them), with its
        # source: the expected failure, not news.
        heuristics_log = logging.getLogger("torch._inductor.runtime.triton_heuristics")
        level = heuristics_log.level
        heuristics_log.setLevel(logging.CRITICAL)
        with inductor_config.patch(cpu_backend="triton", **options):
            try:
                out.float().sum().backward()
            except Exception as error:  # noqa: BLE001  running Triton code on a CPU fails
                if not sources:
                    raise RuntimeError("inductor generated no Triton kernel") from error
            finally:
                heuristics_log.setLevel(level)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        torch._dynamo.reset()
    return sources


def _kind(source: str) -> str:
    if "triton_heuristics.pointwise" in source:
        return "tiled pointwise" if "YBLOCK" in source else "pointwise"
    return "reduction"


def _numel(source: str) -> int:
    sizes = re.findall(r"^\s+[xyr]0?_?numel = (\d+)$", source, re.M)
    return math.prod(int(n) for n in sizes) if sizes else 0


def load_generated_kernel(source: str) -> tuple[object, dict]:
    """The @triton.jit function of an inductor-generated kernel's `source`, loaded without
    inductor's launcher (which needs a GPU), and its signature."""
    signature = eval(re.search(r"'signature': (\{[^}]*\})", source).group(1))  # noqa: S307
    body = source[source.index("@triton.jit") :].replace("Placeholder.KERNEL_NAME", "kernel")
    header = source[: source.index("@triton_heuristics")].replace(
        "triton_helpers.set_driver_to_cpu()", ""
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "generated_kernel.py"
        path.write_text(header + body)
        spec = importlib.util.spec_from_file_location("generated_kernel", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.kernel, signature


def ptx_instructions(source: str) -> tuple[int, float] | None:
    """Static PTX instructions of `source` compiled for sm_90 with BLOCKS' sizes, and that
    count per element a thread handles; None for kernels not over elements (scalars)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants, warps = BLOCKS[_kind(source)]
    kernel, signature = load_generated_kernel(source)
    if any(name not in signature for name in constants):
        return None  # a persistent reduction: its block is the whole row, no R0_BLOCK
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    lines = [line.strip() for line in compiled.asm["ptx"].splitlines()]
    count = sum(1 for line in lines if line.endswith(";") and not line.startswith((".", "//")))
    return count, count / (math.prod(constants.values()) / (warps * 32))


def describe(sources: list[str]) -> list[dict]:
    rows = []
    for source in dict.fromkeys(sources):  # a kernel generated twice counts once
        numel = _numel(source)
        counted = ptx_instructions(source) if numel > 1 else None
        if counted is None:
            continue
        count, per_element = counted
        stores = re.findall(r"'(out_ptr\d+|in_out_ptr\d+)': '\*(\w+)'", source)
        dtypes = collections.Counter(dtype for _, dtype in stores)
        rows.append(
            {
                "kind": _kind(source),
                "elements": numel,
                "loads": source.count("tl.load("),
                "stores": ", ".join(f"{n} {d}" for d, n in sorted(dtypes.items())),
                "exp": "yes" if "libdevice.exp" in source or "sigmoid" in source else "",
                "PTX instructions": count,
                "per element": round(per_element),
                "M instructions": round(per_element * numel / 1e6, 1),
            }
        )
    return sorted(rows, key=lambda row: -row["M instructions"])


def main(args: argparse.Namespace) -> dict[str, list[dict]]:
    print_environment()
    graph_pass = None
    if args.satfinite or args.integer_amax:
        # Forced on for the CPU's Triton code, which is what a GPU would run.
        graph_pass = SatfinitePass(
            any_device=True, integer_amax=args.integer_amax, satfinite=args.satfinite
        )
    block_args = ModelArgs(
        dim=args.dim, n_heads=args.heads, ffn_dim=args.ffn_dim, max_seq_len=args.tokens
    )
    base, inputs = block_and_inputs(block_args, args.tokens)
    tables = {}
    for name in args.configs:
        steps = 2 if "delayed" in name else 1
        block = configured(base, name)
        rows = describe(generated_backward_kernels(block, steps, *inputs, graph_pass=graph_pass))
        total = sum(row["M instructions"] for row in rows)
        print(f"\n##### {name}: backward's kernels, {total:.1f} M instructions in all")
        print(markdown_table(rows))
        tables[name] = rows
    return tables


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--ffn-dim", type=int, default=896)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument(
        "--configs", nargs="+", default=["bf16", "tensorwise"], choices=list(CONFIGS)
    )
    parser.add_argument(
        "--satfinite",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="leave the casts' saturation to Triton's conversion, as fp8train does on a GPU "
        "(fp8train.inductor; --no-satfinite: the clamp inductor gets from the casts)",
    )
    parser.add_argument(
        "--integer-amax",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="amaxes as integer maxima, as fp8train does by default "
        "(Float8LinearConfig.compiled_integer_amax; --no-integer-amax: inductor's float "
        "maxima). With --no-satfinite --no-integer-amax the casts compile as inductor writes "
        "them",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
