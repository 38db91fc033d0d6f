"""amax -> scale: how much a high-precision tensor is stretched before the float8 cast.

Convention everywhere in fp8train: `fp8 = saturate(hp * scale)` and `hp ~= fp8 / scale`.
torch._scaled_mm takes the inverse (fp8 -> hp) scales; `gemm.scaled_mm` inverts them.
"""

from __future__ import annotations

import torch

from fp8train.config import ScalingGranularity

EPS = 1e-12
"""amax floor: an all-zero tensor gets a large finite scale instead of inf."""


def amax(
    hp: torch.Tensor,
    granularity: ScalingGranularity,
    reduce_dim: int | None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """max |hp| in fp32: 0-d for tensorwise; for rowwise, reduced along `reduce_dim`, keepdim;
    for blockwise, one per `block` (rows, cols) of a 2-D `hp`: (R / rows, C / cols)."""
    if granularity is ScalingGranularity.BLOCKWISE:
        return _block_amax(hp, block)
    # vector_norm(ord=inf) reads the tensor once and makes no |hp| temporary, unlike abs().max().
    if granularity is ScalingGranularity.TENSORWISE:
        if hp.numel() == 0:  # the maximum of nothing: 0, which gives the floor's scale
            return hp.new_zeros((), dtype=torch.float32)
        return torch.linalg.vector_norm(hp, ord=float("inf"), dtype=torch.float32)
    if reduce_dim is None:
        raise ValueError("rowwise scaling needs the dim to reduce along (the gemm's inner dim)")
    if hp.shape[reduce_dim] == 0:
        shape = list(hp.shape)
        shape[reduce_dim] = 1
        return hp.new_zeros(shape, dtype=torch.float32)
    return torch.linalg.vector_norm(
        hp, ord=float("inf"), dim=reduce_dim, keepdim=True, dtype=torch.float32
    )


def _block_amax(hp: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        raise ValueError("blockwise scaling needs the block shape")
    return torch.linalg.vector_norm(
        blocks(hp, block), ord=float("inf"), dim=(1, 3), dtype=torch.float32
    )


def blocks(tensor: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A 2-D (R, C) tensor viewed as (R / rows, rows, C / cols, cols) blocks."""
    (r, c), (rows, cols) = tensor.shape, block
    if r % rows or c % cols:
        raise ValueError(
            f"blockwise scaling with {rows} x {cols} blocks needs a shape divisible by them, "
            f"got {r} x {c}"
        )
    return tensor.reshape(r // rows, rows, c // cols, cols)


def amax_to_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype, *, round_to_power_of_2: bool = False
) -> torch.Tensor:
    """The fp32 scale that maps `amax` onto the largest finite value of `float8_dtype`.

    Finite amax (zero included, through the EPS floor) gives a finite, positive scale. An inf
    or NaN amax gives a NaN scale, so every value of that cast becomes NaN and the non-finite
    input reaches the loss and the gradient norm, as in bf16. A 0 scale, which inf would give,
    would silently zero the finite values instead.
    """
    amax = amax.to(torch.float32)
    scale = torch.finfo(float8_dtype).max / amax.clamp(min=EPS)
    if round_to_power_of_2:
        scale = round_down_to_power_of_2(scale)
    # amax - amax is 0 for a finite amax and NaN otherwise. No NaN constant: the compile
    # partitioner's CSE compares op arguments with ==, and NaN != NaN, so a NaN literal (or a
    # scalar tensor made per call) kept it from merging the identical casts of an input that
    # several layers read (attention's q, k and v).
    return scale + (amax - amax)


def round_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of 2 <= each positive fp32 `scale`: its exponent bits alone. Down, so
    that amax * scale still fits; a power of 2 multiplies exactly. (exp2(floor(log2(s))) can
    round up when s lies just below a power of 2.) Scales are never subnormal: the largest fp32
    amax still gives a normal scale."""
    return (scale.view(torch.int32) & 0x7F800000).view(torch.float32)


def raise_amax(buffer: torch.Tensor, hp: torch.Tensor) -> torch.Tensor:
    """Raise the 0-d fp32 `buffer` to max |hp| in place (delayed scaling's running amax);
    returns this tensor's own amax."""
    if torch.compiler.is_compiling() and hp.dim() >= 2:
        # The maxima of the rows, then theirs (the same value). Compiled, this amax rides
        # along with a cast that does not wait for it (delayed scaling with an earlier step's
        # scale): a reduction along the last dim walks hp as the cast does, so inductor can
        # take both in one kernel, where a reduction of the whole tensor is split into stages
        # of another shape. tests/test_delayed.py checks the one read on CUDA.
        rows = torch.linalg.vector_norm(hp, ord=float("inf"), dim=-1, dtype=torch.float32)
        current = rows.amax()
    else:
        current = amax(hp, ScalingGranularity.TENSORWISE, None)
    buffer.copy_(torch.maximum(buffer, current))
    return current
