"""One scaled float8 gemm, `a @ b`: torch._scaled_mm for tensorwise and rowwise scales, torch's
block-scaled gemm for blockwise ones where it runs (sm90, CUDA >= 12.9), fp32 emulation
elsewhere. fp8train.matmul builds a linear layer's three gemms from it.

    a (M, K) row-major, b (K, N) column-major, result (M, N) in the requested dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fp8train.config import BLOCK, Gemm, ScalingGranularity
from fp8train.tensor import Float8Tensor

ALIGNMENT = 16
"""torch._scaled_mm on CUDA needs the inner dim and the output columns to be multiples of 16."""


def weight_gradient_follows(weight: torch.Tensor) -> bool:
    """True if backward will compute `weight`'s gradient (the grad_weight gemm): not under
    no_grad or inference_mode, nor for a frozen weight."""
    return weight.requires_grad and torch.is_grad_enabled()


def grad_weight_tokens_misaligned(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """True if a weight gradient will follow and the number of tokens, that gemm's inner dim,
    is not a multiple of ALIGNMENT. Without one no gemm minds the token count: the output and
    grad_input gemms take any number of rows."""
    tokens = input.numel() // input.shape[-1] if input.shape[-1] else 0
    return bool(weight_gradient_follows(weight) and tokens % ALIGNMENT)


# torch._scaled_mm on the CPU takes rowwise scales from torch 2.13 on; before, an internal
# assert fires, and rowwise gemms on the CPU are emulated instead.
_CPU_ROWWISE = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)

# What the inner dim and the output columns of each gemm are, for error messages.
_DIM_NAMES: dict[Gemm, tuple[str, str]] = {
    Gemm.OUTPUT: ("in_features", "out_features"),
    Gemm.GRAD_INPUT: ("out_features", "in_features"),
    Gemm.GRAD_WEIGHT: ("the number of tokens (input.numel() // in_features)", "in_features"),
}


def scaled_mm(
    a: Float8Tensor,
    b: Float8Tensor,
    *,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
    emulate: bool = False,
    pad_inner_dim: bool = False,
    gemm: Gemm = Gemm.OUTPUT,
) -> torch.Tensor:
    """`a @ b` for float8 `a` (M, K) and `b` (K, N), result in `out_dtype`.

    `emulate` dequantizes both and multiplies in fp32 (any device, any shape; also rowwise
    on the CPU before torch 2.13, which has no CPU kernel for it). Otherwise
    torch._scaled_mm runs with `a` row-major and `b` column-major; K and N must be multiples
    of 16, or are padded with zeros when `pad_inner_dim` (zeros add nothing to the sums).
    Blockwise operands take torch's block-scaled gemm where it runs (`block_scaled_gemm_runs`)
    and are emulated elsewhere.
    """
    if a._granularity is ScalingGranularity.BLOCKWISE and not emulate:
        if block_scaled_gemm_runs(a, b, out_dtype):
            return _block_scaled_mm(a, b, out_dtype)
        emulate = True  # no block-scaled gemm here (CPU, not sm90, CUDA < 12.9, fp16 output)
    # Rowwise by granularity, not by the scale's size: one token's rowwise scale is (1, 1).
    rowwise = a._granularity is ScalingGranularity.ROWWISE
    if emulate or (a._data.device.type == "cpu" and not _CPU_ROWWISE and rowwise):
        out = torch.mm(a.to_hp(torch.float32), b.to_hp(torch.float32)).to(out_dtype)
        # torch 2.11's dynamo traced the backward of an autograd.Function whose forward
        # returns this mm itself (fp32 out, no copy) with zeros for grad_output: every
        # gradient came out 0. A copy of it does not (tests/test_compile.py, on torch 2.11).
        return out.clone() if out_dtype == torch.float32 and torch.compiler.is_compiling() else out
    a_data, b_data = a._data, b._data
    # _scaled_mm takes the fp8 -> hp scales; 0-d for tensorwise, (M, 1) and (1, N) rowwise.
    a_inv_scale, b_inv_scale = _inverse_scale(a), _inverse_scale(b)
    k, n = b_data.shape
    pad_k, pad_n = -k % ALIGNMENT, -n % ALIGNMENT
    if pad_k or pad_n:
        if not pad_inner_dim:
            raise ValueError(misaligned_message(gemm, k, n))
        a_data = _pad_float8(a_data, (0, pad_k))
        b_data = _pad_float8(b_data, (0, pad_n, 0, pad_k))
        if b_inv_scale.numel() > 1:
            b_inv_scale = F.pad(b_inv_scale, (0, pad_n), value=1.0)
    if not a_data.is_contiguous():
        a_data = a_data.contiguous()
    if not b_data.t().is_contiguous():
        b_data = b_data.t().contiguous().t()
    out = torch._scaled_mm(
        a_data,
        b_data,
        a_inv_scale,
        b_inv_scale,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )
    return out[:, :n] if pad_n else out


def _inverse_scale(fp8: Float8Tensor) -> torch.Tensor:
    """The fp8 -> hp scale: the one the eager cast kernel wrote, else the reciprocal."""
    if fp8._inv_scale is not None and not torch.compiler.is_compiling():
        return fp8._inv_scale
    return fp8._scale.reciprocal()


@functools.cache
def _has_block_scaled_gemm(device_index: int | None) -> bool:
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return (
        hasattr(F, "scaled_mm")
        and cuda >= (12, 9)
        and torch.cuda.get_device_capability(device_index) == (9, 0)
    )


def block_scaled_gemm_runs(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> bool:
    """True where torch's block-scaled gemm (cuBLAS, DeepSeek-V3's scaling) takes `a @ b`:
    sm90 with CUDA >= 12.9, bf16 or fp32 output, `a` in 1 x BLOCK blocks along K and `b` in
    BLOCK x BLOCK blocks or BLOCK x 1 blocks along K, every dim a multiple of BLOCK.
    Elsewhere blockwise gemms are emulated."""
    if not (
        a._data.is_cuda
        and out_dtype in (torch.bfloat16, torch.float32)
        and _has_block_scaled_gemm(a._data.device.index)
    ):
        return False
    (m, k), n = a._data.shape, b._data.shape[1]
    blocks = k // BLOCK
    return (
        b._granularity is ScalingGranularity.BLOCKWISE
        # Training's gemms have multiples of BLOCK rows (the tokens, checked in forward); other
        # row counts (evaluation) have not run through cuBLAS's block-scaled gemm here yet.
        and m % BLOCK == 0
        and k % BLOCK == 0
        and tuple(a._scale.shape) == (m, blocks)
        and tuple(b._scale.shape) in ((blocks, n // BLOCK), (blocks, n))
        and n % BLOCK == 0
    )


def _block_scaled_mm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    a_inv, b_inv = a._scale.reciprocal(), b._scale.reciprocal()
    if torch.compiler.is_compiling():
        # dynamo cannot trace torch's scaled_mm (torch 2.11): an opaque op of ours instead.
        return _block_scaled_mm_op(a._data, a_inv, b._data, b_inv, out_dtype)
    return _block_scaled_mm_impl(a._data, a_inv, b._data, b_inv, out_dtype)


def _block_scaled_mm_impl(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # The layouts cuBLAS reads (torch's scaled_mm checks them): 1 x BLOCK scales of an (R, C)
    # operand as (R, C / BLOCK) with stride (1, R); BLOCK x BLOCK scales of b (K, N) as
    # (L4, N / BLOCK) with stride (1, L4), where L4 is K / BLOCK rounded up to a multiple of 4
    # (the padding is never read as a block). Both take the float8 -> high-precision scales.
    n = b.shape[1]
    a_scale = a_inv.t().contiguous().t()
    if b_inv.shape[1] == n:  # b in BLOCK x 1 blocks along K: b.T in 1 x BLOCK blocks
        b_scale, b_recipe = b_inv.contiguous().t(), F.ScalingType.BlockWise1x128
    else:
        pad = -b_inv.shape[0] % 4
        b_scale = F.pad(b_inv.t(), (0, pad)).contiguous().t()
        b_recipe = F.ScalingType.BlockWise128x128
    a = a if a.is_contiguous() else a.contiguous()
    b = b if b.t().is_contiguous() else b.t().contiguous().t()
    # No fast-accumulation flag: the block-scaled kernels rescale the sum at every K block.
    return F.scaled_mm(
        a, b, a_scale, F.ScalingType.BlockWise1x128, b_scale, b_recipe, output_dtype=out_dtype
    )


# The same function as an op for compiled code; eager calls it directly (no op dispatch).
_block_scaled_mm_op = torch.library.custom_op("fp8train::block_scaled_mm", mutates_args=())(
    _block_scaled_mm_impl
)


@_block_scaled_mm_op.register_fake
def _(a, a_inv, b, b_inv, out_dtype):  # noqa: ANN001, ANN202
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _pad_float8(data: torch.Tensor, pad: tuple[int, ...]) -> torch.Tensor:
    if not any(pad):
        return data
    # Pad the bytes: 0x00 is +0.0 in both float8 formats, and pad has no float8 kernels.
    return F.pad(data.view(torch.uint8), pad).view(data.dtype)


def misaligned_message(gemm: Gemm, k: int, n: int, fqn: str = "") -> str:
    inner_name, out_name = _DIM_NAMES[gemm]
    bad = [f"{name}={size}" for name, size in ((inner_name, k), (out_name, n)) if size % 16]
    layer = f"Float8Linear '{fqn}'" if fqn else "Float8Linear"
    fix = (
        "make batch * sequence length a multiple of 16"
        if gemm is Gemm.GRAD_WEIGHT and k % 16
        else "leave this layer out with module_filter_fn"
    )
    return (
        f"{layer}: {' and '.join(bad)} not a multiple of 16, which the float8 {gemm.value} "
        f"gemm needs: set pad_inner_dim=True in Float8LinearConfig, or {fix}"
    )
