"""Train the same small language model in high precision and in float8, and compare.

Both runs start from the same weights and see the same batches in the same order, so the loss
gap between them is the cost of float8 alone. The runs go one after the other rather than
interleaved: each then gets its own CUDA peak-memory reading and its step times are not
disturbed by the other model's caches.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import platform
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from tqdm import tqdm

from fp8train import (
    CostModel,
    Float8Linear,
    Float8LinearConfig,
    __version__,
    auto_filter,
    convert_to_float8_training,
    stats,
)
from fp8train.data import batches, eval_batches, load_text_tokens, train_val_split
from fp8train.gemm import ALIGNMENT
from fp8train.models import ModelArgs, Transformer, llama_ffn_dim

WARMUP_STEPS = 3
"""Steps left out of the mean step time: they include allocator growth and, with --compile,
compilation."""

FINAL_LOSS_STEPS = 10
"""The final train loss is the mean over this many last steps: one batch's loss is noisy."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT16_PARAMETERS = (
    "AdamW cannot train float16 parameters without fp32 master weights and loss scaling (its "
    "eps, 1e-8, and the squares of small gradients are 0 in float16: the first step makes "
    "inf weights and every loss NaN)"
)


# Defaults per device type: on the CPU the demo must finish in well under 2 minutes on two
# cores; on a GPU in a few minutes, with real float8 gemms. Both models are too small for
# float8 to be faster than high precision: the note after the table says why (speed_note).
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"steps": 250, "batch_size": 16, "seq_len": 128, "dim": 128, "n_layers": 2, "lr": 3e-3},
    "cuda": {
        "steps": 300,
        "batch_size": 8,
        "seq_len": 1024,
        "dim": 1024,
        "n_layers": 8,
        "lr": 1e-3,
    },
}


def _preset_help(text: str, key: str) -> str:
    return f"{text} (default: {PRESETS['cpu'][key]} on the CPU, {PRESETS['cuda'][key]} on CUDA)"


def usable_device(name: str, command: str = "demo") -> torch.device:
    """The torch device `name`, or an exit (naming the CLI `command`) that says why it cannot
    be used here."""
    try:
        device = torch.device(name)
        torch.empty(1, device=device)
        if device.type == "meta":
            raise ValueError("meta tensors hold no data to train on")
    except (RuntimeError, AssertionError, ValueError) as error:
        reason = str(error).strip().splitlines()[0]
        if len(reason) > 160:  # torch's backend errors list every dispatch key: the gist
            reason = reason.split(". ")[0]
        default = "cuda" if torch.cuda.is_available() else "the CPU"
        raise SystemExit(
            f"fp8train {command}: --device {name} cannot be used here ({reason}); leave --device "
            f"out to run on {default}"
        ) from None
    return device


