"""Train a LLaMA-style decoder on real text in bf16, in float8 (each recipe) and, when it is
importable, with torchao.float8; compare loss, tokens/s and peak memory.

    python -m examples.train_llama                       # the preset of this machine
    python -m examples.train_llama --preset h200 --configs bf16 tensorwise torchao-tensorwise
    python -m fp8train train-llama ...                   # the same, from a checkout

The text is byte-level and ships with Python (fp8train.data), so nothing is downloaded:
--corpus docs is the reference documentation in pydoc_data, --corpus stdlib (the h200
preset's) adds the standard library's sources, enough text that the preset's model does not
memorize it within a run. Every run starts from the same weights
and sees the same batches; the validation windows are held-out text. Each transformer block is
compiled on its own with --compile (fullgraph), wrapped in activation checkpointing with --ac.
With --grad-accum N each optimizer step runs N micro-batches; the float8 runs cast each weight
once per optimizer step (fp8train.cast_weights_once), torchao's once per micro-batch.

Prints a markdown table (tokens/s, peak memory, final train and validation loss, each against
bf16) and writes the loss curves as a PNG with --plot (needs matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch._inductor import config as inductor_config
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from benchmarks.utils import environment, inductor_options
from examples.e2e_report import (
    BASE_NAMES,
    base_label,
    caption_of,
    caption_of_files,
    load_runs,
    plot,
    plot_differences,
    print_seed,
    print_summary,
    seeds_with,
)
from examples.llama_configs import CONFIGS, convert, torchao_float8
from fp8train import cast_weights_once, sync_float8_amax_and_scale_history
from fp8train.data import CORPORA, batches, eval_batches, load_text_tokens, train_val_split
from fp8train.demo import (
    DTYPES,
    FLOAT16_PARAMETERS,
    evaluate,
    lm_loss,
    misaligned_tokens,
    synchronize,
    usable_device,
)
from fp8train.demo import lr_at as demo_lr_at
from fp8train.models import ModelArgs, Transformer

PRESETS: dict[str, dict[str, Any]] = {
    # Minutes on two CPU cores: the float8 path through torch._scaled_mm on the CPU.
    "cpu": dict(dim=128, n_layers=2, n_heads=4, ffn_dim=352, seq_len=128, batch_size=8,
                steps=150, lr=3e-3, dtype="float32", corpus="docs"),
    # The model: 6 layers, d=4096, 32 heads, FFN 14336, seq 4096, batch 2. lr 1e-4:
    # at 3e-4 (15 warm-up steps) every run's loss spiked from 6 to 15-17 and the runs then
    # drifted apart by up to 11%, bf16 among them (benchmarks/results/e2e_h200_2026-12-03.md).
    # The docs corpus (~0.4M training tokens) is 6 passes at 300 steps of 8k tokens: the model
    # memorizes it (1000 steps: train loss 0.02, validation loss rising), so this preset
    # trains on the standard library's sources too (~11M training tokens).
    "h200": dict(dim=4096, n_layers=6, n_heads=32, ffn_dim=14336, seq_len=4096, batch_size=2,
                 steps=300, lr=1e-4, dtype="bfloat16", corpus="stdlib"),
}  # fmt: skip

WARMUP_STEPS = 5
"""Steps left out of tokens/s (compilation, the allocator's growth, delayed scaling's switch to
recorded scales), each waited for; the steps after them run back to back and are timed
together."""
FINAL_STEPS = 20
"""The final train loss is the mean over this many last steps."""


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward instead of kept."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, cos, sin, use_reentrant=False)


def prepare(model: Transformer, args: argparse.Namespace) -> Transformer:
    """Activation checkpointing and per-block compilation, as large-model training does."""
    for i, block in enumerate(model.layers):
        block = Checkpointed(block) if args.ac else block
        if args.compile:
            block.compile(fullgraph=True)
        model.layers[i] = block
    return model


def parameter_dtype(args: argparse.Namespace) -> torch.dtype:
    """The parameters' (and so the optimizer state's) dtype: fp32 with --master-weights."""
    return torch.float32 if args.master_weights else DTYPES[args.dtype]


def mixed_precision(args: argparse.Namespace):  # noqa: ANN201
    """The context of forward: with --master-weights, autocast to --dtype (the gemms, and
    the float8 layers' inputs before their casts, in bf16; weights cast from fp32), else
    nothing. Reusable: entered once per micro-batch and once to evaluate."""
    if not args.master_weights:
        return nullcontext()
    return torch.autocast(torch.device(args.device).type, dtype=DTYPES[args.dtype])


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over --warmup-steps (default: 5% of the steps), then cosine decay to
    10% (the demo's schedule)."""
    return demo_lr_at(step, args.steps, args.lr, args.warmup_steps)


def optimizer_and_update(model: nn.Module, args: argparse.Namespace):  # noqa: ANN201
    """AdamW, and the update of a step: the gradients clipped to norm 1, then the
    optimizer's step. On CUDA AdamW is fused (one kernel over every parameter); with
    --compile-optimizer one torch.compile covers both instead (inductor's kernels; torch's
    optimizers make the step a graph of its own), the learning rate a tensor so that
    changing it does not recompile."""
    params = list(model.parameters())
    compiled = args.compile_optimizer
    device = params[0].device
    optimizer = torch.optim.AdamW(
        params,
        lr=torch.tensor(args.lr) if compiled else args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=device.type == "cuda" and not compiled,
    )

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return optimizer, torch.compile(update) if compiled else update


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of every group: in place where it is a tensor (a compiled step's)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def train(
    name: str, initial: Transformer, data: dict, args: argparse.Namespace, seed: int = 0
) -> dict:
    """One run of `name` from `initial`'s weights, on the batches that `seed` draws."""
    device = torch.device(args.device)
    model = copy.deepcopy(initial).to(device=device, dtype=parameter_dtype(args))
    model = prepare(convert(model, name), args)
    compute = mixed_precision(args)
    optimizer, update = optimizer_and_update(model, args)
    ours = not name.startswith(("bf16", "torchao-"))
    stream = batches(
        data["train"], args.batch_size, args.seq_len, torch.Generator().manual_seed(seed)
    )
    # The first WARMUP_STEPS steps (compilation, the allocator's growth, delayed scaling's
    # switch to its recorded scales) wait for the device after each step; the timed steps
    # after them run back to back, as training does, and their losses are read at the end.
    warmup = WARMUP_STEPS if args.steps > WARMUP_STEPS else 0
    losses = []
    for step in tqdm(range(args.steps), desc=name, disable=args.quiet, leave=False):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        set_lr(optimizer, lr_at(step, args))
        once = cast_weights_once(model) if ours and args.grad_accum > 1 else nullcontext()
        total = torch.zeros((), device=device)
        with once:
            for _ in range(args.grad_accum):
                inputs, targets = (t.to(device, non_blocking=True) for t in next(stream))
                with compute:
                    loss = lm_loss(model, inputs, targets) / args.grad_accum
                loss.backward()
                total += loss.detach()
        if name.startswith("tensorwise-delayed"):
            sync_float8_amax_and_scale_history(model)
        update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if step < warmup:
            synchronize(device)
    synchronize(device)
    step_s = (time.perf_counter() - start) / (args.steps - warmup)
    losses = torch.stack(losses).tolist()
    tokens = args.batch_size * args.seq_len * args.grad_accum
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    with compute:  # after reading the peak, which is training's
        val_loss = evaluate(model, data["val"])
    result = {
        "config": name,
        "seed": seed,
        "losses": losses,
        "final_train_loss": sum(losses[-FINAL_STEPS:]) / len(losses[-FINAL_STEPS:]),
        "val_loss": val_loss,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tokens / step_s,
        "peak_memory_gib": peak,
    }
    del model, optimizer
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), help="model and run sizes (default: h200 on CUDA, "
        "cpu elsewhere); the options below override it")  # fmt: skip
    for key in ("dim", "n_layers", "n_heads", "ffn_dim", "seq_len", "batch_size", "steps"):
        add(f"--{key.replace('_', '-')}", type=int)
    add("--lr", type=float)
    add("--warmup-steps", type=int, help="steps of linear learning-rate warm-up (default: 5%% "
        "of --steps); the preset's model spikes early with 15 of 300, not with 100, and ends "
        "at the same loss with either")  # fmt: skip
    add("--dtype", choices=sorted(DTYPES))
    add("--master-weights", action="store_true", help="fp32 parameters and optimizer state, "
        "forward under torch.autocast to --dtype (mixed precision, as FSDP2's "
        "MixedPrecisionPolicy trains): the optimizer's updates are not rounded to bf16. For "
        "loss comparisons; tokens/s and memory are pure bf16's without it")  # fmt: skip
    add("--corpus", choices=CORPORA, help="the text (fp8train.data): docs, or stdlib "
        "(docs + the standard library's sources, for models that memorize docs)")  # fmt: skip
    add("--configs", nargs="+", choices=CONFIGS, help="runs, in this order (bf16 first if "
        "not named; a config named twice runs twice; default: bf16, tensorwise, rowwise, and "
        "torchao-tensorwise when torchao is importable)")  # fmt: skip
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--compile", action="store_true", help="torch.compile each transformer block")
    add("--ac", action="store_true", help="activation checkpointing of each block")
    add("--compile-optimizer", action="store_true", help="torch.compile the gradient "
        "clip and AdamW's step together (all configs; else AdamW is fused on CUDA)")  # fmt: skip
    add("--eval-batches", type=int, default=8)
    add("--seed", type=int, default=0, help="initial weights and batch order")
    add("--seeds", type=int, nargs="+", help="run every config once per seed, and summarize "
        "the loss differences over the seeds (instead of --seed)")  # fmt: skip
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--plot", help="write the loss curves to this PNG")
    add("--json", help="write every run's losses and figures to this JSON file")
    add("--quiet", action="store_true", help="no progress bars")
    add("--deterministic", action="store_true", help="torch's deterministic algorithms "
        "(strict) and a fixed cuBLAS workspace: a config run twice lands on the same losses, "
        "where the ops allow it (slower)")  # fmt: skip
    add("--full-precision-reductions", action="store_true", help="bf16 and fp16 gemms "
        "reduce in fp32 only (torch allows reduced-precision split-K by default)")  # fmt: skip
    add("--inductor", nargs="+", metavar="KEY=VALUE", help="torch._inductor.config options "
        "for every run, by their dotted names, values as Python literals: for example "
        "coordinate_descent_tuning=True triton.tile_reductions=True")  # fmt: skip


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    device = usable_device(args.device, "train-llama")
    preset = PRESETS[args.preset or ("h200" if device.type == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.configs is None:
        args.configs = ["bf16", "tensorwise", "rowwise"]
        if torchao_float8 is not None:
            args.configs.append("torchao-tensorwise")
    if "bf16" not in args.configs:  # every run is compared with a baseline of its seed
        args.configs = ["bf16", *args.configs]
    for name in ("steps", "batch_size", "seq_len", "grad_accum"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    problem = misaligned_tokens(args.batch_size, args.seq_len, "micro-batch")
    if problem and any(config != "bf16" for config in args.configs):
        raise SystemExit(problem)
    if args.warmup_steps is not None and not 1 <= args.warmup_steps <= args.steps:
        raise SystemExit(
            f"--warmup-steps {args.warmup_steps}: give 1 to --steps ({args.steps}), or leave it "
            "out for 5% of the steps"
        )
    if DTYPES[args.dtype] == torch.float16 and not args.master_weights:
        raise SystemExit(
            f"--dtype float16: {FLOAT16_PARAMETERS}: give --dtype bfloat16, or add "
            "--master-weights (fp32 parameters under a float16 forward; no loss scaling)"
        )
    if args.master_weights and DTYPES[args.dtype] == torch.float32:
        raise SystemExit(
            "--master-weights keeps fp32 parameters under a lower-precision forward, and "
            "--dtype float32 has fp32 parameters already: give --dtype bfloat16, or leave "
            "--master-weights out"
        )
    missing = [c for c in args.configs if c.startswith("torchao-") and torchao_float8 is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)}: torchao is not importable (pip install torchao)")
    return args


@contextmanager
def deterministic_algorithms(enabled: bool):  # noqa: ANN201
    """With `enabled`, torch's deterministic algorithms (strict: an op that has none raises,
    naming itself) and cuBLAS's fixed workspace, for the duration; the previous setting
    after. A run's differences from another are then the configs' own, not those of kernels
    that sum in a different order each time (flash attention's backward among them)."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    # Read when cuBLAS makes its handle, which no CUDA work has needed before main's runs.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


@contextmanager
def full_precision_reductions(enabled: bool):  # noqa: ANN201
    """With `enabled`, no reduced-precision reductions in bf16 and fp16 gemms for the
    duration (cuBLAS may otherwise pick split-K kernels that add partial sums in bf16), the
    previous setting after: a check of whether cuBLAS's choices move a run's loss."""
    matmul = torch.backends.cuda.matmul
    before = (
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
    if enabled:
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (
            matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction,
        ) = before


def write_json(args: argparse.Namespace, run_environment: dict, rows: list[dict]) -> None:
    # Output files by name alone: where they were written says nothing about the runs, and
    # the files are shared.
    outputs = {k: os.path.basename(v) for k in ("json", "plot") if (v := getattr(args, k, None))}
    with open(args.json, "w") as handle:
        record = {"args": vars(args) | outputs | {"func": None}, "environment": run_environment}
        json.dump(record | {"runs": rows}, handle)


def main(args: argparse.Namespace) -> list[dict]:
    args = resolve(args)
    inductor = inductor_options(args.inductor)
    device = torch.device(args.device)
    parameters = (
        f"fp32 parameters, {args.dtype} autocast" if args.master_weights
        else f"{args.dtype} parameters"
    )  # fmt: skip
    print(
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} | "
        f"torch {torch.__version__} | model: {args.n_layers} layers, dim {args.dim}, "
        f"{args.n_heads} heads, FFN {args.ffn_dim}, seq {args.seq_len}, batch {args.batch_size}"
        f" x {args.grad_accum} micro-batches, {args.steps} steps, {parameters}, "
        f"compile={args.compile}, ac={args.ac}" + (f", inductor {inductor}" if inductor else "")
    )
    train_tokens, val_tokens = train_val_split(load_text_tokens(args.corpus))
    print(
        f"corpus {args.corpus}: {len(train_tokens)} training tokens "
        f"({args.steps * args.grad_accum * args.batch_size * args.seq_len / len(train_tokens):.2f}"
        f" passes over them), {len(val_tokens)} validation tokens"
    )
    fits = len(val_tokens) // (args.batch_size * (args.seq_len + 1))
    data = {
        "train": train_tokens,
        "val": eval_batches(
            val_tokens, args.batch_size, args.seq_len, max(1, min(args.eval_batches, fits))
        ),
    }
    model_args = ModelArgs(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, ffn_dim=args.ffn_dim,
        max_seq_len=args.seq_len,
    )  # fmt: skip
    rows = []
    run_environment = environment()
    seeds = args.seeds or [args.seed]
    base_name = BASE_NAMES[args.dtype]
    for seed in seeds:
        torch.manual_seed(seed)
        with torch.device("cpu"):
            initial = Transformer(model_args)
        for name in args.configs:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            torch._dynamo.reset()
            with (
                deterministic_algorithms(args.deterministic),
                full_precision_reductions(args.full_precision_reductions),
                inductor_config.patch(inductor),
            ):
                rows.append(train(name, initial, data, args, seed))
            row = rows[-1]
            peak = row["peak_memory_gib"]  # None off a GPU: no allocator statistics
            print(
                f"{base_label(name, base_name)} (seed {seed}): {row['tokens_per_s']:.0f} "
                f"tokens/s, peak {'n/a' if peak is None else f'{peak:.2f} GiB'}, final train "
                f"loss {row['final_train_loss']:.4f}, val loss {row['val_loss']:.4f}",
                flush=True,
            )
            if args.json:  # after every run, so that an interrupted comparison keeps its runs
                write_json(args, run_environment, rows)
        print_seed(rows, seed, base_name)
    print_summary(rows, base_name)
    if args.plot:
        plot(rows, args.plot, caption_of(run_environment), base_name=base_name)
        print(f"loss curves: {args.plot}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--plot-json", help="only plot a --json file of an earlier run to --plot")
    parser.add_argument("--caption", help="with --plot-json (default: the file's) or "
                        "--summarize-json (default: the files' devices, torch versions and "
                        "dates, and this command): the plot's caption")  # fmt: skip
    parser.add_argument(
        "--summarize-json",
        nargs="+",
        metavar="JSON",
        help="only print the tables of earlier runs' --json files, one summary over their "
        "seeds; with --plot, each run's validation loss difference by config",
    )
    parser.add_argument(
        "--against",
        choices=CONFIGS,
        default="bf16",
        help="with --summarize-json: compare every run with this config's run of the same "
        "seed instead of bf16's (seeds without one are left out); for example one float8 "
        "config against another",
    )
    parsed = parser.parse_args()
    if parsed.summarize_json:
        runs, base = load_runs(parsed.summarize_json)
        against = parsed.against
        compared = seeds_with(runs, against)
        for seed in dict.fromkeys(run["seed"] for run in runs):
            if seed not in compared:
                print(f"seed {seed}: no {against} run, left out")
                continue
            print(f"seed {seed}:")
            print_seed(runs, seed, base, against)
        print_summary(runs, base, against)
        if parsed.plot:
            caption = parsed.caption or caption_of_files(parsed.summarize_json)
            plot_differences(runs, base, parsed.plot, caption, against=against)
            print(f"differences by seed: {parsed.plot}")
    elif parsed.plot_json:
        with open(parsed.plot_json) as handle:
            record = json.load(handle)
        caption = parsed.caption or caption_of(record.get("environment", {}))
        base_name = BASE_NAMES[record.get("args", {}).get("dtype", "bfloat16")]
        plot(record["runs"], parsed.plot or "loss.png", caption, base_name=base_name)
    else:
        main(parsed)
