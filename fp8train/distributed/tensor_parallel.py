"""Tensor and sequence parallelism that moves float8 bytes: torch's ColwiseParallel,
RowwiseParallel and PrepareModuleInput, with the casts moved before the all-gathers.

Sequence parallelism all-gathers activations twice per layer pair:
    forward   the input of the column-parallel layer, sharded by tokens, to every rank
    backward  the gradient of the row-parallel layer's output, sharded by tokens, to every rank
torch's styles all-gather the high-precision tensor, and the float8 gemm then casts it. The
styles here cast each rank's shard first, with the scale of the whole tensor (one all-reduce
MAX of a scalar), and all-gather the float8 bytes: 1 byte per element instead of 2 (bf16) or
4 (fp32). The gathered bytes are exactly those of casting the gathered tensor, so results equal
torch's styles to rounding of the partial sums.

    Float8ColwiseParallel      the input: cast, then all-gathered (from `input_layouts`)
    Float8RowwiseParallel      grad of the output: cast, then all-gathered in backward
                               (`output_layouts=Shard(...)`, the reduce-scatter of forward)
    PrepareFloat8ModuleInput   a module's input cast and all-gathered once for all the
                               Float8ColwiseParallel layers reading it (attention's q, k and v)

Tensorwise dynamic scaling only (the input's cast for Float8ColwiseParallel and
PrepareFloat8ModuleInput, grad_output's for Float8RowwiseParallel): the scale must be known
before the all-gather and be one number for the gathered tensor. A 1-D device mesh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)
from torch.distributed.tensor.placement_types import Placement

from fp8train.cast import cast_layouts
from fp8train.config import Float8LinearConfig, Gemm, Role, ScalingGranularity, ScalingType
from fp8train.linear import Float8Linear
from fp8train.scaling import amax, amax_to_scale
from fp8train.tensor import Float8Tensor

# The gemms each role is cast for: one cast must serve both.
_GEMMS = {
    Role.INPUT: (Gemm.OUTPUT, Gemm.GRAD_WEIGHT),
    Role.GRAD_OUTPUT: (Gemm.GRAD_INPUT, Gemm.GRAD_WEIGHT),
}


def _check_tensorwise_dynamic(module: nn.Module, role: Role, style: str) -> Float8LinearConfig:
    """The layer's config, if one tensorwise dynamic cast of `role` serves both its gemms."""
    if not isinstance(module, Float8Linear):
        raise TypeError(
            f"{style} needs a Float8Linear, got {type(module).__name__}: convert the model with "
            "convert_to_float8_training first, or use torch's own style for this layer"
        )
    config = module.config
    casts = [config.cast_config(role, gemm) for gemm in _GEMMS[role]]
    ok = all(
        cast.enabled
        and cast.scaling_type is ScalingType.DYNAMIC
        and cast.scaling_granularity is ScalingGranularity.TENSORWISE
        and cast.target_dtype == casts[0].target_dtype
        for cast in casts
    )
    if not ok:
        name = f"'{module.fqn}'" if module.fqn else "the layer"
        raise ValueError(
            f"{style} casts {role.value} before its all-gather, which needs one tensorwise "
            f"dynamic float8 cast of {role.value} for both of its gemms; {name} has "
            f"{' and '.join(str(cast) for cast in casts)}: use the tensorwise recipe for this "
            "layer, or torch's own style (it all-gathers high precision and casts after)"
        )
    return config


# all_gather_tensor was renamed all_gather_single after torch 2.11.
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


def _shard_dim(placement: Placement, ndim: int) -> int | None:
    if isinstance(placement, Shard):
        return placement.dim % ndim
    if isinstance(placement, Replicate):
        return None
    raise NotImplementedError(
        f"float8 tensor parallelism casts tensors that are sharded or replicated, not {placement}"
    )