def apply_presets(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset with the preset of the run's device type."""
    preset = PRESETS["cuda" if usable_device(args.device).type == "cuda" else "cpu"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    add = parser.add_argument
    add("--steps", type=int, help=_preset_help("training steps per run", "steps"))
    add("--batch-size", type=int, help=_preset_help("sequences per batch", "batch_size"))
    add("--seq-len", type=int, help=_preset_help("tokens per sequence", "seq_len"))
    add("--dim", type=int, help=_preset_help("model dim, a multiple of 16", "dim"))
    add("--n-layers", type=int, help=_preset_help("transformer blocks", "n_layers"))
    add(
        "--lr",
        type=float,
        help=_preset_help(
            "peak AdamW learning rate (5%% warm-up, then cosine decay to a tenth)", "lr"
        ),
    )
    add("--seed", type=int, default=0, help="seed of weights and batches (default: %(default)s)")
    add("--device", default=default_device, help="torch device (default: %(default)s)")
    add(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="parameter dtype of the high-precision model and of the float8 model's "
        "non-float8 parts; auto: bfloat16 on CUDA, float32 elsewhere (default: %(default)s)",
    )
    add("--compile", action="store_true", help="torch.compile each model")
    add(
        "--emulate",
        action="store_true",
        help="emulate the float8 gemms in fp32 instead of calling torch._scaled_mm (for GPUs "
        "without float8 units); the CPU runs the real scaled gemm by default",
    )
    add(
        "--recompute-weight-cast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recast the weight to float8 in backward instead of keeping the float8 copy from "
        "forward (default: %(default)s)",
    )
    add(
        "--recompute-input-cast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force keeping the high-precision input for backward and recasting it (on), or "
        "keeping it in float8 (off); unset, eager keeps float8 and torch.compile chooses",
    )
    add(
        "--stats",
        action="store_true",
        help="after training, print the numerics of every float8 cast (amax, scale, saturated "
        "and flushed shares, SQNR) for one step of the float8 model",
    )
    add("--eval-batches", type=int, default=8, help="validation batches (default: %(default)s)")
    add("--quiet", action="store_true", help="no progress bars")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 is the usual training dtype on GPUs; CPU bf16 matmuls are far slower than fp32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def float8_config(args: argparse.Namespace) -> Float8LinearConfig:
    return Float8LinearConfig(
        emulate=args.emulate,
        recompute_weight_cast=args.recompute_weight_cast,
        recompute_input_cast=args.recompute_input_cast,
    )


def _not_lm_head(module: nn.Module, fqn: str) -> bool:
    """The demo's module_filter_fn: every linear but the lm_head. The logits gemm is small but
    its errors hit the loss directly, so float8 recipes leave it in high precision."""
    return fqn != "lm_head"


def to_float8(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """Swap every linear but the lm_head (_not_lm_head)."""
    return convert_to_float8_training(
        model, config=float8_config(args), module_filter_fn=_not_lm_head
    )


def saved_activation_bytes(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes that one eager forward keeps alive for backward, seen through saved_tensors_hooks.
    Storages count once each (views share one), parameters not at all: they are alive anyway.
    Eager even under --compile: dynamo would trace the hooks and compile a graph just for them."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()

    def count(t: torch.Tensor) -> int:
        # A float8 tensor is a wrapper subclass without storage of its own: count its parts.
        if is_traceable_wrapper_subclass(t):
            return sum(count(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.data_ptr() in skip:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    total = 0
    # What the forward saves stays alive here until the count is done: a freed storage's
    # address would be reused by a later tensor, which the count would then skip as seen.
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> None:
        nonlocal total
        total += count(t)
        alive.append(t)
        # The graph itself keeps nothing: returning t would make a tensor that its own grad_fn
        # saves (an op's output) hold that node, a cycle through C++ that the garbage
        # collector cannot see, and the whole forward's activations would outlive this
        # function. The list is freed on return, with no such cycle.

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("saved_activation_bytes runs forward only")

    # Forward alone suffices (tensors are saved as it runs); the graph is freed on return.
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        lm_loss(model, inputs, targets)
    alive.clear()
    return total


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    # Softmax in fp32: bf16 logits lose the small differences that the loss is made of.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, batches_: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    device = next(model.parameters()).device
    model.eval()
    losses = [lm_loss(model, x.to(device), y.to(device)).item() for x, y in batches_]
    model.train()
    return sum(losses) / len(losses)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lr_at(step: int, steps: int, lr: float, warmup_steps: int | None = None) -> float:
    """The learning rate of `step` (from 0) of `steps`: a linear warm-up over `warmup_steps`
    (default: 5% of the steps), then cosine decay to 10% of `lr`. Without the warm-up, the
    GPU preset's high-precision model spikes in its first steps and ends several percent
    behind the float8 one, whose saturating casts bound the spike: a gap that is not
    float8's."""
    warmup = warmup_steps or max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_run(
    name: str,
    model: nn.Module,
    train_tokens: torch.Tensor,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    forward = torch.compile(model) if args.compile else model
    # Seeded alike for every run: the runs see identical batches.
    stream = batches(
        train_tokens, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed)
    )
    # A validation batch has the training shape and leaves the training stream untouched.
    saved = saved_activation_bytes(model, *(t.to(device) for t in val_batches[0]))
    losses: list[float] = []
    step_times: list[float] = []
    progress = tqdm(range(args.steps), desc=name, disable=args.quiet, leave=False)
    for step in progress:
        inputs, targets = (t.to(device) for t in next(stream))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        synchronize(device)
        start = time.perf_counter()
        loss = lm_loss(forward, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # also waits for the step on CUDA
        synchronize(device)
        step_times.append(time.perf_counter() - start)
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    timed = step_times[WARMUP_STEPS:] or step_times
    step_s = sum(timed) / len(timed)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    last = losses[-FINAL_LOSS_STEPS:]
    return {
        "run": name,
        "losses": losses,
        "final_train_loss": sum(last) / len(last),
        "val_loss": evaluate(model, val_batches),
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.batch_size * args.seq_len / step_s,
        "saved_activations_mib": saved / 2**20,
        # The CPU allocator keeps no peak: there, saved activations are the memory figure.
        "peak_memory_mib": None if peak is None else peak / 2**20,
        "float8_linears": sum(isinstance(m, Float8Linear) for m in model.modules()),
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def format_table(rows: list[dict[str, Any]]) -> str:
    on_cuda = rows[0]["peak_memory_mib"] is not None
    memory_key = "peak_memory_mib" if on_cuda else "saved_activations_mib"
    memory_header = "peak memory MiB" if on_cuda else "saved activations MiB"
    header = (
        "run", "dtype", "final train loss", "val loss", "gap vs high precision",
        "step time ms", "tokens/s", memory_header,
    )  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        gap = "-" if row["gap_pct"] is None else f"{row['gap_pct']:+.2f}%"
        cells = (
            row["run"], row["dtype"], f"{row['final_train_loss']:.4f}", f"{row['val_loss']:.4f}",
            gap, f"{row['step_ms']:.1f}", f"{row['tokens_per_s']:,.0f}", f"{row[memory_key]:.2f}",
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> None:
    """Exit with a message that names the option and what to give, for settings the demo
    cannot run (before a model is built, rather than deep inside a run)."""

    def fail(message: str) -> None:
        raise SystemExit(f"fp8train demo: {message}")

    for name in ("steps", "batch_size", "seq_len", "dim", "n_layers", "eval_batches"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
    if args.steps <= WARMUP_STEPS:
        fail(
            f"--steps {args.steps}: give more than {WARMUP_STEPS}, the warm-up steps left out "
            "of the step time"
        )
    if not math.isfinite(args.lr) or args.lr <= 0:
        fail(f"--lr {args.lr}: give a positive learning rate")
    if args.dtype == "float16":
        fail(f"--dtype float16: {FLOAT16_PARAMETERS}: give bfloat16 or float32")
    if args.dim % ALIGNMENT:
        fail(
            f"--dim {args.dim} is not a multiple of {ALIGNMENT}, which float8 gemms need: "
            f"give {-(-args.dim // ALIGNMENT) * ALIGNMENT}, for example"
        )
    if problem := misaligned_tokens(args.batch_size, args.seq_len, "step"):
        fail(problem)


def misaligned_tokens(batch_size: int, seq_len: int, per: str) -> str | None:
    """What is wrong with --batch-size x --seq-len tokens a `per` (step, micro-batch) for
    float8's grad_weight gemm, whose inner dim they are; None where they fit it."""
    tokens = batch_size * seq_len
    if tokens % ALIGNMENT == 0:
        return None
    return (
        f"--batch-size {batch_size} x --seq-len {seq_len} = {tokens} tokens a {per}, not a "
        f"multiple of {ALIGNMENT}, which float8's grad_weight gemm needs"
    )


def demo_heads(dim: int) -> int:
    """Attention heads of the demo's model: head dim 64 as in LLaMA, at least 4 heads, and a
    count that divides `dim` into even head dims (rotary embeddings rotate pairs). 4 heads
    always do for a dim that is a multiple of 16."""
    heads = max(4, dim // 64)
    while dim % heads or (dim // heads) % 2:
        heads -= 1
    return heads


def run_demo(args: argparse.Namespace) -> list[dict[str, Any]]:
    args = apply_presets(args)
    check_args(args)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    print(f"device: {device_name(device)} | torch {torch.__version__} | fp8train {__version__}")

    train_tokens, val_tokens = train_val_split(load_text_tokens())
    # Long sequences fit fewer validation windows into the held-out text: use what fits.
    fits = len(val_tokens) // (args.batch_size * (args.seq_len + 1))
    if not fits:
        raise SystemExit(
            f"fp8train demo: --batch-size {args.batch_size} x (--seq-len {args.seq_len} + 1) "
            f"tokens a batch is more than the {len(val_tokens)} held-out validation tokens: "
            "give a smaller --seq-len or --batch-size"
        )
    val_batches = eval_batches(
        val_tokens, args.batch_size, args.seq_len, min(args.eval_batches, fits)
    )
    model_args = ModelArgs(
        dim=args.dim, n_layers=args.n_layers, ffn_dim=llama_ffn_dim(args.dim),
        n_heads=demo_heads(args.dim),
        max_seq_len=args.seq_len,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    initial = Transformer(model_args)  # both runs start from copies of these weights

    dtype_name = str(dtype).removeprefix("torch.")
    emulated = " emulated" if args.emulate else ""
    float8_label = f"float8{emulated} + {dtype_name}"
    rows = []
    for name, label, convert in (
        ("high precision", dtype_name, False),
        ("float8", float8_label, True),
    ):
        gc.collect()  # free the previous run, so its memory is not in this run's peak
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = copy.deepcopy(initial).to(device=device, dtype=dtype)
        if convert:
            model = to_float8(model, args)
        rows.append({**train_run(name, model, train_tokens, val_batches, args), "dtype": label})
        if convert and args.stats:
            cast_table = record_stats(model, val_batches[0])
        del model

    baseline = rows[0]["val_loss"]
    for row in rows:
        row["gap_pct"] = None if row is rows[0] else 100 * (row["val_loss"] - baseline) / baseline
    n_linear = sum(isinstance(m, nn.Linear) for m in initial.modules())
    print(format_table(rows))
    print(
        f"\nfloat8: {rows[1]['float8_linears']} of {n_linear} linear layers, lm_head kept in "
        f"{dtype_name}; gap = relative val loss difference; step time = mean after "
        f"{WARMUP_STEPS} warm-up steps."
    )
    tokens = args.batch_size * args.seq_len
    note = speed_note(rows, initial, device, tokens, args.compile, float8_config(args))
    if note:
        print(f"\n{note}")
    if args.stats:
        print(f"\nfloat8 casts of one step (validation batch):\n{cast_table}")
    return rows


def speed_note(
    rows: list[dict[str, Any]],
    model: nn.Module,
    device: torch.device,
    tokens: int,
    compiled: bool,
    config: Float8LinearConfig | None = None,
    costs: CostModel | None = None,
) -> str | None:
    """Why float8 ran slower than high precision, where it did (None where it did not): the
    demo shows the loss float8 reaches, and its models are small, so that a run takes minutes.
    On a GPU, fp8train.auto_filter's cost model says how many of the float8 layers it would
    expect to be faster at this size; eager, with this host's time per layer measured
    (CostModel.measure_host) unless `costs` is given."""
    high, float8 = rows
    if float8["tokens_per_s"] >= high["tokens_per_s"]:
        return None
    if device.type != "cuda":
        return (
            "float8 ran slower here: the CPU has no fast float8 gemms or casts. The demo shows "
            "the loss float8 reaches; its speed is a GPU's (README: Speed)."
        )
    if costs is None and not compiled:
        costs = CostModel.measure_host(device, config=config)
    keep = auto_filter(tokens, config=config, compiled=compiled, model=costs)
    layers = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and _not_lm_head(m, fqn)  # the layers to_float8 converts
    ]
    faster = sum(keep(m, fqn) for fqn, m in layers)
    note = (
        f"float8 ran slower here: at {tokens} tokens a step, fp8train.auto_filter's cost model "
        f"expects {'compiled' if compiled else 'eager'} float8 to be faster in {faster} of "
        f"these {len(layers)} layers. It pays on larger ones, as on the LLaMA-70B shapes of "
        "the per-layer benchmark and in the end-to-end example (README: Speed, End to end)."
    )
    if not compiled:
        note += " Eager, float8 also waits on the host's kernel launches; --compile shortens that."
    return note


def record_stats(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    """One forward + backward of `model` (eager) under fp8train.stats, as a table."""
    device = next(model.parameters()).device
    with stats.record(model) as recorder:
        lm_loss(model, *(t.to(device) for t in batch)).backward()
    model.zero_grad(set_to_none=True)
    return recorder.table()
