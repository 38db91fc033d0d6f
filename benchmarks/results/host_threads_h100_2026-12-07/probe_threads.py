# ruff: noqa: E501, B023  (recorded as run on the GPU; only imports and layout reformatted since)
"""Host anatomy of one eager float8 layer step on this machine: the autograd engine's device
thread, forward vs backward, and the primitives the step is made of."""

import copy
import statistics
import sys
import time

import torch
from torch import nn

from benchmarks.profile_host import PythonFunctionLinear
from fp8train import Float8Linear, Float8LinearConfig
from fp8train.config import ScalingGranularity
from fp8train.tensor import Float8Tensor

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)


def per_call(fn, n=N, reps=3):
    for _ in range(50):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


torch.manual_seed(0)
base = nn.Linear(256, 256, bias=False, device=dev, dtype=torch.bfloat16)
layers = {
    "bf16 nn.Linear": base,
    "bf16 autograd.Function": PythonFunctionLinear(copy.deepcopy(base)),
    "float8": Float8Linear.from_float(copy.deepcopy(base), Float8LinearConfig()),
}
x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)

print(
    "| layer | autograd threads | fwd+bwd us | fwd only (graph built, dropped) us | bwd share us |"
)
print("|---|---|---|---|---|")
for mt in (True, False, True, False):
    torch.autograd.set_multithreading_enabled(mt)
    for name, layer in layers.items():
        full = per_call(lambda: layer(x).backward(g))
        fwd = per_call(lambda: layer(x))
        print(f"| {name} | {mt} | {full:.0f} | {fwd:.0f} | {full - fwd:.0f} |")
torch.autograd.set_multithreading_enabled(True)

print()
print("| primitive (256 x 256 operands) | us per call |")
print("|---|---|")
a8 = torch.randn(256, 256, device=dev).to(torch.float8_e4m3fn)
b8 = torch.randn(256, 256, device=dev).to(torch.float8_e4m3fn).t().contiguous().t()
one = torch.ones((), device=dev)
a16, b16 = (
    torch.randn(256, 256, device=dev, dtype=torch.bfloat16),
    torch.randn(256, 256, device=dev, dtype=torch.bfloat16),
)
rows = {
    "torch.empty(65536 bytes)": lambda: torch.empty(65536, dtype=torch.uint8, device=dev),
    "torch.mm bf16": lambda: torch.mm(a16, b16),
    "torch._scaled_mm tensorwise": lambda: torch._scaled_mm(
        a8, b8, one, one, out_dtype=torch.bfloat16
    ),
    "Float8Tensor(...)": lambda: Float8Tensor(
        a8, one, torch.bfloat16, ScalingGranularity.TENSORWISE
    ),
    "tensor.t()": lambda: a16.t(),
    "tensor[4] (0-d view)": lambda: a16[4, 4],
    "torch.ones_like(0-d)": lambda: torch.ones_like(one),
}
if dev == "cuda":
    from fp8train.kernels.amax import amax_partials_2d, partials_count

    buf = torch.empty(partials_count(a16.device), device=dev)
    rows["amax_partials_2d (one Triton launch)"] = lambda: amax_partials_2d(a16, buf)
    rows["torch.cuda.current_stream()"] = lambda: torch.cuda.current_stream()
for name, fn in rows.items():
    print(f"| {name} | {per_call(fn, n=20000):.2f} |")
