"""The aten ops a Float8Tensor supports. Anything not registered here raises
NotImplementedError (see Float8Tensor.__torch_dispatch__): float8 bytes never reach an op that
would treat them as plain numbers."""

from __future__ import annotations

from typing import Any

import torch

from fp8train.config import ScalingGranularity
from fp8train.gemm import scaled_mm
from fp8train.tensor import Float8Tensor, implements

aten = torch.ops.aten


@implements([aten.detach.default, aten.alias.default])
def _detach(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    (tensor,) = args
    return tensor.rewrapped(func(tensor._data))


@implements([aten.clone.default])
def _clone(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    tensor = args[0]
    return tensor.rewrapped(func(tensor._data, **kwargs), tensor._scale.clone())


@implements([aten.t.default])
def _t(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    (tensor,) = args
    return tensor.transposed()


@implements([aten.transpose.int])
def _transpose(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    tensor, dim0, dim1 = args
    scale = tensor._scale
    if tensor._granularity is not ScalingGranularity.TENSORWISE:
        scale = scale.transpose(dim0, dim1)
    return tensor.rewrapped(tensor._data.transpose(dim0, dim1), scale)


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    tensor, shape = args
    if tensor._granularity is not ScalingGranularity.TENSORWISE:
        # Reshaping would mix rows that carry different scales.
        raise NotImplementedError(
            f"{func} of a {tensor._granularity.value} Float8Tensor: only tensorwise Float8Tensors "
            "can be reshaped; dequantize with .to_hp() first"
        )
    return tensor.rewrapped(func(tensor._data, shape))


@implements([aten.as_strided.default])
def _as_strided(func: Any, args: tuple, kwargs: dict) -> Float8Tensor:
    # FSDP2 lays its unsharded parameter out over the all-gather buffer with as_strided.
    tensor, *rest = args
    if tensor._granularity is not ScalingGranularity.TENSORWISE:
        raise NotImplementedError(
            f"{func} of a {tensor._granularity.value} Float8Tensor: only tensorwise Float8Tensors "
            "can be restrided; dequantize with .to_hp() first"
        )
    return tensor.rewrapped(func(tensor._data, *rest, **kwargs))


@implements([aten._to_copy.default])
def _to_copy(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    (tensor,) = args
    dtype = kwargs.pop("dtype", None)
    if dtype is not None and dtype != tensor._orig_dtype:
        # Asking for another dtype is asking for the numbers: dequantize.
        return func(tensor.to_hp(torch.float32), dtype=dtype, **kwargs)
    return Float8Tensor(
        func(tensor._data, **kwargs),
        func(tensor._scale, **kwargs),
        tensor._orig_dtype,
        tensor._granularity,
    )


@implements([aten.mm.default])
def _mm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    a, b = args
    if not (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)):
        raise NotImplementedError(
            "mm of a Float8Tensor with a high-precision tensor: cast both operands to float8, "
            "or dequantize with .to_hp()"
        )
    return scaled_mm(a, b, out_dtype=a._orig_dtype)


@implements([aten.is_same_size.default])
def _is_same_size(func: Any, args: tuple, kwargs: dict) -> bool:
    a, b = args
    return a.shape == b.shape
