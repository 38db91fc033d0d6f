# ruff: noqa
"""A/B in one process: the demo's CUDA model, fwd+bwd per step (synced, as the demo times it),
with fp8train.eager's fast path on and off, alternating."""

import copy, sys, time
import torch
import fp8train.eager as E
from fp8train import convert_to_float8_training
from fp8train.demo import lm_loss
from fp8train.models import ModelArgs, Transformer, llama_ffn_dim

torch.manual_seed(0)
dev = "cuda"
args = ModelArgs(dim=1024, n_layers=8, n_heads=16, ffn_dim=llama_ffn_dim(1024), max_seq_len=1024)
hp = Transformer(args).to(dev, torch.bfloat16)
fp8 = convert_to_float8_training(
    copy.deepcopy(hp), module_filter_fn=lambda m, fqn: fqn != "lm_head"
)
x = torch.randint(0, 256, (8, 1024), device=dev)
y = torch.randint(0, 256, (8, 1024), device=dev)


def ms_per_step(model, steps=20):
    for _ in range(3):
        lm_loss(model, x, y).backward()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        lm_loss(model, x, y).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sum(times) / len(times) * 1e3


on = E.EAGER_DEVICES
for rep in range(4):
    E.EAGER_DEVICES = frozenset()
    general = ms_per_step(fp8)
    E.EAGER_DEVICES = on
    fast = ms_per_step(fp8)
    bf16 = ms_per_step(hp)
    print(
        f"rep {rep}: bf16 {bf16:.1f} ms, float8 general path {general:.1f} ms, float8 fast path {fast:.1f} ms"
    )
