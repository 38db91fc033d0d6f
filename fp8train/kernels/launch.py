"""Launch a Triton kernel with less host work than `kernel[grid](...)`.

A float8 linear layer launches its kernels eight times a step, and thin layers (attention's
projections at 16k tokens) spend more time on the host than on the GPU: eager mode then runs at
the speed of Python. Triton's `JITFunction.run` binds the arguments, computes their
specialization, looks the compiled kernel up and checks the globals it captured on every call;
on the H200's host that is tens of microseconds a launch.

`launch` does that work once per specialization of its own: the first call of a key goes through
Triton (which compiles and launches), later calls of the same key hand the arguments straight to
the compiled kernel's launcher. The key holds what Triton 3.6 specializes on: each tensor's dtype
and whether its address is 16-byte aligned; each int's equality to 1, divisibility by 16 and
whether it fits 32 bits; the type of each other value; the constexprs, the number of warps and
the device. Other Triton versions, and any launch hook (a profiler's), take Triton's own path.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    from triton import knobs
except ImportError:  # the CPU wheels of torch come without Triton
    triton = None

try:  # what Triton itself reads the stream with
    from torch._C import _cuda_getCurrentRawStream as current_stream
except ImportError:  # a build of torch without CUDA

    def current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


# The compiled kernel's launcher signature checked here is Triton 3.6's.
LEAN = triton is not None and tuple(int(p) for p in triton.__version__.split(".")[:2]) == (3, 6)

_COMPILED: dict[tuple, Any] = {}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints. (`triton.cdiv` is a constexpr function in Triton 3.6: on the host
    each call goes through its wrapper, several microseconds.)"""
    return -(-a // b)


def _spec(arg: Any) -> tuple:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return (bool, arg)
    if isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31)
    return (type(arg),)


def _hooked() -> bool:
    """True while a launch hook is set (Triton 3.6 keeps them in chains, empty by default)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook) for hook in hooks)


def launch(
    kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, **constexprs: Any
) -> None:
    """`kernel[grid](*args, **constexprs, num_warps=num_warps)` on the current CUDA stream.

    `args`: the kernel's runtime parameters in order; `constexprs`: the rest, by name, which
    must be the kernel's trailing parameters, in order.
    """
    if not LEAN or _hooked():
        kernel[grid](*args, **constexprs, num_warps=num_warps)
        return
    # Triton launches on the current device, whatever the tensors' device.
    device = torch.cuda.current_device()
    key = (kernel, device, num_warps, *constexprs.values(), *map(_spec, args))
    compiled = _COMPILED.get(key)
    if compiled is None:
        names = kernel.arg_names[len(args) :]
        if list(constexprs) != names:
            raise TypeError(f"launch of {kernel}: constexprs {list(constexprs)}, expected {names}")
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps)
        _COMPILED[key] = compiled.result() if hasattr(compiled, "result") else compiled
        return
    stream = current_stream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(
        grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
        None, None, None, *args, *constexprs.values(),
    )  # fmt: skip
