# ruff: noqa: B023  (each closure is called within the loop iteration that defines it)
"""Where the time of a step goes on the GPU: per-kernel CUDA time (torch.profiler) and step
times with dynamo's counters (frames, graph breaks).

    python -m benchmarks.profile_steps layer     # one layer, ffn.w13 and attn.w0, fp8train and
                                                 # torchao.float8, eager and compiled
    SHAPES=attn.wqkv,8192x4096x4096 MODES=compiled KERNELS=1 \
        python -m benchmarks.profile_steps layer
                                                 # other shapes (names or MxKxN), compiled
                                                 # only, and fp8train
                                                 # with compiled_cast_kernels too
    python -m benchmarks.profile_steps blocks    # the end-to-end model's compiled blocks (2 of
                                                 # them; DIM, LAYERS, FFN): peak memory and
                                                 # kernel launches by kind, per train_llama
                                                 # config (CONFIGS; default bf16, tensorwise,
                                                 # tensorwise-cast-kernels, -keep-hp-input)
    python -m benchmarks.profile_steps peak      # the end-to-end model's training step: what
                                                 # is allocated at its peak, by line and phase
                                                 # (CONFIGS=bf16,tensorwise, LAYERS=6); without
                                                 # a GPU, its peak at 1/8 scale on the CPU
    python -m benchmarks.profile_steps time      # the end-to-end model's training step
                                                 # (LAYERS=6, compiled blocks, AdamW): GPU
                                                 # time by kind of kernel (gemms, attention,
                                                 # casts, ...) per config (CONFIGS, default
                                                 # bf16,tensorwise), against the first config
    INDUCTOR="coordinate_descent_tuning=True" python -m benchmarks.profile_steps time
                                                 # any part with torch._inductor.config
                                                 # options (KEY=VALUE, space-separated, as
                                                 # train_llama's --inductor)
    python -m benchmarks.profile_steps demo      # the demo's CUDA model (8 layers, dim 1024),
                                                 # bf16 and float8, eager and compiled
    ONLY=1 python -m benchmarks.profile_steps demo   # float8 compiled only

A diagnostic, not a benchmark table: the step times are single steps (the first includes
compilation).
"""

import copy
import os
import sys
import time
import traceback

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_linear import LLAMA_70B_SHAPES
from benchmarks.bench_memory import CPU_SCALE, llama_args
from benchmarks.memory_trace import (
    BACKWARD_MARK,
    MIB,
    cpu_step_memory,
    print_peak,
    storage_bytes,
)
from benchmarks.utils import inductor_options
from fp8train import (
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    sync_float8_amax_and_scale_history,
)
from fp8train.demo import lm_loss
from fp8train.models import ModelArgs, Transformer, llama_ffn_dim

try:
    import torchao.float8 as ao
except ImportError:
    ao = None


