"""FSDP2 float8 all-gather: each rank casts its shard of a weight to float8 before the
all-gather, so FSDP moves 1 byte per weight element instead of 2 (bf16) or 4 (fp32), and the
forward gemm gets the float8 weight straight from the all-gather.

The weight parameter stays a high-precision tensor (the optimizer, checkpoints and FSDP's
sharding see one), wrapped in `WeightWithFloat8CastTensor`, which implements FSDP2's
`fsdp_pre_all_gather` / `fsdp_post_all_gather` extension hooks:

    pre:  scale from the global amax (one all-reduce MAX over the shard group, or a scale
          precomputed for every weight at once by precompute_float8_dynamic_scale_for_fsdp);
          a delayed weight's scale from its history (its shard's amax recorded for the sync),
          a static weight's given scale,
          cast the local shard, hand FSDP its bytes as uint8 (gloo cannot all-gather float8
          dtypes; bytes are bytes to NCCL too)
    post: view the gathered bytes as float8: the unsharded weight is a Float8Tensor

Every rank casts with the same global scale, so the gathered bytes are exactly those of casting
the whole weight: losses equal those of FSDP2 without float8 all-gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from fp8train.cast import quantize
from fp8train.config import E4M3, CastConfig, Gemm, Role, ScalingGranularity, ScalingType
from fp8train.delayed import require_module, role_state
from fp8train.scaling import amax_to_scale
from fp8train.tensor import Float8Tensor

aten = torch.ops.aten

# Ops whose results stay wrapped: those FSDP2 uses to shard, copy and move the parameter.
_PRESERVE_SUBCLASS = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}


class WeightWithFloat8CastTensor(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in float8 with a tensorwise scale."""

    _tensor: torch.Tensor
    _precomputed_scale: torch.Tensor | None

    @staticmethod
    def __new__(
        cls,
        tensor: torch.Tensor,
        precomputed_scale: torch.Tensor | None = None,
        round_scales_to_power_of_2: bool = False,
    ) -> WeightWithFloat8CastTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(
        self,
        tensor: torch.Tensor,
        precomputed_scale: torch.Tensor | None = None,
        round_scales_to_power_of_2: bool = False,
    ) -> None:
        self._tensor = tensor
        self._precomputed_scale = precomputed_scale
        self._round_scales_to_power_of_2 = round_scales_to_power_of_2

    def __repr__(self) -> str:
        return f"WeightWithFloat8CastTensor({self._tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        round_pow2 = False

        def unwrap(tensor: WeightWithFloat8CastTensor) -> torch.Tensor:
            nonlocal round_pow2
            round_pow2 = tensor._round_scales_to_power_of_2
            return tensor._tensor

        args, kwargs = tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE_SUBCLASS:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls(t, None, round_pow2), out)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        names = (
            ["_tensor"] if self._precomputed_scale is None else ["_tensor", "_precomputed_scale"]
        )
        return names, self._round_scales_to_power_of_2

    @staticmethod
    def __tensor_unflatten__(inner, flatten_spec, outer_size, outer_stride):  # noqa: ANN001, ANN205
        return WeightWithFloat8CastTensor(
            inner["_tensor"], inner.get("_precomputed_scale"), flatten_spec
        )

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001, ANN201
        scale = self._precomputed_scale
        stateful = _stateful_weight_cast(module)
        if stateful is not None:
            scale = _stateful_weight_scale(self._tensor, module, stateful, mesh.get_group())
        elif scale is None:
            amax = torch.linalg.vector_norm(self._tensor, ord=float("inf"), dtype=torch.float32)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            scale = amax_to_scale(amax, E4M3, round_to_power_of_2=self._round_scales_to_power_of_2)
        fp8 = quantize(self._tensor, scale, E4M3)
        return (fp8._data.view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):  # noqa: ANN001, ANN201
        (data,) = all_gather_outputs
        (scale,) = metadata
        if out is not None:
            # FSDP refilled the unsharded weight's bytes in place: only the scale is new.
            out._scale = scale
            return None
        fp8 = Float8Tensor(data.view(E4M3), scale, param_dtype, ScalingGranularity.TENSORWISE)
        return fp8, (data,)


