"""fp8train: float8 training for PyTorch by module swap.

    from fp8train import convert_to_float8_training, Float8LinearConfig
    model = convert_to_float8_training(model, config=Float8LinearConfig())

Everything not listed in __all__ (the op table, the cast internals, the autograd.Function) is
private and may change.
"""

from fp8train import ops as _ops  # noqa: F401  registers Float8Tensor's op table
from fp8train import stats
from fp8train.accumulate import cast_weights_once
from fp8train.activations import float8_swiglu
from fp8train.cast import to_float8
from fp8train.config import (
    CastConfig,
    DelayedScalingConfig,
    Float8GemmConfig,
    Float8LinearConfig,
    Float8LinearRecipeName,
    Gemm,
    Role,
    ScalingGranularity,
    ScalingType,
)
from fp8train.convert import convert_to_float8_training
from fp8train.delayed import (
    find_shared_inputs,
    strip_float8_state,
    sync_float8_amax_and_scale_history,
    tie_delayed_input_scales,
)
from fp8train.distributed import precompute_float8_dynamic_scale_for_fsdp
from fp8train.filters import CostModel, auto_filter
from fp8train.linear import Float8Linear
from fp8train.matmul import float8_matmul
from fp8train.numerics import compute_error
from fp8train.tensor import Float8Tensor
from fp8train.toolchain import ToolchainWarning, toolchain_problem

__version__ = "0.1.0"

__all__ = [
    # configuration
    "CastConfig",
    "DelayedScalingConfig",
    "Float8GemmConfig",
    "Float8LinearConfig",
    "Float8LinearRecipeName",
    "Gemm",
    "Role",
    "ScalingGranularity",
    "ScalingType",
    # top-level UX
    "convert_to_float8_training",
    "auto_filter",
    "CostModel",
    "sync_float8_amax_and_scale_history",
    "tie_delayed_input_scales",
    "find_shared_inputs",
    "strip_float8_state",
    "precompute_float8_dynamic_scale_for_fsdp",
    "cast_weights_once",
    # modules and tensors
    "Float8Linear",
    "Float8Tensor",
    # functional
    "float8_matmul",
    "float8_swiglu",
    "to_float8",
    # numerics
    "compute_error",
    "stats",
    # the compiler Triton uses
    "toolchain_problem",
    "ToolchainWarning",
]
