"""What every benchmark shares: the environment header, markdown tables, CSV."""

from __future__ import annotations

import ast
import copy
import csv
import dataclasses
import datetime
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import fp8train
from fp8train import CastConfig, Float8GemmConfig, Float8Linear, Float8LinearConfig
from fp8train.toolchain import adopt_torch_ptxas, ptxas_in_use


def environment() -> dict[str, str]:
    """The facts a result is meaningless without."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = (
            f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
        )
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
    facts = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "fp8train": fp8train.__version__,
        "python": platform.python_version(),
        "command": command_line(),
    }
    if torch.cuda.is_available():
        # The compiler of the Triton kernels: 12.x miscompiles some on Hopper (fp8train.toolchain).
        # The run's first Float8Linear adopts torch's own ptxas where it can; adopted here
        # first, the header names the ptxas the run compiles with, not the one before that.
        adopt_torch_ptxas()
        facts["ptxas"] = ptxas_in_use() or "none found"
    return facts


def command_line(argv: Sequence[str] | None = None, root: Path | None = None) -> str:
    """The command as it can be typed again from the repository root (`root`, default the
    working directory): a script inside it as `-m module`, a path inside it relative to it, a
    path elsewhere (an output folder of that machine) as its file name alone."""
    argv = list(sys.argv if argv is None else argv)
    root = Path.cwd() if root is None else root
    words = [Path(sys.executable).name]
    for i, word in enumerate(argv):
        path = Path(word)
        if path.is_absolute():
            inside = path.is_relative_to(root)
            relative = path.relative_to(root) if inside else Path(path.name)
            if i == 0 and inside and relative.suffix == ".py":
                words += ["-m", ".".join(relative.with_suffix("").parts)]
                continue
            word = str(relative)
        words.append(word)
    return " ".join(words)


def print_environment() -> None:
    for key, value in environment().items():
        print(f"- {key}: {value}")
    print()


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_format(row.get(col, "")) for col in columns) + " |")
    return "\n".join(lines)


def write_csv(rows: Sequence[dict], path: str | Path) -> None:
    with open(path, "w", newline="") as handle:
        # Every row's columns, in first-seen order: rows may differ (torchao's columns exist
        # only beside the recipes torchao has).
        fields = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def median_time_s(fn, device: torch.device | str, *, warmup: int = 3) -> float:  # noqa: ANN001
    """Median wall time of `fn()` in seconds: CUDA events through triton's do_bench on a GPU
    (which also flushes the L2 between runs), torch.utils.benchmark on the CPU."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    from torch.utils.benchmark import Timer

    for _ in range(warmup):
        fn()
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2).median


def device_time_s(fn, device: torch.device | str, *, steps: int = 5) -> float:  # noqa: ANN001
    """The time `fn()`'s work takes on the device, per call, without the host's: the kernels'
    summed CUDA time on a GPU (torch.profiler), the operators' own CPU time elsewhere. Where
    the host keeps ahead of the GPU (a layer inside a compiled block of a real model) this
    is the layer's wall time; a layer timed alone can be host-bound, and then its wall time
    measures Python, launches and guards instead."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    if cuda:
        total_us = sum(e.self_device_time_total for e in events)
    else:
        total_us = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::"))
    return total_us / steps / 1e6


def fp8_peak_tflops(device: torch.device | str, given: float | None = None) -> float | None:
    """The dense float8 peak for '% of peak' columns: `given`, else 1979 TFLOP/s on H100/H200
    (the vendor's dense figure), else None (the column is left empty)."""
    if given is not None or torch.device(device).type != "cuda":
        return given
    name = torch.cuda.get_device_name()
    return 1979.0 if ("H100" in name or "H200" in name) else None


def inductor_pass_as(config: Float8LinearConfig) -> None:
    """fp8train.inductor's pass exactly as `config` asks for it. Layers only ever add to the
    process-wide pass (a layer built without an option leaves another layer's pass as it
    is); a benchmark that compares configs in one process replaces it before compiling."""
    from fp8train.inductor import install_pass_for, uninstall_satfinite_pass

    uninstall_satfinite_pass()
    install_pass_for(config)


PASS_VARIANTS = ("satfinite", "integer-amax", "float-amax", "clamp")
"""fp8train's inductor pass as benchmarks name its variants: satfinite and integer-amax are
the defaults (both parts on), float-amax the pass without its integer amaxes, clamp no pass
(the casts as inductor writes them)."""


def with_pass_variant(config: Float8LinearConfig, variant: str) -> Float8LinearConfig:
    """`config` with fp8train's inductor pass as PASS_VARIANTS' `variant` says."""
    if variant not in PASS_VARIANTS:
        raise ValueError(f"unknown pass variant {variant!r}: one of {', '.join(PASS_VARIANTS)}")
    if variant in ("float-amax", "clamp"):
        config = dataclasses.replace(config, compiled_integer_amax=False)
    if variant == "clamp":
        config = dataclasses.replace(config, compiled_satfinite=False)
    return config


FAST_ACCUM_SUFFIX = "-fast-accum"
"""Benchmarks' name for a config with Hopper's fast accumulation in the grad_input and
grad_weight gemms too, not only the output gemm (faster, less exact sums): train-llama's
config suffix; bench-linear's recipes carry it as "+fast-accum"."""


def with_fast_backward(config, gemm_config_type=Float8GemmConfig):  # noqa: ANN001, ANN201
    """`config` (fp8train's Float8LinearConfig, or torchao.float8's, which names these fields
    alike, with its own `gemm_config_type`) with fast accumulation in the grad_input and
    grad_weight gemms too."""
    fast = gemm_config_type(use_fast_accum=True)
    return dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)


def delayed_config(**kwargs: object) -> Float8LinearConfig:
    """Delayed scaling for the input, the weight and grad_output; other fields from kwargs."""
    delayed = CastConfig(scaling_type="delayed")
    return Float8LinearConfig(
        cast_config_input=delayed,
        cast_config_weight=delayed,
        cast_config_grad_output=delayed,
        **kwargs,
    )


def general_path(layer: Float8Linear) -> Float8Linear:
    """A copy of `layer` (sharing its weight) that never takes the eager fast path: the plan
    it caches for its config says none (Float8Linear._takes_eager_path)."""
    general = copy.copy(layer)
    general._eager = (general.config, None)
    return general


def inductor_options(pairs: list[str] | None, source: str = "--inductor") -> dict:
    """`KEY=VALUE` pairs as options for torch._inductor.config.patch: dotted names as in
    torch._inductor.config, values as Python literals (a bare word is a string). An unknown
    name, or a value of another type than the option's default, stops with what to give
    instead (an option whose default is None takes its value unchecked)."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    options = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(
                f"{source} {pair!r}: give KEY=VALUE, for example coordinate_descent_tuning=True"
            )
        if key not in known:
            raise SystemExit(
                f"{source} {key}: torch._inductor.config has no such option; give its dotted "
                "name, for example triton.tile_reductions"
            )
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        default = known[key]
        numeric = isinstance(default, float) and type(value) is int
        if default is not None and type(value) is not type(default) and not numeric:
            raise SystemExit(
                f"{source} {pair}: {key} takes a {type(default).__name__} "
                f"(its default is {default!r})"
            )
        options[key] = value
    return options
