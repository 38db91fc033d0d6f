"""Launch a Triton kernel with less host work than `kernel[grid](...)`.

A float8 linear layer launches its kernels seven times a step, and thin layers (attention's
projections at 16k tokens) spend more time on the host than on the GPU: eager mode then runs at
the speed of Python. Triton's `JITFunction.run` binds the arguments, computes their
specialization, looks the compiled kernel up and checks the globals it captured on every call;
on the H200's host that is tens of microseconds a launch.

`launch` does that work once per key of its own: the first call of a key goes through Triton
(which compiles and launches), later calls of the same key hand the arguments straight to the
compiled kernel's native launcher (past the driver's Python wrapper where the kernel needs no
scratch memory). The key is finer than what Triton 3.6 specializes on (each tensor's dtype and
whether its address is 16-byte aligned; each int's equality to 1, divisibility by 16 and
whether it fits 32 bits): it holds each int itself and each tensor's dtype and address modulo
16, besides the constexprs, the number of warps and the device, so one key never stands for
two specializations, and it is cheaper to build. Ints by value make a key per shape: the cache
is cleared at MAX_LAUNCHERS keys. Other Triton versions, and any launch hook (a profiler's),
take Triton's own path.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton import knobs

    HAS_TRITON = True
except ImportError:  # the CPU wheels of torch come without Triton
    triton = tl = None
    HAS_TRITON = False

try:  # what Triton itself reads the stream with
    from torch._C import _cuda_getCurrentRawStream as current_stream
except ImportError:  # a build of torch without CUDA

    def current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


# The compiled kernel's launcher signature checked here is Triton 3.6's.
LEAN = triton is not None and tuple(int(p) for p in triton.__version__.split(".")[:2]) == (3, 6)

_LAUNCHERS: dict[tuple, Any] = {}
MAX_LAUNCHERS = 4096
"""The cache of launchers is cleared when it reaches this many keys."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints. (`triton.cdiv` is a constexpr function in Triton 3.6: on the host
    each call goes through its wrapper, several microseconds.)"""
    return -(-a // b)


def _other_key(arg: Any) -> Any:
    """The key part of an argument that is neither an int nor a tensor: a bool by value (a
    constexpr-like flag), anything else (a float) by type, as Triton specializes them."""
    kind = type(arg)
    return (kind, arg) if kind is bool else kind


def _hooked() -> bool:
    """True while a launch hook is set (Triton 3.6 keeps them in chains, empty by default)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def _current_device() -> int:
    # torch.cuda.current_device() without its lazy-init check: the first launch of every key
    # goes through Triton, which initializes CUDA.
    return torch._C._cuda_getDevice()


class _Launcher:
    """The compiled kernel's native launch and what it takes besides the arguments. Where the
    kernel needs no scratch memory (the kernels here), the driver's Python wrapper, which only
    allocates it, is skipped."""

    def __init__(self, compiled: Any, kernel: Any) -> None:
        self.kernel = kernel  # the key holds its id
        wrapper = compiled.run
        self.lean = wrapper.global_scratch_size == 0 and wrapper.profile_scratch_size == 0
        self.wrapper, self.native = wrapper, wrapper.launch
        self.function, self.metadata = compiled.function, compiled.packed_metadata
        self.cooperative, self.pdl = wrapper.launch_cooperative_grid, wrapper.launch_pdl

    def __call__(self, grid: tuple[int, ...], stream: int, args: tuple) -> None:
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        if self.lean:
            self.native(
                grid[0], g1, g2, stream, self.function, self.cooperative, self.pdl,
                None, None, self.metadata, None, None, None, *args,
            )  # fmt: skip
        else:
            self.wrapper(
                grid[0], g1, g2, stream, self.function, self.metadata, None, None, None, *args
            )


def launch(
    kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, **constexprs: Any
) -> None:
    """`kernel[grid](*args, **constexprs, num_warps=num_warps)` on the current CUDA stream of
    the device of `args[0]` (a tensor).

    `args`: the kernel's runtime parameters in order; `constexprs`: the rest, by name, which
    must be the kernel's trailing parameters, in order.
    """
    first = args[0]
    device = first.get_device() if isinstance(first, torch.Tensor) else -1
    if device < 0:
        device = _current_device()
    elif device != _current_device():
        # Triton launches on the current device, whatever the tensors' device: a layer on
        # another GPU than the current one (a model spread over the GPUs of one process)
        # would hand that device's addresses to a kernel running on this one.
        with torch.cuda.device(device):
            _launch(kernel, grid, args, num_warps, constexprs, device)
        return
    _launch(kernel, grid, args, num_warps, constexprs, device)


def _launch(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple,
    num_warps: int,
    constexprs: dict[str, Any],
    device: int,
) -> None:
    """`launch` on `device`, the current device."""
    if not LEAN or _hooked():
        kernel[grid](*args, **constexprs, num_warps=num_warps)
        return
    values = tuple(constexprs.values())
    # See the module docstring for the key. The kernel by id, which is cheaper to hash than
    # the kernel itself: its launcher keeps it alive, so the id is not reused.
    key = (
        id(kernel), device, num_warps, values,
        *[
            arg if type(arg) is int
            else (arg.dtype, arg.data_ptr() & 15) if isinstance(arg, torch.Tensor)
            else _other_key(arg)
            for arg in args
        ],
    )  # fmt: skip
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        names = kernel.arg_names[len(args) :]
        if list(constexprs) != names:
            raise TypeError(f"launch of {kernel}: constexprs {list(constexprs)}, expected {names}")
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps)
        if len(_LAUNCHERS) >= MAX_LAUNCHERS:  # ints by value: bound the cache under any shapes
            _LAUNCHERS.clear()
        _LAUNCHERS[key] = _Launcher(
            compiled.result() if hasattr(compiled, "result") else compiled, kernel
        )
        return
    launcher(grid, current_stream(device), (*args, *values))


def traced_launch(
    kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, **constexprs: Any
) -> None:
    """`launch` for the bodies of fp8train's triton ops, which torch.compile traces: through
    `torch.library.wrap_triton`, so that inductor launches the kernel from its own generated
    code, with no Python of ours on the host at run time."""
    torch.library.wrap_triton(kernel)[grid](*args, **constexprs, num_warps=num_warps)
