"""Distributed training with PyTorch's own stack: FSDP2 with float8 all-gather."""

from fp8train.distributed.fsdp import (
    WeightWithFloat8CastTensor,
    precompute_float8_dynamic_scale_for_fsdp,
)

__all__ = ["WeightWithFloat8CastTensor", "precompute_float8_dynamic_scale_for_fsdp"]