def _stateful_weight_cast(module: nn.Module) -> CastConfig | None:
    """The weight's cast config of `module` (the Float8Linear owning the weight) if it is
    delayed or static; None for dynamic scaling."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    cast = config.cast_config(Role.WEIGHT, Gemm.OUTPUT)
    return cast if cast.scaling_type in (ScalingType.DELAYED, ScalingType.STATIC) else None


@torch.no_grad()
def _stateful_weight_scale(
    shard: torch.Tensor, module: nn.Module, cast: CastConfig, group: dist.ProcessGroup
) -> torch.Tensor:
    """The scale a delayed (or static) weight is cast with before the all-gather.

    Delayed: the shard's amax is recorded into the layer's weight amax, and the step's sync
    all-reduces it (MAX) with every other amax: the history gets the global amax of the
    sharded weight, as without float8 all-gather. Once the scale is an earlier step's (known on
    the host), the shards are cast with it and no collective runs here. On the first step the
    scale comes from the global amax, one all-reduce MAX, as a dynamic cast's would."""
    if cast.scaling_type is ScalingType.STATIC:
        return torch.full((), cast.static_scale, device=shard.device)
    state = role_state(module, Role.WEIGHT)
    local = torch.linalg.vector_norm(shard, ord=float("inf"), dtype=torch.float32)
    state.amax.copy_(torch.maximum(state.amax, local))
    if Role.WEIGHT in module._fp8_ready_roles:
        scale = state.scale.clone()  # the sync updates the buffer in place
    else:
        global_amax = local.clone()
        dist.all_reduce(global_amax, op=dist.ReduceOp.MAX, group=group)
        fresh = amax_to_scale(
            global_amax, E4M3, round_to_power_of_2=module.config.round_scales_to_power_of_2
        )
        scale = torch.where(state.initialized, state.scale, fresh)
    # A non-finite shard gives a NaN scale, so the inf or NaN reaches the loss.
    return torch.where(torch.isfinite(local), scale, torch.nan)


def wrap_weight_for_fsdp(module: nn.Linear, round_scales_to_power_of_2: bool) -> None:
    """Make `module.weight` all-gather in float8 under FSDP2 (before fully_shard)."""
    weight = module.weight
    module.weight = nn.Parameter(
        WeightWithFloat8CastTensor(weight.data, None, round_scales_to_power_of_2),
        requires_grad=weight.requires_grad,
    )
    module.register_state_dict_post_hook(_plain_weight_in_state_dict)


def _plain_weight_in_state_dict(module, state_dict, prefix, local_metadata) -> None:  # noqa: ANN001
    """Checkpoints hold the plain hp weight: they load into the original model (and a torch.load
    with weights_only=True) without this class. Loading back copies into the wrapper."""
    from torch.distributed.tensor import DTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, WeightWithFloat8CastTensor):
        state_dict[key] = DTensor.from_local(
            value._local_tensor._tensor,
            value.device_mesh,
            value.placements,
            shape=value.shape,
            stride=value.stride(),
            run_check=False,
        )
    elif isinstance(value, WeightWithFloat8CastTensor):
        state_dict[key] = value._tensor


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(model: nn.Module) -> None:
    """Compute the float8 scale of every float8-all-gathered weight of `model` with one
    all-reduce, after the optimizer step, so that each all-gather needs no all-reduce of its
    own. Without it each weight's scale is computed at its all-gather."""
    from torch.distributed.tensor import DTensor

    require_module(model, "precompute_float8_dynamic_scale_for_fsdp")
    # Delayed and static weights have their scale already (fp8train.delayed).
    weights = [
        module.weight
        for module in model.modules()
        if isinstance(getattr(module, "weight", None), DTensor)
        and isinstance(module.weight._local_tensor, WeightWithFloat8CastTensor)
        and _stateful_weight_cast(module) is None
    ]
    if not weights:
        return
    locals_ = [p._local_tensor for p in weights]
    amaxes = torch._foreach_norm([t._tensor for t in locals_], ord=float("inf"))
    # One all-reduce for all of them: the max of every weight over its shards.
    local_amax = torch.stack([a.float() for a in amaxes])
    global_amax = DTensor.from_local(
        local_amax, weights[0].device_mesh, [_partial_max()], run_check=False
    ).full_tensor()
    scales = amax_to_scale(
        global_amax, E4M3, round_to_power_of_2=locals_[0]._round_scales_to_power_of_2
    )
    for tensor, scale in zip(locals_, scales, strict=True):
        tensor._precomputed_scale = scale


def _partial_max():  # noqa: ANN202
    from torch.distributed.tensor.placement_types import Partial

    return Partial("max")
