"""Triton kernels against the torch path they replace: the same float8 bytes, bit for bit.

The kernels run on CUDA only (Triton's CPU interpreter rounds float8 wrongly near powers of
two, so it cannot check bytes); on the CPU the custom op runs the torch path, checked here by
opcheck.
"""

import pytest
import torch

from fp8train.cast import _saturated_cast
from fp8train.config import ScalingGranularity
from fp8train.kernels import HAS_TRITON, cast_2d, quantize_2d
from fp8train.scaling import amax, amax_to_scale
from tests.conftest import FLOAT8_GPU_REASON

needs_triton_gpu = pytest.mark.skipif(
    FLOAT8_GPU_REASON is not None or not HAS_TRITON,
    reason=str(FLOAT8_GPU_REASON or "needs Triton"),
)

# weird shapes: single elements, odd sizes, one row, more rows than a grid dim's block
SHAPES = [(1, 1), (17, 33), (1, 4096), (4097, 130), (256, 8192)]
E4M3 = torch.float8_e4m3fn
FLOAT8 = [E4M3, torch.float8_e5m2]
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


DEVICES = ["cpu", pytest.param("cuda", marks=needs_triton_gpu)]
LAYOUTS = [(True, False), (False, True), (True, True)]
LAYOUT_IDS = ["row", "column", "both"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("row", "col"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("record", [False, True], ids=["", "record-amax"])
def test_saturated_cast_op_passes_opcheck(device, row, col, record):
    hp = torch.randn(33, 65, device=device)
    scale = torch.tensor(4.0, device=device)
    amax_buffer = torch.zeros((), device=device) if record else None
    args = (hp, scale, torch.float8_e4m3fn, row, col, amax_buffer)
    torch.library.opcheck(torch.ops.fp8train.saturated_cast.default, args)
    outs = torch.ops.fp8train.saturated_cast(*args)
    for out, column_major, asked in zip(outs, (False, True), (row, col), strict=True):
        if not asked:
            assert out.numel() == 0
            continue
        assert (out.t() if column_major else out).is_contiguous()
        assert torch.equal(_bytes(out), _bytes(_saturated_cast(hp, scale, torch.float8_e4m3fn)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("row", "col"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("pow2", [False, True], ids=["", "pow2"])
def test_cast_from_amax_op_passes_opcheck(device, row, col, pow2):
    hp = torch.randn(33, 65, device=device)
    hp_amax = hp.abs().max()
    args = (hp, hp_amax, torch.float8_e5m2, pow2, row, col)
    torch.library.opcheck(torch.ops.fp8train.cast_from_amax.default, args)
    scale, *outs = torch.ops.fp8train.cast_from_amax(*args)
    assert torch.equal(scale, amax_to_scale(hp_amax, torch.float8_e5m2, round_to_power_of_2=pow2))
    assert [out.numel() > 0 for out in outs] == [row, col]


@needs_triton_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("float8_dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("hp_dtype", HP, ids=str)
@pytest.mark.parametrize("pow2", [False, True], ids=["", "pow2"])
def test_cast_kernel_scales_from_the_amax_bit_for_bit_in_both_layouts(
    shape, float8_dtype, hp_dtype, pow2
):
    hp = (torch.randn(shape, device="cuda") * 10).to(hp_dtype)
    hp_amax = amax(hp, ScalingGranularity.TENSORWISE, None)
    scale, row, col = cast_2d(
        hp, hp_amax, float8_dtype, row_major=True, column_major=True,
        scale_from_amax=True, round_to_power_of_2=pow2,
    )  # fmt: skip
    expected_scale = amax_to_scale(hp_amax, float8_dtype, round_to_power_of_2=pow2)
    assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32))
    reference = _bytes(_saturated_cast(hp, expected_scale, float8_dtype))
    assert row.is_contiguous() and col.t().is_contiguous()
    assert torch.equal(_bytes(row), reference) and torch.equal(_bytes(col), reference)


@needs_triton_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("float8_dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("hp_dtype", HP, ids=str)
@pytest.mark.parametrize(("granularity", "reduce_dim"), SCALINGS)
@pytest.mark.parametrize("record", [False, True], ids=["", "record-amax"])
def test_cast_kernel_with_a_given_scale_in_both_layouts(
    shape, float8_dtype, hp_dtype, granularity, reduce_dim, record
):
    """Delayed, static and rowwise casts give the scale and ask for both layouts (a bf16
    grad_output with a delayed scale once came out with NaNs here)."""
    if record and granularity != "tensorwise":
        pytest.skip("the amax is recorded for tensorwise (delayed) casts only")
    hp = (torch.randn(shape, device="cuda") * 10).to(hp_dtype)
    scale = amax_to_scale(amax(hp, ScalingGranularity(granularity), reduce_dim), float8_dtype)
    buffer = torch.zeros((), device="cuda") if record else None
    _, row, col = cast_2d(
        hp, scale, float8_dtype, row_major=True, column_major=True, record_amax=buffer
    )
    reference = _bytes(_saturated_cast(hp, scale, float8_dtype))
    assert row.is_contiguous() and col.t().is_contiguous()
    assert torch.equal(_bytes(row), reference) and torch.equal(_bytes(col), reference)
    if record:
        assert torch.equal(buffer, amax(hp, ScalingGranularity.TENSORWISE, None))


@needs_triton_gpu
@pytest.mark.parametrize(
    "amax_value", [0.0, 1e-30, 3e-5, 1.0, 447.9, 448.0, 1e30, 3.3e38, float("inf"), float("nan")]
)
@pytest.mark.parametrize("pow2", [False, True], ids=["", "pow2"])
def test_cast_kernel_scale_matches_amax_to_scale_on_edge_amaxes(amax_value, pow2):
    hp = torch.ones(4, 4, device="cuda")
    hp_amax = torch.tensor(amax_value, device="cuda")
    scale, _, _ = cast_2d(hp, hp_amax, E4M3, scale_from_amax=True, round_to_power_of_2=pow2)
    expected = amax_to_scale(hp_amax, E4M3, round_to_power_of_2=pow2)
    assert torch.equal(scale, expected) or (scale.isnan() and expected.isnan())


@needs_triton_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("hp_dtype", HP, ids=str)
def test_cast_kernel_records_the_amax_in_the_same_pass(shape, hp_dtype):
    hp = (torch.randn(shape, device="cuda") * 10).to(hp_dtype)
    scale = torch.tensor(3.0, device="cuda")
    earlier = torch.tensor(0.5, device="cuda")  # the buffer keeps the max over the step
    buffer = earlier.clone()
    _, row, _ = cast_2d(hp, scale, E4M3, record_amax=buffer)
    expected = torch.maximum(earlier, amax(hp, ScalingGranularity.TENSORWISE, None))
    assert torch.equal(buffer, expected)
    assert torch.equal(_bytes(row), _bytes(_saturated_cast(hp, scale, E4M3)))


@needs_triton_gpu
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_recording_cast_makes_non_finite_values_nan_and_the_amax_non_finite(bad):
    hp = torch.randn(64, 64, device="cuda")
    hp[3, 5] = bad
    buffer = torch.zeros((), device="cuda")
    _, row, _ = cast_2d(hp, torch.tensor(1.0, device="cuda"), E4M3, record_amax=buffer)
    assert buffer.item() == float("inf")
    decoded = row.float()
    assert decoded[3, 5].isnan() and decoded.isfinite().sum() == hp.numel() - 1