def wall_ms(fn, repeats: int) -> float:  # noqa: ANN001
    """ms per call of `fn`, over `repeats` calls back to back after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def is_kernel(event) -> bool:  # noqa: ANN001
    """True for a profiler event that is a CUDA kernel's own time. The host's events (ops,
    and inductor's launches, named as their kernels) carry their kernels' time again, and so
    do the device's copies of record_function ranges (user annotations, such as
    "Optimizer.step#AdamW.step")."""
    return (
        event.device_type == DeviceType.CUDA
        and not getattr(event, "is_user_annotation", False)
        and event.self_device_time_total > 0
    )


def top(fn, n=14, steps=3):
    wall = wall_ms(fn, 20)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    # Kernel time summed against the wall time of a step: where the kernels fill much less
    # than the step, the GPU waits for the host (launches, Python, guards).
    kernel_ms = sum(e.self_device_time_total for e in p.key_averages() if is_kernel(e))
    kernel_ms /= steps * 1e3
    print(f"wall {wall:.3f} ms per step, kernels {kernel_ms:.3f} ms per step")
    try:
        print(
            p.key_averages().table(
                sort_by="self_device_time_total", row_limit=n, max_name_column_width=90
            )
        )
    except Exception:
        print(
            p.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=n, max_name_column_width=90
            )
        )


def layer_part():
    shapes = os.environ.get("SHAPES", "ffn.w13,attn.w0").split(",")
    modes = [m == "compiled" for m in os.environ.get("MODES", "eager,compiled").split(",")]
    for name in shapes:
        # A name of the LLaMA-70B table, or MxKxN.
        m, k, n = LLAMA_70B_SHAPES.get(name) or map(int, name.split("x"))
        ref = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        impls = {"ours": Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig())}
        if os.environ.get("KERNELS"):
            impls["ours cast-kernels"] = Float8Linear.from_float(
                copy.deepcopy(ref), Float8LinearConfig(compiled_cast_kernels=True)
            )
        if ao:
            impls["torchao"] = ao.convert_to_float8_training(nn.Sequential(copy.deepcopy(ref)))
        for key, mod in impls.items():
            for comp in modes:
                torch._dynamo.reset()
                f = torch.compile(mod) if comp else mod
                print(f"\n##### {name} {key} compiled={comp}")
                top(lambda: f(x).backward(g))


def blocks_part():
    """The end-to-end model's blocks compiled one by one (as examples/train_llama.py does),
    per config: peak memory, step time, and how many kernels of each kind a step launches.
    A cast that the layers reading one input (q/k/v, gate/up) share shows as fewer cast
    kernels than float8 layers."""
    dim, layers = int(os.environ.get("DIM", "4096")), int(os.environ.get("LAYERS", "2"))
    a = ModelArgs(
        dim=dim, n_layers=layers, n_heads=dim // 128, ffn_dim=int(os.environ.get("FFN", "14336")),
        max_seq_len=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    base = Transformer(a)
    tokens = torch.randint(0, 256, (2, 4096), device="cuda")
    default = "bf16,tensorwise,tensorwise-cast-kernels,tensorwise-keep-hp-input"
    for name in os.environ.get("CONFIGS", default).split(","):
        model = _compiled_blocks(base, name, torch.device("cuda"))

        def step():
            lm_loss(model, tokens, tokens).backward()
            _after_backward(name, model)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            step()
            torch.cuda.synchronize()
        kinds: dict[str, int] = {}
        for event in p.key_averages():
            if is_kernel(event):
                kind = kernel_kind(event.key)
                kinds[kind] = kinds.get(kind, 0) + event.count
        print(f"\n##### blocks {name}: peak {peak:.2f} GiB, launches per step {kinds}")
        top(step, n=12, steps=1)


def peak_part():
    """What is allocated at the peak of a training step of the end-to-end model (LAYERS
    blocks, compiled, fused AdamW, as examples/train_llama.py trains it), per config
    (CONFIGS, default bf16,tensorwise): the allocations live at the peak, grouped by the line
    that made them, and the step phase (forward, backward, optimizer) of each. Without a GPU,
    the model at 1/8 of every size on the CPU (bench_memory --device cpu says how that
    compares), with each config's peak against the first's."""
    layers = int(os.environ.get("LAYERS", "6"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scale = 1 if device == "cuda" else CPU_SCALE
    a = llama_args(layers, scale)
    torch.manual_seed(0)
    base = Transformer(a)
    tokens = torch.randint(0, a.vocab_size, (2, a.max_seq_len), device=device)
    peaks = {}
    for name in os.environ.get("CONFIGS", "bf16,tensorwise").split(","):
        peaks[name] = _peak(name, base, tokens)
    if device == "cpu":
        first = next(iter(peaks.values()))
        print(
            f"\nPeak of a training step on the CPU (sizes / {scale}), against {next(iter(peaks))}:"
        )
        for name, peak in peaks.items():
            print(f"- {name}: {peak / MIB:.2f} MiB, {peak / first:.3f}x")


def _compiled_blocks(base: nn.Module, name: str, device: torch.device) -> nn.Module:
    """A bf16 copy of `base` on `device` converted as examples/train_llama.py's config
    `name`, each block compiled with fullgraph=True, as that example trains it."""
    from examples.llama_configs import convert

    torch._dynamo.reset()
    model = convert(copy.deepcopy(base).to(device, torch.bfloat16), name)
    for block in model.layers:
        block.compile(fullgraph=True)
    return model


def _after_backward(name: str, model: nn.Module) -> None:
    """What examples/train_llama.py does after each backward of config `name`: the delayed
    configs sync their amaxes and scales (without it they would stay at their first step,
    where every cast waits for its own amax)."""
    if name.startswith("tensorwise-delayed"):
        sync_float8_amax_and_scale_history(model)


def _training_step(name: str, base: nn.Module, tokens: torch.Tensor):  # noqa: ANN202
    """(model, optimizer, step) for config `name`: `base`'s blocks compiled and one training
    step as examples/train_llama.py takes it (fused AdamW, gradient clipping, the delayed
    sync), its backward marked for the memory report's phases."""
    model = _compiled_blocks(base, name, tokens.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss = lm_loss(model, tokens, tokens)
        with torch.profiler.record_function(BACKWARD_MARK):
            loss.backward()
        _after_backward(name, model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def _peak(name: str, base: nn.Module, tokens: torch.Tensor) -> int | None:
    """Print the peak of a training step with config `name`; on the CPU return its bytes."""
    model, optimizer, step = _training_step(name, base, tokens)
    for _ in range(2):
        step()
    if tokens.is_cuda:
        print_peak(step, name)
        return None
    memory = cpu_step_memory(step)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    tensors = [*model.parameters(), *model.buffers(), *state, tokens]
    before = storage_bytes(tensors)
    print(
        f"##### peak {name} (CPU): {(before + memory.peak) / MIB:.2f} MiB = {before / MIB:.2f} "
        f"MiB of parameters and AdamW state + {memory.peak / MIB:.2f} MiB allocated in the "
        f"step; forward left {memory.held / MIB:.2f} MiB for backward"
    )
    return before + memory.peak


KERNEL_KINDS = (
    # (kind, substrings of a kernel's name), first match wins; names as CUDA 12-13 and
    # torch 2.11+ give them on Hopper.
    ("float8 gemm", ("e4m3", "e5m2", "f8f8", "_fp8", "fp8_")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("fp8train cast kernels", ("_cast_kernel", "_amax_partials_kernel", "_transpose_kernel")),
    ("optimizer and grad clip", ("adam", "multi_tensor", "foreach", "norm_kernel")),
    ("inductor reduction", ("triton_red", "triton_per")),
    ("inductor pointwise", ("triton_poi",)),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name (KERNEL_KINDS), "other" if none matches."""
    lower = name.lower()
    for kind, parts in KERNEL_KINDS:
        if any(part in lower for part in parts):
            return kind
    return "other"


def time_by_kind(events, steps: int, row: dict[str, float]) -> list[tuple]:  # noqa: ANN001
    """Add to `row` the ms per step of the profiler's averaged `events` (over `steps` steps)
    by kind of kernel, their total ("all kernels") and the device time of aten::_scaled_mm;
    return (ms, launches per step, kind, name) per kernel."""
    kernels = []
    for event in events:
        if event.key == "aten::_scaled_mm":
            row["aten::_scaled_mm (all its kernels)"] = event.device_time_total / steps / 1e3
        if not is_kernel(event):
            continue
        ms = event.self_device_time_total / steps / 1e3
        kind = kernel_kind(event.key)
        row[kind] = row.get(kind, 0.0) + ms
        row["all kernels"] = row.get("all kernels", 0.0) + ms
        kernels.append((ms, event.count // steps, kind, event.key))
    return kernels


def time_part():
    """Where a training step of the end-to-end model spends its GPU time, per config: kernel
    time by kind, with the float8 gemms told apart by the op that launched them
    (aten::_scaled_mm), and the step's wall time. The difference between two configs' rows
    is what float8 wins and what it costs, kind by kind."""
    layers = int(os.environ.get("LAYERS", "6"))
    a = llama_args(layers)
    torch.manual_seed(0)
    base = Transformer(a)
    tokens = torch.randint(0, a.vocab_size, (2, a.max_seq_len), device="cuda")
    table: dict[str, dict[str, float]] = {}
    for name in os.environ.get("CONFIGS", "bf16,tensorwise").split(","):
        table[name] = _time_by_kind(name, base, tokens)
        torch.cuda.empty_cache()
    names = list(table)
    kinds = sorted(
        {k for row in table.values() for k in row}, key=lambda k: -table[names[0]].get(k, 0)
    )
    print("\n| ms per step | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{table[n].get(kind, 0.0):.2f}" for n in names) + " |")
    for label, values in against_first(table).items():
        print(f"| {label} | " + " | ".join(values) + " |")


INDUCTOR_KINDS = ("inductor pointwise", "inductor reduction", "fp8train cast kernels")
"""The kinds that hold the casts of a float8 step (beside the norms, rotary embedding,
SwiGLU and residual adds that a bf16 step runs as inductor kernels too)."""


def against_first(table: dict[str, dict[str, float]]) -> dict[str, list[str]]:
    """Rows that compare each config of `time_part`'s table with the first: its speed (the
    first's wall time over its own) and its casts (its inductor and cast-kernel time beyond
    the first's), as cells."""
    names = list(table)
    first = table[names[0]]

    def casts(row: dict[str, float]) -> float:
        return sum(row.get(kind, 0.0) for kind in INDUCTOR_KINDS)

    return {
        f"wall: speed vs {names[0]}": [f"{first['wall'] / table[n]['wall']:.3f}x" for n in names],
        f"casts: inductor and cast kernels beyond {names[0]}": [
            f"{casts(table[n]) - casts(first):.2f}" for n in names
        ],
    }


def _time_by_kind(name: str, base: nn.Module, tokens: torch.Tensor) -> dict[str, float]:
    """ms per training step of config `name`: wall time, and kernel time by kind."""
    _, _, step = _training_step(name, base, tokens)
    row = {"wall": wall_ms(step, 5)}
    steps = 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = time_by_kind(p.key_averages(), steps, row)
    print(f"##### time {name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()))
    # The kernels by time, names in full (the profiler's own table cuts them): inductor's
    # names list the ops each kernel fused, which tells what a cast kernel casts.
    print("ms per step | launches per step | kind | kernel")
    for ms, count, kind, key in sorted(kernels, reverse=True)[:30]:
        print(f"{ms:8.3f} | {count:4d} | {kind} | {key}")
    return row


def demo_part():
    a = ModelArgs(dim=1024, n_layers=8, ffn_dim=llama_ffn_dim(1024), n_heads=16, max_seq_len=1024)
    torch.manual_seed(0)
    base = Transformer(a)
    inp = torch.randint(0, 256, (8, 1024), device="cuda")
    combos = (
        [(True, True)]
        if os.environ.get("ONLY")
        else [(f, c) for f in (False, True) for c in (False, True)]
    )
    for fp8, comp in combos:
        if True:
            torch._dynamo.reset()
            from torch._dynamo.utils import counters

            counters.clear()
            model = copy.deepcopy(base).to("cuda", torch.bfloat16)
            if fp8:
                convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "lm_head")
            fwd = torch.compile(model) if comp else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step():
                lm_loss(fwd, inp, inp).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            times = []
            for _i in range(12):
                torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(round((time.perf_counter() - t) * 1e3, 1))
            print(f"\n##### demo fp8={fp8} compiled={comp} step ms: {times}")
            print(
                "counters:",
                {
                    k: dict(v)
                    for k, v in counters.items()
                    if k in ("stats", "graph_break", "recompiles", "frames")
                },
            )
            top(step, n=16, steps=2)


if __name__ == "__main__":
    from torch._inductor import config as inductor_config

    parts = sys.argv[1:] or ["layer", "demo"]  # blocks only when asked for
    options = inductor_options(os.environ.get("INDUCTOR", "").split(), source="INDUCTOR")
    functions = {
        "layer": layer_part,
        "demo": demo_part,
        "blocks": blocks_part,
        "peak": peak_part,
        "time": time_part,
    }
    for part in parts:
        try:
            with inductor_config.patch(options):
                functions[part]()
        except Exception:
            traceback.print_exc()
