"""Distributed training with PyTorch's own stack: FSDP2 with float8 all-gather, and tensor and
sequence parallelism whose all-gathers move float8 bytes."""

from fp8train.distributed.fsdp import (
    WeightWithFloat8CastTensor,
    precompute_float8_dynamic_scale_for_fsdp,
)
from fp8train.distributed.tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)

__all__ = [
    "Float8ColwiseParallel",
    "Float8RowwiseParallel",
    "PrepareFloat8ModuleInput",
    "WeightWithFloat8CastTensor",
    "precompute_float8_dynamic_scale_for_fsdp",
]
