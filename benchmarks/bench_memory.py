"""Peak memory of one forward + backward, bf16 against float8 under each save policy, in eager
mode and compiled, with torchao.float8 as a column when it is importable.

    python -m benchmarks.bench_memory [--cases linear-4096 linear-16384 llama] [--csv out.csv]
    python -m benchmarks.bench_memory --cases linear-16384 --modes eager \
        --configs bf16 "fp8 default" --explain     # what is live at each cell's peak
    python -m fp8train bench-memory ...     (the same, run from a checkout of the repository)

Configs: "fp8 default" recomputes the weight cast and, compiled, lets the partitioner choose
between the float8 and the hp input; "keep-fp8-input" forces the float8 input (what eager mode
keeps by default); "keep-weight" keeps the float8 weight; "keep-hp-input" the hp input;
"cast-kernels" is the default policy with compiled_cast_kernels=True (in eager mode the same
as "fp8 default"; compiled, the casts are fp8train's triton ops); "float8-swiglu" is the
default policy with the llama blocks' SwiGLU keeping its two inputs in float8
(fp8train.float8_swiglu; in the linear cases the same as "fp8 default"), and
"float8-swiglu-exact" the same with SwiGLU's output computed from its high-precision inputs;
"delayed" is delayed scaling of every role, "delayed tied" the same with the layers that read
one input tied to one input state (fp8train.tie_delayed_input_scales).

Cases:
    linear-4096    10 x Linear(4096, 4096, bias=False), batch 4096: float8_experimental's case
    linear-16384   the same at batch 16384, where activations dominate
    llama          a LLaMA-style decoder (d=4096, 32 heads, FFN 14336, seq 4096) of --llama-layers

Each cell is the peak of torch.cuda.max_memory_allocated() over one fwd+bwd after two warm-up
steps, everything included (parameters, input, gradients), and its ratio to bf16 in the same
mode. Compiled runs compile per layer (linear cases) or per block (llama), as torchtitan does.

`--device cpu` runs the cases at 1/8 of every size (dims, tokens, heads) on the CPU, in MiB:
the bytes live before the step plus the highest the CPU allocator's live bytes rose in it
(benchmarks.memory_trace.cpu_step_memory), less the fp32 scratch of the CPU's float8 gemm,
which cuBLAS does not have. The save policy and the compiled partition are the same code as on
the GPU, so what forward holds for backward matches the GPU's table cell for cell; peaks also
carry the CPU's own kernels (the torch-path casts in eager mode, inductor's C++ code
compiled), so they approximate the GPU's. For working on memory without a GPU; quote GPU
figures from a GPU.

A second table gives what forward leaves allocated for backward (memory_allocated after
forward, less before it and the output): the saved activations and kept casts, wherever the
peak falls. From it, per case and mode, what recomputing the weight cast saves against
keeping the float8 weight, as a share of the float8 weights' bytes (float8_experimental
measured 0.14 of 0.156 GiB on linear-4096).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.memory_trace import (
    BACKWARD_MARK,
    GIB,
    MIB,
    cpu_step_memory,
    print_peak,
    storage_bytes,
)
from benchmarks.utils import delayed_config, markdown_table, print_environment, write_csv
from fp8train import Float8Linear, Float8LinearConfig, convert_to_float8_training
from fp8train.models import (
    ModelArgs,
    Transformer,
    TransformerBlock,
    tie_shared_delayed_inputs,
    use_float8_swiglu,
)

try:
    import torchao.float8 as torchao_float8

    TORCHAO = "torchao " + __import__("torchao").__version__
except ImportError as error:
    torchao_float8 = None
    TORCHAO = f"not importable ({error})"

CPU_SCALE = 8
"""On the CPU every size of each case (dims, tokens) is this many times smaller."""

FP8_CONFIGS: dict[str, Float8LinearConfig] = {
    "fp8 default": Float8LinearConfig(),
    "fp8 keep-fp8-input": Float8LinearConfig(recompute_input_cast=False),
    "fp8 keep-weight": Float8LinearConfig(recompute_weight_cast=False),
    "fp8 keep-hp-input": Float8LinearConfig(recompute_input_cast=True),
    # Compiled with fp8train's cast kernels as triton ops; in eager mode the same as default.
    "fp8 cast-kernels": Float8LinearConfig(compiled_cast_kernels=True),
    # The same for the weights' and gradients' casts only; the inputs' stay inductor's.
    "fp8 cast-kernels-no-input": Float8LinearConfig(
        compiled_cast_kernels=("weight", "grad_output")
    ),
    # The default, and SwiGLU keeps its two inputs in float8 (llama; the linear cases have none).
    "fp8 float8-swiglu": Float8LinearConfig(),
    # The same, SwiGLU's output computed from its bf16 inputs (float8 w2 keeps its own input).
    "fp8 float8-swiglu-exact": Float8LinearConfig(),
    # Delayed scaling of every role; "tied": the layers that read one input share its state
    # (fp8train.models.tie_shared_delayed_inputs; llama only, the linear cases share none).
    "fp8 delayed": delayed_config(),
    "fp8 delayed tied": delayed_config(),
}


@dataclass
class Case:
    build: Callable[[], nn.Module]
    make_input: Callable[[], torch.Tensor]
    compile_unit: type[nn.Module]
    """The modules compiled one by one under --compile."""


def linear_case(batch: int, dim: int, device: str) -> Case:
    def build() -> nn.Module:
        return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(10)])

    def make_input() -> torch.Tensor:
        return torch.randn(batch, dim, device=device, dtype=torch.bfloat16, requires_grad=True)

    return Case(build, make_input, nn.Linear)


def llama_args(n_layers: int, scale: int = 1) -> ModelArgs:
    """The end-to-end decoder's sizes (d=4096, 32 heads, FFN 14336, seq 4096) at 1/`scale`
    of each, heads of 128 kept."""
    return ModelArgs(
        vocab_size=256,
        dim=4096 // scale,
        n_layers=n_layers,
        n_heads=32 // scale,
        ffn_dim=14336 // scale,
        max_seq_len=4096 // scale,
    )


def llama_case(n_layers: int, scale: int, device: str) -> Case:
    """The decoder at 1/`scale` of every size (llama_args), batch 1."""
    args = llama_args(n_layers, scale)

    def make_input() -> torch.Tensor:
        return torch.randint(0, args.vocab_size, (1, args.max_seq_len), device=device)

    return Case(lambda: Transformer(args), make_input, TransformerBlock)


def _skip_output_layer(module: nn.Module, fqn: str) -> bool:
    return fqn != "lm_head"


def convert(model: nn.Module, name: str) -> nn.Module:
    if name == "bf16":
        return model
    if name == "torchao.float8":
        return torchao_float8.convert_to_float8_training(model, module_filter_fn=_skip_output_layer)
    if name.startswith("fp8 float8-swiglu"):
        use_float8_swiglu(model, exact_forward=name.endswith("-exact"))
    model = convert_to_float8_training(
        model, config=FP8_CONFIGS[name], module_filter_fn=_skip_output_layer
    )
    return tie_shared_delayed_inputs(model) if name.endswith(" tied") else model


def compile_units(model: nn.Module, unit: type[nn.Module]) -> None:
    for name, child in list(model.named_children()):
        if isinstance(child, unit):
            setattr(model, name, torch.compile(child))
        else:
            compile_units(child, unit)


def measure(model: nn.Module, case: Case, explain: str | None = None) -> tuple[float, float]:
    """(peak bytes of one fwd+bwd, bytes that forward leaves allocated for backward). With
    `explain` (a title), then also print what one more fwd+bwd has live at its peak."""
    x = case.make_input()
    out_shape = model(x).shape
    grad = torch.randn(out_shape, device=x.device, dtype=torch.bfloat16)
    for _ in range(2):
        model(x).backward(grad)
    model.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None
    gc.collect()
    if x.device.type == "cpu":
        return _measure_cpu(model, x, grad, explain)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = model(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    if explain:
        del out
        model.zero_grad(set_to_none=True)
        x.grad = None
        gc.collect()
        print_peak(lambda: model(x).backward(grad), explain)
    return peak, held


def _measure_cpu(
    model: nn.Module, x: torch.Tensor, grad: torch.Tensor, explain: str | None
) -> tuple[float, float]:
    """`measure` on the CPU: what the step allocates, from the CPU allocator's events, on top
    of the bytes live before it (parameters, buffers, input and upstream gradient)."""
    output_bytes = grad.numel() * grad.element_size()

    def step() -> None:
        out = model(x)
        with torch.profiler.record_function(BACKWARD_MARK):
            out.backward(grad)

    step_memory = cpu_step_memory(step)
    tensors = [*model.parameters(), *model.buffers(), x, grad]
    before = storage_bytes(tensors)
    if explain:
        sites: dict[tuple[str, str], list[int]] = {}
        for size, phase, op in step_memory.at_peak:
            sites.setdefault((phase, op), []).append(size)
        print(
            f"\n##### peak {explain}: {(before + step_memory.peak) / MIB:.2f} MiB = "
            f"{before / MIB:.2f} MiB before the step + {step_memory.peak / MIB:.2f} MiB "
            "allocated in it; live at the peak, by the operator that allocated it:"
        )
        for (phase, op), sizes in sorted(sites.items(), key=lambda item: -sum(item[1]))[:12]:
            print(f"{sum(sizes) / MIB:9.2f} MiB {len(sizes):4d}x {phase:9s} {op[:90]}")
    return before + step_memory.peak, step_memory.held - output_bytes


def float8_weight_bytes(model: nn.Module) -> int:
    """The bytes of every Float8Linear weight cast to float8 (1 byte per element)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))


