"""FSDP2 training of a LLaMA-style model: peak memory and iterations/s per float8 config, the
table float8_experimental's FSDP benchmark reported.

    torchrun --nproc-per-node 8 -m benchmarks.bench_fsdp [--dim 4096 --layers 8 ...]
    torchrun --nproc-per-node 2 -m benchmarks.bench_fsdp --device cpu --dim 128 ...  (a smoke run)

Each config trains the same model from the same weights: fp32 master weights, bf16 compute
(FSDP2 MixedPrecisionPolicy), AdamW, every decoder block and the root fully_shard'ed, blocks
compiled with --compile. Two peaks, each the max over ranks and timed steps of
torch.cuda.max_memory_allocated(): forward + backward alone (where the save policy and the
float8 all-gather show), and the whole step with the optimizer (fp32 AdamW states and their
temporaries; at world size 1 these dominate). On the CPU there is none to read.

Configs:
    bf16                    no float8
    fp8 keep-weight         recompute_weight_cast=False: each layer keeps its unsharded
                            float8 weight until backward
    fp8 recompute-weight    the default: backward recasts the weight
    fp8 float8-all-gather   the default with enable_fsdp_float8_all_gather=True
    fp8 all-gather+precompute  the same, scales for all weights in one all-reduce per step
    fp8 delayed             delayed scaling of input, weight and grad_output (amax history,
                            one sync per step; hp all-gather)
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from benchmarks.utils import delayed_config, markdown_table, print_environment, write_csv
from fp8train import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)
from fp8train.models import ModelArgs, Transformer, TransformerBlock

CONFIGS: dict[str, Float8LinearConfig | None] = {
    "bf16": None,
    "fp8 keep-weight": Float8LinearConfig(recompute_weight_cast=False),
    "fp8 recompute-weight": Float8LinearConfig(),
    "fp8 float8-all-gather": Float8LinearConfig(enable_fsdp_float8_all_gather=True),
    "fp8 all-gather+precompute": Float8LinearConfig(enable_fsdp_float8_all_gather=True),
    "fp8 delayed": delayed_config(),
    "fp8 delayed float8-all-gather": delayed_config(enable_fsdp_float8_all_gather=True),
}


def build(args: argparse.Namespace, name: str, mesh, device: torch.device) -> torch.nn.Module:  # noqa: ANN001
    torch.manual_seed(0)
    model_args = ModelArgs(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        ffn_dim=args.ffn_dim,
        max_seq_len=args.seq_len,
    )
    with device:
        model = Transformer(model_args)
    config = CONFIGS[name]
    if config is not None:
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head"
        )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.modules():
        if isinstance(block, TransformerBlock):
            if args.compile:
                block.compile()
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def train(args: argparse.Namespace, name: str, mesh, device: torch.device) -> dict:  # noqa: ANN001
    # FSDP2's modules and their hooks form reference cycles: the previous config's model is
    # only freed by the cycle collector, and would otherwise count in this config's peak.
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    model = build(args, name, mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=generator).to(device)

    peaks = {"fwd+bwd": 0, "step": 0}

    def step() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if name.startswith("fp8 delayed"):
            sync_float8_amax_and_scale_history(model)
        if cuda:
            # Forward and backward alone: where the save policy and the all-gathers show. The
            # optimizer's own peak (fp32 states and temporaries) comes on top of it.
            peaks["fwd+bwd"] = max(peaks["fwd+bwd"], torch.cuda.max_memory_allocated())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if name == "fp8 all-gather+precompute":
            precompute_float8_dynamic_scale_for_fsdp(model)
        if cuda:
            peaks["step"] = max(peaks["step"], torch.cuda.max_memory_allocated())

    for _ in range(args.warmup):
        step()
    peaks.update({"fwd+bwd": 0, "step": 0})
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = torch.tensor(time.perf_counter() - start, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    row = {"config": name, "iterations/s": args.steps / elapsed.item()}
    if cuda:
        for key, label in (("fwd+bwd", "fwd+bwd peak GiB"), ("step", "step peak GiB")):
            peak = torch.tensor(peaks[key] / 2**30, device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            row[label] = peak.item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn-dim", type=int, default=14336)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="per rank")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile every block")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--csv", help="also write the rows to this CSV file (rank 0)")
    args = parser.parse_args()

    device_type = torch.device(args.device).type
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = (
        torch.device(device_type, torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    mesh = init_device_mesh(device_type, (world,))
    if rank == 0:
        print_environment()
        print(f"- world size: {world}, model: dim {args.dim}, {args.layers} layers, FFN "
              f"{args.ffn_dim}, seq {args.seq_len}, batch {args.batch}/rank, "
              f"compile {args.compile}\n")  # fmt: skip
    rows = [train(args, name, mesh, device) for name in args.configs]
    if rank == 0:
        base = rows[0]
        for row in rows:
            row["speedup"] = row["iterations/s"] / base["iterations/s"]
            if "fwd+bwd peak GiB" in row:
                row["fwd+bwd memory vs first"] = row["fwd+bwd peak GiB"] / base["fwd+bwd peak GiB"]
        print(markdown_table(rows))
        if args.csv:
            write_csv(rows, args.csv)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