def _cast_then_all_gather(
    hp: DTensor, float8_dtype: torch.dtype, round_pow2: bool, desired: Placement
) -> Float8Tensor:
    """`hp` (sharded or replicated on a 1-D mesh) cast to float8 with the scale of the whole
    tensor, laid out as `desired`: a shard all-gathered as bytes to Replicate, or left as
    it is. A Float8Tensor whose data and scale are DTensors."""
    if hp.device_mesh.ndim != 1:
        raise NotImplementedError("float8 tensor parallelism needs a 1-D device mesh")
    mesh, (placement,) = hp.device_mesh, hp.placements
    local = hp.to_local()
    dim = _shard_dim(placement, hp.ndim)
    local_amax = amax(local, ScalingGranularity.TENSORWISE, None)
    # A shard's amax is not the tensor's: one all-reduce of a scalar.
    global_amax = local_amax if dim is None else _wait(funcol.all_reduce(local_amax, "max", mesh))
    scale = amax_to_scale(global_amax, float8_dtype, round_to_power_of_2=round_pow2)
    (fp8,) = cast_layouts(local, float8_dtype, ScalingGranularity.TENSORWISE, (False,), scale=scale)
    data = fp8._data
    if desired != placement:
        if not (dim is not None and isinstance(desired, Replicate)):
            raise NotImplementedError(
                f"float8 tensor parallelism redistributes a shard to Replicate, not {placement} "
                f"to {desired}"
            )
        if hp.shape[dim] % mesh.size():
            raise ValueError(
                f"dim {dim} of size {hp.shape[dim]} does not split evenly over {mesh.size()} "
                "ranks, which the float8 all-gather needs: make it a multiple of the tensor "
                "parallel degree"
            )
        # As bytes: gloo has no float8 dtypes, and NCCL moves bytes alike.
        gathered = _ALL_GATHER(data.view(torch.uint8), gather_dim=dim, group=mesh)
        data = _wait(gathered).view(float8_dtype)
    return Float8Tensor(
        DTensor.from_local(data, mesh, (desired,), run_check=False),
        DTensor.from_local(scale, mesh, (Replicate(),), run_check=False),
        hp.dtype,
        ScalingGranularity.TENSORWISE,
    )


class _CastThenAllGather(torch.autograd.Function):
    """Forward: the float8 all-gather. Backward: the gradient, high precision, back to the
    input's placement (a reduce-scatter of the partial sums, or a slice)."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any,
        hp: DTensor,
        float8_dtype: torch.dtype,
        round_pow2: bool,
        desired: Placement,
    ) -> Float8Tensor:
        ctx.mesh, ctx.placements = hp.device_mesh, hp.placements
        return _cast_then_all_gather(hp, float8_dtype, round_pow2, desired)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205, D102
        if isinstance(grad, DTensor):
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad, None, None, None


class _RedistributeThenFloat8Grad(torch.autograd.Function):
    """Forward: the output's redistribute (the reduce-scatter of a row-parallel layer, high
    precision: partial sums cannot be float8). Backward: its gradient, sharded, cast to
    float8 and all-gathered as bytes, handed to the layer's backward already cast."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: Any,
        output: DTensor,
        placements: tuple[Placement, ...],
        float8_dtype: torch.dtype,
        round_pow2: bool,
    ) -> DTensor:
        ctx.float8_dtype, ctx.round_pow2 = float8_dtype, round_pow2
        return output.redistribute(placements=placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor):  # noqa: ANN205, D102
        fp8 = _cast_then_all_gather(grad, ctx.float8_dtype, ctx.round_pow2, Replicate())
        if torch.compiler.is_compiling():
            # A compiled layer's backward is traced for a high-precision grad_output: it gets
            # the gathered values dequantized, and its own cast, fused with this by inductor,
            # finds the same scale and bytes again (to the last bit of the scale). The
            # all-gather still moves float8 bytes.
            return fp8.to_hp(), None, None, None
        return fp8, None, None, None


def _as_dtensor(tensor: torch.Tensor, mesh: DeviceMesh, layouts: tuple[Placement, ...]) -> DTensor:
    if isinstance(tensor, DTensor):
        return tensor
    return DTensor.from_local(tensor, mesh, layouts, run_check=False)


def _check_gathered(tensor: Float8Tensor, desired: tuple[Placement, ...], style: str) -> None:
    data = tensor._data
    if not (isinstance(data, DTensor) and tuple(data.placements) == tuple(desired)):
        raise ValueError(
            f"{style} got a float8 input laid out as "
            f"{getattr(data, 'placements', 'a plain tensor')}, not {tuple(desired)}: give "
            "PrepareFloat8ModuleInput the layouts this layer's input_layouts expect"
        )