def recompute_savings(held: dict, weight: float, unit: str = "GiB") -> str:
    """What recomputing the weight cast saves between forward and backward against keeping
    the float8 weight, in `unit` and as a share of the float8 weights' bytes (`weight`)."""
    saved = held["fp8 keep-weight"] - held["fp8 default"]
    return f"{saved:.3f} {unit} of {weight:.3f} ({100 * saved / weight:.0f}%)"


def all_configs() -> list[str]:
    return ["bf16", *FP8_CONFIGS, *(["torchao.float8"] if torchao_float8 is not None else [])]


def run(  # noqa: PLR0913
    case_names: list[str],
    modes: list[str],
    llama_layers: int,
    configs: list[str] | None = None,
    explain: bool = False,
    device: str = "cuda",
) -> tuple[list, list]:
    """Rows of peaks and rows of what forward holds for backward, per case and mode, over
    `configs` (default: all; bf16 always, for the ratios), in GiB; on the CPU, where every
    size is CPU_SCALE times smaller, in MiB."""
    scale, unit = (CPU_SCALE, MIB) if device == "cpu" else (1, GIB)
    cases = {
        "linear-4096": lambda: linear_case(4096 // scale, 4096 // scale, device),
        "linear-16384": lambda: linear_case(16384 // scale, 4096 // scale, device),
        "llama": lambda: llama_case(llama_layers, scale, device),
    }
    configs = ["bf16", *[c for c in configs or all_configs() if c != "bf16"]]
    rows, held_rows = [], []
    for case_name in case_names:
        case = cases[case_name]()
        for mode in modes:
            row = {"case": case_name, "mode": mode}
            held = dict(row)
            for name in configs:
                # Built anew for each config from the same seed: nothing else on the device.
                torch.manual_seed(0)
                with torch.device(device):
                    model = convert(case.build().to(torch.bfloat16), name)
                if mode == "compiled":
                    torch._dynamo.reset()
                    compile_units(model, case.compile_unit)
                title = f"{case_name} {mode} {name}" if explain else None
                peak, held_bytes = measure(model, case, title)
                row[name], held[name] = peak / unit, held_bytes / unit
                if name.startswith("fp8"):
                    held["float8 weights"] = float8_weight_bytes(model) / unit
                del model
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            held_rows.append(held)
    return rows, held_rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each cell as 'size (ratio to bf16)'."""
    shown = []
    for row in rows:
        out = {"case": row["case"], "mode": row["mode"], "bf16": f"{row['bf16']:.2f}"}
        for name, value in row.items():
            if name in ("case", "mode", "bf16"):
                continue
            out[name] = f"{value:.2f} ({value / row['bf16']:.2f}x)"
        shown.append(out)
    return shown


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["linear-4096", "linear-16384", "llama"],
        choices=["linear-4096", "linear-16384", "llama"],
    )
    parser.add_argument(
        "--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"]
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=["bf16", *FP8_CONFIGS, "torchao.float8"],
        help="the configs to measure (default: all; bf16 is always measured, for the ratios)",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="after each cell, print the allocations live at its peak by phase and line",
    )
    parser.add_argument("--llama-layers", type=int, default=4, help="decoder blocks (default 4)")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help=f"cpu: every case {CPU_SCALE}x smaller in each size, the CPU allocator's bytes "
        "(the save policy and the compiled partition are the GPU's; the eager casts and "
        "inductor's kernels are the CPU's own)",
    )
    parser.add_argument(
        "--csv",
        help="also write the raw figures (GiB; MiB on the CPU) to this CSV file (and those "
        "held: NAME-held)",
    )


def main(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench_memory measures CUDA memory and no GPU is visible: run it on a GPU, or pass "
            f"--device cpu for the cases at 1/{CPU_SCALE} of their sizes on the CPU"
        )
    print_environment()
    print(f"- torchao.float8: {TORCHAO}")
    if args.device == "cpu":
        print(f"- on the CPU: every size of each case divided by {CPU_SCALE}")
    print()
    if args.configs and "torchao.float8" in args.configs and torchao_float8 is None:
        raise SystemExit(f"--configs names torchao.float8, which is {TORCHAO}")
    rows, held_rows = run(
        args.cases, args.modes, args.llama_layers, args.configs, args.explain, args.device
    )
    unit = "MiB" if args.device == "cpu" else "GiB"
    print(f"Peak memory of one forward + backward, {unit} (ratio to bf16 in the same mode)\n")
    print(markdown_table(with_ratios(rows)))
    print(f"\nHeld by forward for backward, {unit} (ratio to bf16 in the same mode)\n")
    weights = [row.pop("float8 weights", None) for row in held_rows]
    print(markdown_table(with_ratios(held_rows)))
    print()
    for row, weight in zip(held_rows, weights, strict=True):
        if not {"fp8 default", "fp8 keep-weight"} <= row.keys():
            continue
        print(
            f"- {row['case']}, {row['mode']}: recomputing the weight cast saves "
            f"{recompute_savings(row, weight, unit)} against keeping the float8 weight"
        )
    if args.csv:
        write_csv(rows, args.csv)
        held_csv = Path(args.csv)
        write_csv(held_rows, str(held_csv.with_name(f"{held_csv.stem}-held{held_csv.suffix}")))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
