"""Float8Tensor: float8 data with its scale, looking like the high-precision tensor it stands for.

A Float8Tensor holds
    _data         the float8 bytes (torch.float8_e4m3fn or torch.float8_e5m2), any layout
    _scale        fp32, such that hp ~= _data / _scale; 0-d (tensorwise), keepdim-shaped and
                  broadcastable against _data (rowwise: one scale per row or column), or one
                  per block, (R / rows, C / cols) for (R, C) data (blockwise)
    _orig_dtype   the high-precision dtype it was cast from, which is also its reported dtype
    _granularity  tensorwise, rowwise or blockwise
    _inv_scale    1 / _scale, the gemm's fp8 -> hp scale, where the eager cast kernel wrote it
                  (tensorwise); None elsewhere. Not part of the flattened tensor: compiled
                  code, and any Float8Tensor without it, computes the reciprocal instead.

Its ops are an explicit table (fp8train/ops.py): an aten op that is not listed raises, so no op
ever silently runs on float8 bytes as if they were numbers. `__tensor_flatten__` and
`__tensor_unflatten__` let torch.compile trace through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp8train.config import FLOAT8_DTYPES, ScalingGranularity

aten = torch.ops.aten

FLOAT8_OPS: dict[Any, Callable[..., Any]] = {}
"""aten op -> implementation for Float8Tensor; filled by fp8train/ops.py."""


def implements(aten_ops: list[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as Float8Tensor's implementation of `aten_ops`."""

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        for op in aten_ops:
            FLOAT8_OPS[op] = func
        return func

    return register


class Float8Tensor(torch.Tensor):
    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _granularity: ScalingGranularity
    _inv_scale: torch.Tensor | None = None

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    ) -> Float8Tensor:
        if data.dtype not in FLOAT8_DTYPES:
            raise TypeError(f"Float8Tensor data must be float8, got {data.dtype}")
        if scale.dtype != torch.float32:
            raise TypeError(f"Float8Tensor scale must be float32, got {scale.dtype}")
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=orig_dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=False,
        )
        self._data = data
        self._scale = scale
        self._orig_dtype = orig_dtype
        # The enum's own call costs eager mode host time on every cast: only a string converts.
        if type(granularity) is not ScalingGranularity:
            granularity = ScalingGranularity(granularity)
        self._granularity = granularity
        return self

    def __repr__(self) -> str:
        return (
            f"Float8Tensor(shape={tuple(self.shape)}, fp8_dtype={self._data.dtype}, "
            f"orig_dtype={self._orig_dtype}, granularity={self._granularity.value}, "
            f"scale_shape={tuple(self._scale.shape)})"
        )

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    def rewrapped(self, data: torch.Tensor, scale: torch.Tensor | None = None) -> Float8Tensor:
        """A Float8Tensor of `data` (a view or copy of these bytes) with this tensor's scale,
        or `scale` (the same values, laid out as `data` needs)."""
        out = Float8Tensor(
            data, self._scale if scale is None else scale, self._orig_dtype, self._granularity
        )
        if self._granularity is ScalingGranularity.TENSORWISE:
            out._inv_scale = self._inv_scale
        return out

    def transposed(self) -> Float8Tensor:
        """`self.t()` without the dispatch through aten (which costs eager mode host time). A
        rowwise scale is keepdim-shaped, so it transposes with its data."""
        return self.rewrapped(self._data.t(), self._scale.t())

    def broadcast_scale(self) -> torch.Tensor:
        """The scale, broadcastable against the data (blockwise scales are expanded)."""
        if self._granularity is not ScalingGranularity.BLOCKWISE:
            return self._scale
        (r, c), (sr, sc) = self._data.shape, self._scale.shape
        return self._scale.repeat_interleave(r // sr, 0).repeat_interleave(c // sc, 1)

    def to_hp(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize: `_data / _scale` in `dtype` (default: the original dtype)."""
        data = self._data.to(torch.float32)
        if self._granularity is ScalingGranularity.BLOCKWISE:
            # One scale per block: (R / rows, C / cols) against (R, C) data.
            (r, c), (sr, sc) = data.shape, self._scale.shape
            blocked = data.reshape(sr, r // sr, sc, c // sc) / self._scale[:, None, :, None]
            return blocked.reshape(r, c).to(dtype or self._orig_dtype)
        return (data / self._scale).to(dtype or self._orig_dtype)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype, ScalingGranularity]]:
        return ["_data", "_scale"], (self._orig_dtype, self._granularity)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor],
        ctx: tuple[torch.dtype, ScalingGranularity],
        outer_size: Any,
        outer_stride: Any,
    ) -> Float8Tensor:
        orig_dtype, granularity = ctx
        return Float8Tensor(
            inner_tensors["_data"], inner_tensors["_scale"], orig_dtype, granularity
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        impl = FLOAT8_OPS.get(func)
        if impl is None:
            raise NotImplementedError(
                f"Float8Tensor does not implement {func}: the ops it supports are listed in "
                "fp8train/ops.py. Dequantize first with .to_hp() to run other ops"
            )
        return impl(func, args, kwargs or {})

    # Only aten-level dispatch is intercepted; torch functions decompose to aten as usual.
    __torch_function__ = torch._C._disabled_torch_function_impl