class Float8ColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Float8Linear whose input is cast before its all-gather.

    With `input_layouts=Shard(dim)` (sequence parallelism) the all-gather moves float8 bytes;
    with a replicated input there is no all-gather and it equals ColwiseParallel. An input
    already cast by PrepareFloat8ModuleInput is used as it is."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):  # noqa: ANN001, ANN205
        tensor = inputs[0]
        if isinstance(tensor, Float8Tensor):
            _check_gathered(tensor, desired_input_layouts, "Float8ColwiseParallel")
            return tensor
        config = mod.config  # checked once, in _apply
        dtensor = _as_dtensor(tensor, device_mesh, input_layouts)
        return _CastThenAllGather.apply(
            dtensor,
            config.cast_config(Role.INPUT, Gemm.OUTPUT).target_dtype,
            config.round_scales_to_power_of_2,
            desired_input_layouts[0],
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_tensorwise_dynamic(module, Role.INPUT, "Float8ColwiseParallel")
        return super()._apply(module, device_mesh)


class Float8RowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a Float8Linear whose output gradient is cast before its
    all-gather in backward.

    With `output_layouts=Shard(dim)` (sequence parallelism) forward reduce-scatters the
    output in high precision and backward all-gathers its gradient in float8; with a
    replicated output (an all-reduce, whose gradient needs no communication) it equals
    RowwiseParallel. The layer must have no bias: a bias gradient is a sum over the
    high-precision grad_output, which this style does not keep."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        if isinstance(output_layouts[0], Shard):
            config = mod.config
            outputs = _RedistributeThenFloat8Grad.apply(
                outputs,
                tuple(output_layouts),
                config.cast_config(Role.GRAD_OUTPUT, Gemm.GRAD_INPUT).target_dtype,
                config.round_scales_to_power_of_2,
            )
        elif outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_tensorwise_dynamic(module, Role.GRAD_OUTPUT, "Float8RowwiseParallel")
        if module.bias is not None and isinstance(self.output_layouts[0], Shard):
            name = f"'{module.fqn}'" if module.fqn else "the layer"
            raise ValueError(
                f"Float8RowwiseParallel with a sharded output casts the output's gradient to "
                f"float8 before the all-gather, and {name} has a bias, whose gradient needs "
                "the high-precision one: build the layer with bias=False, or use "
                "RowwiseParallel for it"
            )
        return super()._apply(module, device_mesh)


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """PrepareModuleInput that casts the module's inputs to float8 before redistributing
    them: one cast and one float8 all-gather for every Float8ColwiseParallel layer that
    reads the input (attention's wq, wk and wv; the FFN's w1 and w3).

    The cast follows the config of the module's first Float8Linear, or of the submodule
    named `float8_config_submodule`; the layers reading the input must use
    Float8ColwiseParallel with `input_layouts` equal to `desired_input_layouts` here.
    Only the module's floating-point tensor inputs with a layout given are cast."""

    def __init__(self, *, float8_config_submodule: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.float8_config_submodule = float8_config_submodule
        self._config: Float8LinearConfig | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.float8_config_submodule is not None:
            layer = module.get_submodule(self.float8_config_submodule)
        else:
            layer = next((m for m in module.modules() if isinstance(m, Float8Linear)), None)
            if layer is None:
                raise ValueError(
                    f"PrepareFloat8ModuleInput on a {type(module).__name__} with no "
                    "Float8Linear inside: convert the model first, or use PrepareModuleInput"
                )
        self._config = _check_tensorwise_dynamic(layer, Role.INPUT, "PrepareFloat8ModuleInput")
        return super()._apply(module, device_mesh)

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):  # noqa: ANN001, ANN202
        if input_layout is None or not (
            isinstance(input, torch.Tensor) and input.is_floating_point()
        ):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        config = self._config
        return _CastThenAllGather.apply(
            _as_dtensor(input, mesh, (input_layout,)),
            config.cast_config(Role.INPUT, Gemm.OUTPUT).target_dtype,
            config.round_scales_to_power_of_2,
            desired_layout if desired_layout is not None else input_layout,
        )
