"""Triton kernels against the torch path they replace: the same float8 bytes, bit for bit.

The kernels run on CUDA only (Triton's CPU interpreter rounds float8 wrongly near powers of
two, so it cannot check bytes); on the CPU the custom op runs the torch path, checked here by
opcheck.
"""

import pytest
import torch

from fp8train.cast import _saturated_cast
from fp8train.config import ScalingGranularity
from fp8train.kernels import HAS_TRITON, quantize_2d
from fp8train.scaling import amax, amax_to_scale
from tests.conftest import FLOAT8_GPU_REASON

needs_triton_gpu = pytest.mark.skipif(
    FLOAT8_GPU_REASON is not None or not HAS_TRITON,
    reason=str(FLOAT8_GPU_REASON or "needs Triton"),
)

# weird shapes: single elements, odd sizes, one row, more rows than a grid dim's block
SHAPES = [(1, 1), (17, 33), (1, 4096), (4097, 130), (256, 8192)]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HP = [torch.float32, torch.bfloat16, torch.float16]
# (granularity, reduce_dim): tensorwise, one scale per row, one scale per column
SCALINGS = [("tensorwise", None), ("rowwise", -1), ("rowwise", 0)]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _check(hp, float8_dtype, granularity, reduce_dim, column_major=False) -> None:  # noqa: ANN001
    scale = amax_to_scale(amax(hp, ScalingGranularity(granularity), reduce_dim), float8_dtype)
    kernel = quantize_2d(hp, scale, float8_dtype, column_major)
    reference = _saturated_cast(hp, scale, float8_dtype)
    assert (kernel.t() if column_major else kernel).is_contiguous()
    assert torch.equal(_bytes(kernel), _bytes(reference))


@needs_triton_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("float8_dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("hp_dtype", HP, ids=str)
@pytest.mark.parametrize(("granularity", "reduce_dim"), SCALINGS)
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major", "column-major"])
def test_quantize_kernel_matches_the_torch_path(
    shape, float8_dtype, hp_dtype, granularity, reduce_dim, column_major
):
    hp = (torch.randn(shape, device="cuda") * 10).to(hp_dtype)
    _check(hp, float8_dtype, granularity, reduce_dim, column_major)


@needs_triton_gpu
@pytest.mark.parametrize("float8_dtype", FLOAT8, ids=str)
def test_quantize_kernel_matches_on_special_values(float8_dtype):
    fp8_max = torch.finfo(float8_dtype).max
    values = [0.0, -0.0, 1e-30, -1e-30, 1e-7, fp8_max, 2 * fp8_max, -3 * fp8_max, 7.76, 0.5]
    values += [float("inf"), float("-inf"), float("nan")]
    hp = torch.tensor(values, device="cuda").repeat(64, 1)
    hp[:, 0] = torch.linspace(-1, 1, 64)
    # A fixed scale: an inf in the data would make a dynamic scale 0 and every product NaN.
    scale = torch.tensor(1.0, device="cuda")
    assert torch.equal(
        _bytes(quantize_2d(hp, scale, float8_dtype)),
        _bytes(_saturated_cast(hp, scale, float8_dtype)),
    )


@needs_triton_gpu
def test_quantize_kernel_reads_strided_input():
    hp = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16).t()  # column-major
    _check(hp, torch.float8_e4m3fn, "tensorwise", None)
    _check(hp[::2, 1:], torch.float8_e4m3fn, "rowwise", -1)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=needs_triton_gpu),
    ],
)
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major", "column-major"])
def test_saturated_cast_op_passes_opcheck(device, column_major):
    hp = torch.randn(33, 65, device=device)
    scale = torch.tensor(4.0, device=device)
    args = (hp, scale, torch.float8_e4m3fn, column_major)
    torch.library.opcheck(torch.ops.fp8train.saturated_cast.default, args)
    out = torch.ops.fp8train.saturated_cast(*args)
    assert (out.t() if column_major else out).is_contiguous()
