# ruff: noqa: E501, B023  (recorded as run on the GPU; only imports and layout reformatted since)
"""Per-call host cost of primitives on the calling thread vs inside an autograd backward
(which the engine runs on its CUDA device thread unless multithreading is off)."""

import statistics
import sys
import time

import torch

from fp8train.config import ScalingGranularity
from fp8train.tensor import Float8Tensor

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
K = 200
a8 = torch.randn(256, 256, device=dev).to(torch.float8_e4m3fn)
b8 = torch.randn(256, 256, device=dev).to(torch.float8_e4m3fn).t().contiguous().t()
one = torch.ones((), device=dev)
a16 = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)


def py_only():
    s = 0
    for i in range(20):
        s += i
    return s


prims = {
    "pure Python (20-step loop)": py_only,
    "torch.empty(65536 bytes)": lambda: torch.empty(65536, dtype=torch.uint8, device=dev),
    "tensor.t()": lambda: a16.t(),
    "Float8Tensor(...)": lambda: Float8Tensor(
        a8, one, torch.bfloat16, ScalingGranularity.TENSORWISE
    ),
    "torch.mm bf16": lambda: torch.mm(a16, a16),
    "torch._scaled_mm": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
    "torch.is_grad_enabled()": torch.is_grad_enabled,
    "torch.compiler.is_compiling()": torch.compiler.is_compiling,
}
if dev == "cuda":
    from fp8train.kernels.amax import amax_partials_2d, partials_count

    buf = torch.empty(partials_count(a16.device), device=dev)
    prims["amax_partials_2d (Triton launch)"] = lambda: amax_partials_2d(a16, buf)
    prims["torch.cuda.current_stream()"] = torch.cuda.current_stream


class Repeat(torch.autograd.Function):
    fn = None
    k = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        fn = Repeat.fn
        for _ in range(Repeat.k):
            fn()
        return g


x = torch.randn(16, device=dev, requires_grad=True)


def step_us(k, n=50):
    Repeat.k = k
    times = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            Repeat.apply(x).sum().backward()
        sync()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main_thread_us(fn, n=4000):
    for _ in range(50):
        fn()
    times = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


print(
    "| primitive | calling thread, us | in backward, threads on, us | in backward, threads off, us |"
)
print("|---|---|---|---|")
for name, fn in prims.items():
    Repeat.fn = fn
    cells = [main_thread_us(fn)]
    for mt in (True, False):
        torch.autograd.set_multithreading_enabled(mt)
        step_us(K, 5)
        cells.append((step_us(K) - step_us(0)) / K)
    torch.autograd.set_multithreading_enabled(True)
    print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
