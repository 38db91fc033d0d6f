"""fwd+bwd of one linear layer, nn.Linear against Float8Linear (and torchao.float8 when it is
importable, timed in the same run, interleaved), on float8_experimental's LLaMA-70B shapes.

    python -m benchmarks.bench_linear [--compile both] [--recipes tensorwise rowwise] [--csv f]
    python -m fp8train bench-linear ...                 (the same, from a checkout)
    python -m benchmarks.bench_linear --shape 8192 4096 4096 --shape ...    (custom M K N)
    python -m benchmarks.bench_linear --sweep                              (a grid of K, N)
    python -m benchmarks.bench_linear --model e2e       (the layers of a model of this repo)
    python -m benchmarks.bench_linear --device cpu --shape 64 64 64        (a smoke run)
    python -m benchmarks.bench_linear --compile on --compile-mode reduce-overhead default
                                                           (with and without CUDA graphs)

Columns: name, shape, ref_dtype, compiled, compile_mode, recompute_weight_cast, recipe,
ref_time_sec, fp8_time_sec, fp8_speedup, fp8_sqnr_db (the timed layer's output against the
reference's, a guard that the timed code computes the right thing), pct_fp8_peak (the three
gemms' 6*M*K*N FLOPs over fp8_time_sec, as a share of --fp8-peak-tflops), and torchao_time_sec
/ torchao_speedup / vs_torchao / torchao_sqnr_db. With --plot, a PNG of the speedups by shape
(needs matplotlib).

Eager rows whose layer takes the eager fast path (fp8train.eager: CUDA, dynamic tensorwise)
also time the same layer held to the general path in the same rounds:
fp8_general_path_time_sec, and fast_path_gain (that time over fp8_time_sec).

fp8_device_speedup and torchao_device_speedup compare the layers' work on the device alone
(the kernels' CUDA time from torch.profiler; on a CPU, the operators' own time). A layer
timed by itself can be host-bound: small layers, and compiled ones, whose wrapper costs
most of a millisecond of host time per fwd+bwd. Inside a compiled block of a model, with the
host running ahead, its device time is what the layer costs.

Every row also says what `fp8train.auto_filter` decides for that layer (its tokens, the row's
recipe and mode): `auto_filter` True converts it, and `auto_filter_speedup` is the layer's
speedup with the filter on: fp8_speedup where it converts, 1 (the layer stays in high
precision) where it does not; `auto_filter_device_speedup` is the same by device time.
Eager on a GPU the filter models this host: its host time per float8 layer is measured
(`CostModel.measure_host`, a 256 x 256 x 256 layer's fwd+bwd) and shown as fp8_host_time_sec.
`--model` times the layers of a model of this repository at its tokens per step, so the
slowest row of those columns answers "with the auto filter on, is any layer of this model
slower than in bf16?".
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import statistics

import torch
import torch._inductor.config
from torch import nn

import fp8train.eager
import fp8train.kernels.cast
from benchmarks.utils import (
    PASS_VARIANTS,
    delayed_config,
    device_time_s,
    fp8_peak_tflops,
    general_path,
    inductor_options,
    inductor_pass_as,
    markdown_table,
    median_time_s,
    print_environment,
    with_fast_backward,
    with_pass_variant,
    write_csv,
)
from fp8train import (
    DelayedScalingConfig,
    Float8Linear,
    Float8LinearConfig,
    Float8LinearRecipeName,
    auto_filter,
    compute_error,
    sync_float8_amax_and_scale_history,
)
from fp8train.filters import CostModel
from fp8train.models import ModelArgs, Transformer, llama_ffn_dim

try:
    import torchao.float8 as torchao_float8
except ImportError:
    torchao_float8 = None

LLAMA_70B_SHAPES = {
    "attn.wqkv": (16384, 8192, 1280),
    "attn.w0": (16384, 1024, 8192),
    "ffn.w13": (16384, 8192, 7168),
    "ffn.w2": (16384, 3584, 8192),
}


def _models() -> dict[str, tuple[ModelArgs, int]]:
    """Models of this repository, one block's layers and lm_head, at their tokens per step,
    read from their presets: e2e is examples/train_llama.py --preset h200, demo is
    `python -m fp8train demo` on CUDA. (The head count does not change a linear's shape.)"""
    from examples.train_llama import PRESETS as E2E_PRESETS
    from fp8train.demo import PRESETS as DEMO_PRESETS

    e2e, demo = E2E_PRESETS["h200"], DEMO_PRESETS["cuda"]
    return {
        "e2e": (
            ModelArgs(dim=e2e["dim"], n_layers=1, n_heads=e2e["n_heads"], ffn_dim=e2e["ffn_dim"]),
            e2e["batch_size"] * e2e["seq_len"],
        ),
        "demo": (
            ModelArgs(dim=demo["dim"], n_layers=1, ffn_dim=llama_ffn_dim(demo["dim"])),
            demo["batch_size"] * demo["seq_len"],
        ),
    }


MODELS = _models()


def model_shapes(args: ModelArgs, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of each distinct linear layer of `args`' model, named by the layers that share
    it (wq/wk/wv/wo)."""
    with torch.device("meta"):
        model = Transformer(args)
    names: dict[tuple[int, int], list[str]] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            names.setdefault((module.in_features, module.out_features), []).append(
                fqn.rsplit(".", 1)[-1]
            )
    return {"/".join(layers): (tokens, k, n) for (k, n), layers in names.items()}


ROUNDS = 3
"""Each timing is the median of this many interleaved rounds (ref, ours, torchao, ref, ...)."""


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, graphs: bool = False):  # noqa: ANN201
    if not graphs:

        def run() -> None:
            layer(x).backward(grad)

        return run

    def run_graphed() -> None:
        # CUDA graphs (compile mode reduce-overhead): a step's gradients live in the graphs'
        # memory, which the next replay overwrites, so none is accumulated into.
        torch.compiler.cudagraph_mark_step_begin()
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(grad)

    return run_graphed


# The recipes torchao.float8 names alike: timed beside ours in the same run.
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

COMPILED_CASTS = {"kernels": True, "kernels-no-input": ("weight", "grad_output")}
"""--compiled-casts choices besides inductor's: Float8LinearConfig.compiled_cast_kernels."""


def bench_shape(
    name,
    m,
    k,
    n,
    ref_dtype,
    compiled,
    recompute,
    recipe,
    device,
    scaling="dynamic",
    cast_kernels=None,
    compile_mode="default",
    saturation="satfinite",
    fast_backward=False,
):  # noqa: ANN001, ANN201, PLR0913
    """One row; `cast_kernels`: a key of COMPILED_CASTS, or None for inductor's casts;
    `compile_mode`: torch.compile's mode for every layer of a compiled row; `saturation`:
    "clamp" compiles fp8train's casts as inductor writes them, with their clamp and float
    amaxes (Float8LinearConfig.compiled_satfinite and compiled_integer_amax off,
    fp8train.inductor's pass uninstalled); "float-amax" without the integer amaxes only
    (compiled_integer_amax off); "satfinite" and "integer-amax" are the defaults (both on).
    `fast_backward`: fast accumulation in the grad_input and grad_weight gemms too, for
    fp8train and torchao.float8 alike (recipe "+fast-accum")."""
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=False, device=device, dtype=ref_dtype)
    if scaling.startswith("delayed"):
        one_pass = scaling == "delayed-one-pass"
        config = delayed_config(
            recompute_weight_cast=recompute,
            delayed_scaling_config=DelayedScalingConfig(compiled_one_pass=one_pass),
        )
        recipe = f"tensorwise-{scaling}"
    else:
        config = Float8LinearConfig.from_recipe_name(recipe, recompute_weight_cast=recompute)
    if cast_kernels:
        config = dataclasses.replace(config, compiled_cast_kernels=COMPILED_CASTS[cast_kernels])
        recipe = f"{recipe}+cast-{cast_kernels}"
    config = with_pass_variant(config, saturation)
    if saturation != "satfinite":
        recipe = f"{recipe}+{saturation}"
    torchao_recipe = recipe
    if fast_backward:
        config = with_fast_backward(config)
        recipe = f"{recipe}+fast-accum"
    fp8_layer = Float8Linear.from_float(copy.deepcopy(ref), config)
    inductor_pass_as(config)  # a layer of an earlier row may have installed another
    layers = {"ref": ref, "fp8": fp8_layer}
    # torchao.float8's rowwise recipes need CUDA's rowwise scaled gemm: on another device
    # only its tensorwise recipe runs beside ours.
    torchao_runs = torchao_recipe in TORCHAO_RECIPES and (
        torch.device(device).type == "cuda" or torchao_recipe == "tensorwise"
    )
    if torchao_float8 is not None and torchao_runs:
        ao_config = torchao_float8.Float8LinearConfig.from_recipe_name(torchao_recipe)
        if fast_backward:
            ao_config = with_fast_backward(ao_config, torchao_float8.Float8GemmConfig)
        layers["torchao"] = torchao_float8.convert_to_float8_training(
            nn.Sequential(copy.deepcopy(ref)), config=ao_config
        )
    x = torch.randn(m, k, device=device, dtype=ref_dtype, requires_grad=True)
    if compiled:
        torch._dynamo.reset()
        layers = {key: torch.compile(layer, mode=compile_mode) for key, layer in layers.items()}
    elif fp8_layer._takes_eager_path(x):
        # The same layer held to the general path, timed in the same rounds: the fast path's
        # gain on this host (hosts differ from run to run by more than it).
        layers["fp8_general"] = general_path(fp8_layer)
    grad = torch.randn(m, n, device=device, dtype=ref_dtype)
    times: dict[str, list[float]] = {key: [] for key in layers}

    def step(key: str, layer: nn.Module):  # noqa: ANN202
        graphs = compiled and compile_mode == "reduce-overhead"
        if key != "fp8" or not scaling.startswith("delayed"):
            return fwd_bwd(layer, x, grad, graphs)
        fwd_bwd_step = fwd_bwd(layer, x, grad, graphs)

        def run() -> None:  # delayed scaling: the once-per-step sync belongs to the step
            fwd_bwd_step()
            sync_float8_amax_and_scale_history(fp8_layer)

        return run

    for _ in range(ROUNDS):
        for key, layer in layers.items():
            times[key].append(median_time_s(step(key, layer), device))
    t = {key: statistics.median(values) for key, values in times.items()}
    general = layers.pop("fp8_general", None)
    busy = {key: device_time_s(step(key, layer), device) for key, layer in layers.items()}
    # A guard on the timed code itself: each float8 output against the reference's (dB).
    with torch.no_grad():
        want = layers["ref"](x)
        sqnr = {key: compute_error(want, layers[key](x)).item() for key in layers if key != "ref"}
    # Eager where the host bounds small layers (the GPU), the filter's host time per layer is
    # this host's (CostModel.measure_host).
    costs = None
    if not compiled and torch.device(device).type in fp8train.eager.EAGER_DEVICES:
        costs = CostModel.measure_host(device, config=config, dtype=ref_dtype)
    converts = auto_filter(m, config=config, compiled=compiled, model=costs)(ref, name)
    row = {
        "name": name,
        "shape": f"({m}, {k}, {n})",
        "ref_dtype": str(ref_dtype).removeprefix("torch."),
        "compiled": compiled,
        "compile_mode": compile_mode if compiled else None,
        "recompute_weight_cast": recompute,
        "recipe": recipe,
        "ref_time_sec": t["ref"],
        "fp8_time_sec": t["fp8"],
        "fp8_speedup": t["ref"] / t["fp8"],
        "fp8_sqnr_db": sqnr["fp8"],
        "auto_filter": converts,
        "auto_filter_speedup": t["ref"] / t["fp8"] if converts else 1.0,
        "fp8_device_speedup": busy["ref"] / busy["fp8"],
        "auto_filter_device_speedup": busy["ref"] / busy["fp8"] if converts else 1.0,
    }
    if costs is not None:
        row["fp8_host_time_sec"] = costs.eager_cpu_s
    if general is not None:
        row |= {
            "fp8_general_path_time_sec": t["fp8_general"],
            "fast_path_gain": t["fp8_general"] / t["fp8"],
        }
    if "torchao" in t:
        row |= {
            "torchao_time_sec": t["torchao"],
            "torchao_speedup": t["ref"] / t["torchao"],
            "vs_torchao": t["torchao"] / t["fp8"],
            "torchao_sqnr_db": sqnr["torchao"],
            "torchao_device_speedup": busy["ref"] / busy["torchao"],
        }
    return row


def add_peak(rows: list[dict], peak_tflops: float | None) -> None:
    for row in rows:
        m, k, n = (int(v) for v in row["shape"].strip("()").split(", "))
        flops = 6 * m * k * n
        row["pct_fp8_peak"] = (
            100 * flops / row["fp8_time_sec"] / (peak_tflops * 1e12) if peak_tflops else None
        )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['name']}\n{r['recipe']}{' c' if r['compiled'] else ''}" for r in rows]
    figure, axes = plt.subplots(figsize=(max(6, len(rows)), 4))
    axes.bar(range(len(rows)), [r["fp8_speedup"] for r in rows], label="fp8train", width=0.4)
    if any("torchao_speedup" in r for r in rows):
        axes.bar(
            [i + 0.4 for i in range(len(rows))],
            [r.get("torchao_speedup", 0) for r in rows],
            label="torchao.float8",
            width=0.4,
        )
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(rows)), labels, fontsize=7)
    axes.set_ylabel("fwd+bwd speedup over the reference dtype")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=150)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("M", "K", "N"))
    parser.add_argument("--sweep", action="store_true", help="M=16384, K and N in 1024..8192")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        help="the layers of a model of this repository at its tokens per step: e2e "
        "(examples/train_llama.py --preset h200), demo (python -m fp8train demo on CUDA)",
    )
    parser.add_argument("--ref-dtypes", nargs="+", default=None, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--compile", choices=["off", "on", "both"], default="both")
    parser.add_argument(
        "--compile-mode",
        nargs="+",
        default=["default"],
        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
        help="torch.compile's mode for the compiled rows, the same for every layer of a row; "
        "reduce-overhead replays each step as CUDA graphs, which takes away the host's "
        "launch work that bounds a small or thin layer timed alone",
    )
    parser.add_argument("--recompute", choices=["on", "off", "both"], default="on")
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=["tensorwise"],
        choices=["all", *(r.value for r in Float8LinearRecipeName)],
        help="float8 recipes to time (all: every named recipe)",
    )
    parser.add_argument(
        "--scaling",
        nargs="+",
        default=["dynamic"],
        choices=["dynamic", "delayed", "delayed-one-pass"],
        help="delayed: tensorwise delayed scaling (the sync timed as part of the step); "
        "delayed-one-pass: the same with DelayedScalingConfig(compiled_one_pass=True)",
    )
    parser.add_argument(
        "--compiled-casts",
        nargs="+",
        default=["inductor"],
        choices=["inductor", *COMPILED_CASTS],
        help="compiled rows: casts generated by inductor, or fp8train's kernels as triton ops "
        "(Float8LinearConfig(compiled_cast_kernels=True); tensorwise recipes); kernels-no-input: "
        "the kernels for the weight and grad_output only, the input's cast inductor's",
    )
    parser.add_argument(
        "--saturation",
        nargs="+",
        default=["satfinite"],
        choices=PASS_VARIANTS,
        help="compiled rows: fp8train's inductor pass as configs have it by default (the "
        "casts' saturation left to Triton's conversion, amaxes as integer maxima: "
        "Float8LinearConfig.compiled_satfinite and compiled_integer_amax; integer-amax names "
        "the same), clamp: without the pass, as inductor writes the casts, or float-amax: the "
        "pass without its integer amaxes",
    )
    parser.add_argument(
        "--cast-tile",
        nargs=3,
        type=int,
        metavar=("BLOCK_M", "BLOCK_N", "WARPS"),
        help="the cast kernel's tile for this run (fp8train.kernels.cast.TILE; "
        "python -m benchmarks.bench_cast --tiles times them)",
    )
    parser.add_argument(
        "--fp8-peak-tflops",
        type=float,
        default=None,
        help="dense float8 peak for the %% column (default: 1979 on H100/H200, else none)",
    )
    parser.add_argument(
        "--inductor",
        nargs="+",
        metavar="KEY=VALUE",
        help="torch._inductor.config options for every compiled row, bf16 and torchao.float8 "
        "included, by their dotted names, values as Python literals: for example "
        "coordinate_descent_tuning=True",
    )
    parser.add_argument(
        "--autograd-threads",
        choices=["on", "off"],
        default="on",
        help="torch.autograd.set_multithreading_enabled for every row: on (torch's default) "
        "runs backward on the engine's thread for the GPU, off on the calling thread; on some "
        "hosts an eager float8 layer's backward costs twice the host time on the engine's "
        "thread (docs/speed.md)",
    )
    parser.add_argument(
        "--backward-accum",
        nargs="+",
        default=["exact"],
        choices=["exact", "fast"],
        help="accumulation of the grad_input and grad_weight gemms: exact (the default "
        "config's) or fast (Float8GemmConfig(use_fast_accum=True), recipe '+fast-accum'), for "
        "fp8train and torchao.float8 alike; the output gemm has fast accumulation in both",
    )
    parser.add_argument("--csv")
    parser.add_argument("--plot", help="write a PNG of the speedups to this path")


