# ruff: noqa: E501, B023  (recorded as run on the GPU; only imports and layout reformatted since)
"""Which host work of an eager float8 step grows when autograd runs backward on its device
thread: torch.profiler's CPU self time per op, threads on vs off; and the step's wall time
with Python's cyclic garbage collector on and off."""

import copy
import gc
import statistics
import sys
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fp8train import Float8Linear, Float8LinearConfig

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
torch.manual_seed(0)
base = nn.Linear(256, 256, bias=False, device=dev, dtype=torch.bfloat16)
fp8 = Float8Linear.from_float(copy.deepcopy(base), Float8LinearConfig())
x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)


def step():
    fp8(x).backward(g)


def wall(n=1000):
    out = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


for _ in range(100):
    step()
print("| autograd threads | gc | float8 fwd+bwd us |")
print("|---|---|---|")
for mt in (True, False):
    torch.autograd.set_multithreading_enabled(mt)
    for gc_on in (True, False):
        gc.enable() if gc_on else gc.disable()
        print(f"| {mt} | {gc_on} | {wall():.0f} |")
gc.enable()
for mt in (True, False):
    torch.autograd.set_multithreading_enabled(mt)
    for _ in range(20):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            step()
        sync()
    print(f"\n## autograd threads {mt}: CPU self time over 50 steps")
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
        )
    )
