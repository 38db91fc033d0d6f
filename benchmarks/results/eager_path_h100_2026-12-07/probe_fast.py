# ruff: noqa
"""Eager host time: Float8Linear's general path against a straight-line prototype of the
default config, and bit-for-bit agreement of the two. Usage: python probe_fast.py [steps]"""

import os, sys, time
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fastpath import FastLinear
from fp8train import Float8Linear, Float8LinearConfig

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
dev = "cuda"
torch.manual_seed(0)


def layers(k, n):
    ref = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = Float8Linear.from_float(
        torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16), Float8LinearConfig()
    )
    fp8.weight.data.copy_(ref.weight.data)
    fast = FastLinear(torch.nn.Parameter(ref.weight.detach().clone()))
    return ref, fp8, fast


# bit for bit
for m, k, n in [(256, 256, 256), (1024, 512, 768), (4096, 1024, 8192)]:
    ref, fp8, fast = layers(k, n)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    outs = []
    for lay in (fp8, fast):
        xi = x.clone().requires_grad_()
        o = lay(xi)
        o.backward(g)
        outs.append((o, xi.grad, lay.weight.grad))
    same = [torch.equal(a, b) for a, b in zip(*outs)]
    print("equal (out, grad_input, grad_weight)", (m, k, n), same)


def host_us(lay, x, g, n):
    def step():
        lay(x).backward(g)

    for _ in range(50):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


ref, fp8, fast = layers(256, 256)
x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
for threads in (True, False, True, False):
    torch.autograd.set_multithreading_enabled(threads)
    r = [host_us(l, x, g, steps) for l in (ref, fp8, fast)]
    print(
        f"256^3 threads={'on' if threads else 'off'}: bf16 {r[0]:.0f} us, general {r[1]:.0f} us, prototype {r[2]:.0f} us"
    )
torch.autograd.set_multithreading_enabled(True)

# the attention shapes, wall time per fwd+bwd
for name, (m, k, n) in [("attn.wqkv", (16384, 8192, 1280)), ("attn.w0", (16384, 1024, 8192))]:
    ref, fp8, fast = layers(k, n)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    for rep in range(2):
        r = [host_us(l, x, g, 200) for l in (ref, fp8, fast)]
        print(
            f"{name} run {rep}: bf16 {r[0]:.0f} us, general {r[1]:.0f} us ({r[0] / r[1]:.3f}x), prototype {r[2]:.0f} us ({r[0] / r[2]:.3f}x)"
        )