def main(args: argparse.Namespace) -> None:
    options = inductor_options(args.inductor)
    threads = args.autograd_threads == "on"
    with torch._inductor.config.patch(options), torch.autograd.set_multithreading_enabled(threads):
        _main(args, options)


def _main(args: argparse.Namespace, inductor: dict) -> None:
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    ref_names = args.ref_dtypes or (["bf16"] if args.device == "cuda" else ["fp32"])
    if args.shape:
        shapes = {f"custom{i}": tuple(s) for i, s in enumerate(args.shape)}
    elif args.model:
        shapes = model_shapes(*MODELS[args.model])
    elif args.sweep:
        sizes = (1024, 2048, 4096, 8192)
        shapes = {f"sweep{k}x{n}": (16384, k, n) for k, n in itertools.product(sizes, sizes)}
    else:
        shapes = LLAMA_70B_SHAPES
    peak = fp8_peak_tflops(args.device, args.fp8_peak_tflops)
    compiled = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    recompute = {"on": [True], "off": [False], "both": [True, False]}[args.recompute]

    if args.cast_tile:
        fp8train.kernels.cast.TILE = tuple(args.cast_tile)
    print_environment()
    print(f"- cast kernel tile: {fp8train.kernels.cast.TILE}")
    print(f"- torch._inductor.config options: {inductor or 'defaults'}")
    threads = args.autograd_threads
    print(f"- autograd multithreading (backward on the engine's device thread): {threads}")
    print(f"- torchao.float8: {'importable' if torchao_float8 else 'not importable'}\n")
    names = [r.value for r in Float8LinearRecipeName] if "all" in args.recipes else args.recipes
    recipes = [(recipe, "dynamic") for recipe in names if "dynamic" in args.scaling]
    recipes += [("tensorwise", s) for s in ("delayed", "delayed-one-pass") if s in args.scaling]
    rows = []
    kernels = [casts if casts in COMPILED_CASTS else None for casts in args.compiled_casts]
    modes = [(False, "default")] * (False in compiled)
    modes += [(True, mode) for mode in args.compile_mode] * (True in compiled)
    fast = [accum == "fast" for accum in args.backward_accum]
    grid = itertools.product(
        shapes.items(), ref_names, modes, recompute, recipes, kernels, args.saturation, fast
    )
    for (name, (m, k, n)), ref, (c, mode), r, (recipe, scaling), kern, sat, fast_accum in grid:
        if kern and not (c and recipe == "tensorwise"):
            continue  # eager casts are the kernels already; rowwise casts stay inductor's
        if sat != "satfinite" and not c:
            continue  # eager mode has no inductor pass
        rows.append(
            bench_shape(
                name, m, k, n, dtypes[ref], c, r, recipe, args.device, scaling, kern, mode, sat,
                fast_accum,
            )
        )  # fmt: skip
        # One line per row as it is timed, so that a run cut short still shows its rows.
        print(", ".join(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    add_peak(rows, peak)
    print(markdown_table(rows, list(dict.fromkeys(key for row in rows for key in row))))
    geomean = statistics.geometric_mean(r["fp8_speedup"] for r in rows)
    print(f"\ngeometric mean fp8_speedup over {len(rows)} rows: {geomean:.3f}x")
    print(f"with auto_filter: {sum(r['auto_filter'] for r in rows)} of {len(rows)} rows converted")
    for column in ("auto_filter_speedup", "auto_filter_device_speedup"):
        slowest = min(rows, key=lambda row: row[column])
        print(
            f"- slowest by {column}: {slowest[column]:.3f}x ({slowest['name']}, "
            f"compiled={slowest['compiled']})"
        )
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
