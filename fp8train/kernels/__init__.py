"""Triton kernels for CUDA, each with the torch path it must agree with.

Kernels are used in eager mode on CUDA, where each torch op is a separate pass over memory with
its own temporaries. Under torch.compile the torch path is traced instead and inductor fuses it
with the neighbouring ops, unless Float8LinearConfig.compiled_cast_kernels asks for the kernels
(as triton ops, fp8train.cast).
"""

from fp8train.kernels.amax import amax_partials_2d, partials_count
from fp8train.kernels.cast import (
    HAS_TRITON,
    cast_2d,
    empty_2d,
    empty_scalar,
    kernel_cast,
    quantize_2d,
)
from fp8train.kernels.transpose import column_major_2d

__all__ = [
    "HAS_TRITON",
    "amax_partials_2d",
    "cast_2d",
    "column_major_2d",
    "empty_2d",
    "empty_scalar",
    "kernel_cast",
    "partials_count",
    "quantize_2d",
]
