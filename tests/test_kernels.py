"""Triton kernels against the torch path they replace: the same float8 bytes, bit for bit.

The kernels run on CUDA only (Triton's CPU interpreter rounds float8 wrongly near powers of
two, so it cannot check bytes); on the CPU the custom op runs the torch path, checked here by
opcheck.
"""

import contextlib
import copy
import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import fp8train.cast
import fp8train.eager
import fp8train.kernels.launch
from fp8train import Float8Linear, Float8LinearConfig
from fp8train.cast import _saturated_cast
from fp8train.config import ScalingGranularity
from fp8train.kernels import (
    HAS_TRITON,
    amax_partials_2d,
    cast_2d,
    column_major_2d,
    empty_scalar,
    partials_count,
    quantize_2d,
)
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
    # Under a given scale an inf becomes NaN, never the saturated maximum, on both paths.
    scale = torch.tensor(1.0, device="cuda")
    kernel = quantize_2d(hp, scale, float8_dtype)
    torch_path = _saturated_cast(hp, scale, float8_dtype, nonfinite_to_nan=True)
    assert torch_path.float()[:, -3:].isnan().all()
    assert torch.equal(_bytes(kernel), _bytes(torch_path))


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
@pytest.mark.parametrize("float8_dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("shape", [(33, 65), (1, 16), (16, 1)], ids=str)
def test_column_major_op_passes_opcheck_and_copies_the_bytes(device, float8_dtype, shape):
    data = (torch.randn(shape, device=device) * 100).to(float8_dtype)
    before = data.clone()
    # Not test_schema: it compares the float8 input before and after with arithmetic that
    # torch does not implement for float8 on the CPU. The op mutates nothing either way.
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fp8train.column_major.default, (data,), test_utils=tests)
    assert torch.equal(_bytes(data), _bytes(before))
    out = torch.ops.fp8train.column_major(data)
    assert out.shape == data.shape and out.dtype == float8_dtype and out.t().is_contiguous()
    assert torch.equal(_bytes(out.t().contiguous()), _bytes(data.t().contiguous()))


@needs_triton_gpu
@pytest.mark.parametrize("shape", [*SHAPES, (0, 8), (64, 64), (63, 65), (8193, 127)], ids=str)
@pytest.mark.parametrize("float8_dtype", FLOAT8, ids=str)
def test_transpose_kernel_copies_every_byte_column_major(shape, float8_dtype):
    # Every bit pattern, NaNs included: the kernel moves bytes, it converts nothing.
    data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(float8_dtype)
    out = column_major_2d(data)
    assert out.shape == data.shape and out.t().is_contiguous()
    assert torch.equal(_bytes(out.t().contiguous()), _bytes(data.t().contiguous()))


def test_transpose_kernel_refuses_what_it_cannot_copy():
    with pytest.raises(ValueError, match="2-D tensor of 1-byte elements"):
        column_major_2d(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="row-major"):
        column_major_2d(torch.zeros(4, 6, dtype=torch.uint8).t())


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
@pytest.mark.parametrize(
    ("granularity", "reduce_dim", "record"),
    # The amax is recorded for tensorwise (delayed) casts only.
    [*((g, d, False) for g, d in SCALINGS), ("tensorwise", None, True)],
    ids=[*(f"{g}-{d}" for g, d in SCALINGS), "tensorwise-record-amax"],
)
def test_cast_kernel_with_a_given_scale_in_both_layouts(
    shape, float8_dtype, hp_dtype, granularity, reduce_dim, record
):
    """Delayed, static and rowwise casts give the scale and ask for both layouts (a bf16
    grad_output with a delayed scale once came out with NaNs here)."""
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


def _tensorwise_amax(hp: torch.Tensor) -> torch.Tensor:
    return amax(hp, ScalingGranularity.TENSORWISE, None)


@needs_triton_gpu
@pytest.mark.parametrize("shape", [*SHAPES, (0, 8), (16, 16), (1, 17), (64 * 1024, 16)], ids=str)
@pytest.mark.parametrize("hp_dtype", HP, ids=str)
def test_amax_partials_kernel_reduces_to_the_torch_amax(shape, hp_dtype):
    """The casts' amax: one slot per program, whose maximum is the amax bit for bit (0 for an
    empty tensor); a fresh, uninitialized buffer every call, or the one given."""
    hp = (torch.randn(shape, device="cuda") * 10).to(hp_dtype)
    expected = _tensorwise_amax(hp) if hp.numel() else torch.zeros((), device="cuda")
    # A transposed view, and a view that starts off the 16-byte alignment.
    views = [hp, hp.t()] + ([hp.flatten()[1:].view(1, -1)] if hp.numel() > 1 else [])
    for view in views:
        want = expected if view.numel() == hp.numel() else _tensorwise_amax(view)
        partials = amax_partials_2d(view)
        assert partials.shape == (partials_count(hp.device),)
        assert partials.dtype == torch.float32
        assert torch.equal(partials.max(), want)
    out = torch.full((partials_count(hp.device),), 1e30, device="cuda")
    assert amax_partials_2d(hp, out) is out and torch.equal(out.max(), expected)


@needs_triton_gpu
def test_amax_partials_keep_nothing_between_launches():
    """A small amax after a large one does not see the large one."""
    big = torch.full((300, 300), 1000.0, device="cuda")
    small = torch.full((5, 7), 0.25, device="cuda")
    for _ in range(3):
        assert amax_partials_2d(big).max().item() == 1000.0
        assert amax_partials_2d(small).max().item() == 0.25


@needs_triton_gpu
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_amax_partials_kernel_gives_inf_for_non_finite_input(bad):
    """A NaN gives inf, which amax_to_scale turns into the same NaN
    scale as the torch path's NaN amax."""
    hp = torch.randn(257, 129, device="cuda")
    hp[200, 100] = bad
    partials = amax_partials_2d(hp)
    assert partials.max().item() == float("inf")
    assert amax_to_scale(partials.max(), E4M3).isnan()
    assert amax_to_scale(_tensorwise_amax(hp), E4M3).isnan()


@needs_triton_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("float8_dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("hp_dtype", HP, ids=str)
@pytest.mark.parametrize("pow2", [False, True], ids=["", "pow2"])
def test_cast_kernel_reduces_partial_maxima_bit_for_bit(shape, float8_dtype, hp_dtype, pow2):
    """A dynamic cast from the partial maxima (two launches, as compiled casts run) gives the
    scale, its inverse and the bytes of a cast from the 0-d amax."""
    hp = (torch.randn(shape, device="cuda") * 10).to(hp_dtype)
    hp_amax = _tensorwise_amax(hp)
    inverse = torch.empty((), device="cuda")
    scale, row, col = cast_2d(
        hp, amax_partials_2d(hp), float8_dtype, row_major=True, column_major=True,
        scale_from_amax=True, round_to_power_of_2=pow2, inverse_out=inverse,
    )  # fmt: skip
    expected_scale = amax_to_scale(hp_amax, float8_dtype, round_to_power_of_2=pow2)
    assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32))
    assert torch.equal(inverse, expected_scale.reciprocal())
    reference = _bytes(_saturated_cast(hp, expected_scale, float8_dtype))
    assert torch.equal(_bytes(row), reference) and torch.equal(_bytes(col), reference)


@pytest.mark.parametrize("device", DEVICES)
def test_amax_op_passes_opcheck_and_feeds_cast_from_amax(device):
    """fp8train::amax gives a 1-D tensor whose maximum is the amax (the kernel's partial
    maxima on CUDA, the amax itself elsewhere), which cast_from_amax takes as it is."""
    hp = torch.randn(33, 65, device=device) * 3
    torch.library.opcheck(torch.ops.fp8train.amax.default, (hp,))
    partials = torch.ops.fp8train.amax(hp)
    assert partials.dim() == 1 and torch.equal(partials.max(), _tensorwise_amax(hp))
    args = (hp, partials, E4M3, False, True, True)
    torch.library.opcheck(torch.ops.fp8train.cast_from_amax.default, args)
    scale, row, col = torch.ops.fp8train.cast_from_amax(*args)
    expected_scale = amax_to_scale(_tensorwise_amax(hp), E4M3)
    assert torch.equal(scale, expected_scale)
    reference = _bytes(_saturated_cast(hp, expected_scale, E4M3))
    assert torch.equal(_bytes(row), reference) and torch.equal(_bytes(col), reference)


@needs_triton_gpu
@pytest.mark.parametrize("shape", [(17, 33), (4097, 130), (300, 1000)], ids=str)
def test_kernels_give_the_same_bytes_over_every_tile_shape(shape):
    """The tile shapes benchmarks/bench_cast.py times: each a correct kernel, not a faster
    wrong one."""
    from benchmarks.bench_cast import AMAX_TILES, CAST_TILES

    hp = (torch.randn(shape, device="cuda") * 10).to(torch.bfloat16)
    hp_amax = _tensorwise_amax(hp)
    reference = _bytes(_saturated_cast(hp, amax_to_scale(hp_amax, E4M3), E4M3))
    for tile in AMAX_TILES:
        assert torch.equal(amax_partials_2d(hp, tile=tile).max(), hp_amax), tile
    for tile in CAST_TILES:
        _, row, col = cast_2d(hp, hp_amax, E4M3, column_major=True, scale_from_amax=True, tile=tile)
        assert torch.equal(_bytes(row), reference) and torch.equal(_bytes(col), reference), tile


@needs_triton_gpu
@pytest.mark.parametrize("shape", [(1, 16), (16, 16), (17, 33), (4097, 130)], ids=str)
@pytest.mark.parametrize("scale_from_amax", [True, False], ids=["from-amax", "given-scale"])
def test_cast_kernel_writes_the_inverse_scale_as_reciprocal_does(shape, scale_from_amax):
    hp = torch.randn(shape, device="cuda") * 3
    hp_amax = _tensorwise_amax(hp)
    given = hp_amax if scale_from_amax else amax_to_scale(hp_amax, E4M3) * 1.37
    for _ in range(2):  # the second launch takes the cached launcher
        inverse = torch.empty((), device="cuda")
        scale, row, _ = cast_2d(
            hp, given, E4M3, scale_from_amax=scale_from_amax, inverse_out=inverse
        )
        assert torch.equal(inverse.view(torch.int32), scale.reciprocal().view(torch.int32))
        assert torch.equal(_bytes(row), _bytes(_saturated_cast(hp, scale, E4M3)))


@needs_triton_gpu
def test_cast_kernel_refuses_an_inverse_of_a_rowwise_scale():
    hp = torch.randn(32, 32, device="cuda")
    scale = torch.ones(32, 1, device="cuda")
    with pytest.raises(ValueError, match="tensorwise"):
        cast_2d(hp, scale, E4M3, inverse_out=torch.empty((), device="cuda"))


@needs_triton_gpu
@pytest.mark.parametrize("rows", [1, 16, 17, 1000])
def test_cached_launch_respecializes_on_shape_and_alignment(rows):
    """The launcher cache keys on what Triton specializes on: a later call with a misaligned
    view or another row count must not reuse a kernel compiled for aligned, 16-divisible
    arguments."""
    base = torch.randn(rows * 48 + 1, device="cuda")
    aligned = base[: rows * 48].view(rows, 48)
    misaligned = base[1:].view(rows, 48)
    for hp in (aligned, misaligned, aligned, misaligned):
        hp_amax = _tensorwise_amax(hp)
        scale, row, col = cast_2d(
            hp, hp_amax, E4M3, row_major=True, column_major=True, scale_from_amax=True
        )
        reference = _bytes(_saturated_cast(hp, amax_to_scale(hp_amax, E4M3), E4M3))
        assert torch.equal(_bytes(row), reference) and torch.equal(_bytes(col), reference)


@needs_triton_gpu
def test_launches_stay_exact_across_clears_of_the_bounded_launcher_cache(monkeypatch):
    """The launcher cache keys ints by value, one key per shape, and is cleared when full:
    launches after a clear go through Triton again and cast the same bytes."""
    monkeypatch.setattr(fp8train.kernels.launch, "MAX_LAUNCHERS", 3)
    fp8train.kernels.launch._LAUNCHERS.clear()
    for rows in (16, 17, 32, 16, 48, 17, 64, 32):
        hp = torch.randn(rows, 64, device="cuda")
        hp_amax = _tensorwise_amax(hp)
        _, row, col = cast_2d(
            hp, hp_amax, E4M3, row_major=True, column_major=True, scale_from_amax=True
        )
        reference = _bytes(_saturated_cast(hp, amax_to_scale(hp_amax, E4M3), E4M3))
        assert torch.equal(_bytes(row), reference) and torch.equal(_bytes(col), reference)
        assert len(fp8train.kernels.launch._LAUNCHERS) <= 3


class _StandInKernel:
    """What `launch` uses of a Triton JITFunction and of the kernel it compiles, on any
    machine: `kernel[grid](...)` (Triton's own path, which compiles, launches and returns the
    compiled kernel) and that kernel's native launcher, each recording its calls."""

    arg_names = ["x_ptr", "n", "flag", "BLOCK"]

    def __init__(self) -> None:
        self.triton_calls, self.native_calls = [], []
        native = self.native_calls.append
        self.compiled = type("Compiled", (), {"function": "function", "packed_metadata": None})()
        self.compiled.run = type(
            "Run",
            (),
            {
                "global_scratch_size": 0, "profile_scratch_size": 0,
                "launch_cooperative_grid": False, "launch_pdl": False,
                "launch": staticmethod(lambda *a: native(a)),
            },
        )()  # fmt: skip

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        def run(*args, num_warps: int, **constexprs):  # noqa: ANN002, ANN003, ANN202
            self.triton_calls.append((grid, args, constexprs, num_warps))
            return self.compiled

        return run


def test_cached_launches_key_on_each_int_and_tensor_alignment_and_stay_bounded(monkeypatch):
    """The launcher cache's logic, with a stand-in kernel (no GPU, no Triton): the first call
    of a key goes through Triton, a repeat straight to the native launcher with the arguments
    and the constexpr values in order; another int, dtype or 16-byte alignment is another key;
    the cache is cleared when full; constexprs out of the kernel's order raise."""
    launch = fp8train.kernels.launch
    monkeypatch.setattr(launch, "LEAN", True)
    monkeypatch.setattr(launch, "_hooked", lambda: False)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda device: 7)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    kernel = _StandInKernel()
    base = torch.zeros(64)
    aligned, misaligned = base[:16], base[1:17]  # 4-byte offset: not 16-byte aligned

    def go(x: torch.Tensor, n: int, flag: bool = True) -> tuple[int, int]:
        launch.launch(kernel, (3,), x, n, flag, BLOCK=32, num_warps=4)
        return len(kernel.triton_calls), len(kernel.native_calls)

    assert go(aligned, 16) == (1, 0)
    assert go(aligned, 16) == (1, 1)
    grid_x, _, _, stream, function, *_, x, n, flag, block = kernel.native_calls[-1]
    assert (grid_x, stream, function, n, flag, block) == (3, 7, "function", 16, True, 32)
    assert x is aligned
    assert go(base[16:32], 16) == (1, 2)  # another aligned tensor of the same dtype: a hit
    assert go(misaligned, 16) == (2, 2)
    assert go(aligned, 17) == (3, 2)
    assert go(aligned, 16, flag=False) == (4, 2)
    assert go(aligned.double(), 16) == (5, 2)
    assert go(misaligned, 16) == (5, 3)
    assert len(launch._LAUNCHERS) == 5

    monkeypatch.setattr(launch, "MAX_LAUNCHERS", 2)
    for n in range(20, 30):
        go(aligned, n)
        assert len(launch._LAUNCHERS) <= 2
    with pytest.raises(TypeError, match="constexprs"):
        launch.launch(kernel, (3,), aligned, 99, True, WRONG=1, num_warps=4)


class _OnSecondGpu(torch.Tensor):
    """A CPU tensor that reports cuda:1 as its device, for the launcher's device logic."""

    def get_device(self) -> int:
        return 1


def test_a_launch_for_tensors_on_another_gpu_runs_on_their_device(monkeypatch):
    """Triton launches on the current device: a layer on another GPU of the process (a model
    spread over several) has its kernels launched under a guard for its own device, on that
    device's stream, from a launcher cached for that device."""
    launch = fp8train.kernels.launch
    monkeypatch.setattr(launch, "LEAN", True)
    monkeypatch.setattr(launch, "_hooked", lambda: False)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    streams, guards, inside = [], [], []
    monkeypatch.setattr(launch, "current_stream", lambda device: streams.append(device) or 7)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})

    @contextlib.contextmanager
    def device_guard(index: int):  # noqa: ANN202
        guards.append(index)
        inside.append(True)
        yield
        inside.pop()

    monkeypatch.setattr(torch.cuda, "device", device_guard)
    kernel = _StandInKernel()
    kernel.compiled.run.launch = staticmethod(lambda *a: kernel.native_calls.append(bool(inside)))
    on_gpu1 = torch.zeros(16).as_subclass(_OnSecondGpu)
    for _ in range(2):  # through Triton, then the cached native launcher
        launch.launch(kernel, (3,), on_gpu1, 16, True, BLOCK=32, num_warps=4)
    assert guards == [1, 1] and streams == [1] and kernel.native_calls == [True]
    assert len(kernel.triton_calls) == 1 and [key[1] for key in launch._LAUNCHERS] == [1]
    launch.launch(kernel, (3,), torch.zeros(16), 16, True, BLOCK=32, num_warps=4)
    assert guards == [1, 1]  # a tensor on the current device (here the CPU stand-in): no guard


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return [out, x.grad, layer.weight.grad]


@needs_triton_gpu
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "policy",
    [{}, {"recompute_weight_cast": False}, {"recompute_input_cast": True}],
    ids=["default", "keep-fp8-weight", "keep-hp-input"],
)
def test_eager_layer_with_the_kernels_matches_the_torch_path(hp_dtype, policy, monkeypatch):
    """Eager mode's direct kernel calls (amax kernel, cast writing its scale and inverse, the
    recast that reuses forward's scale; through the eager fast path where the config takes
    it) give the same output and gradients, bit for bit, as
    the path of compiled code run eagerly (torch's amax, the reciprocal per gemm, a recast
    with its own amax)."""
    base = nn.Linear(256, 320, device="cuda", dtype=hp_dtype)
    layer = Float8Linear.from_float(copy.deepcopy(base), Float8LinearConfig(**policy))
    x = torch.randn(4, 48, 256, device="cuda", dtype=hp_dtype)
    grad = torch.randn(4, 48, 320, device="cuda", dtype=hp_dtype)
    with_kernels = _fwd_bwd(copy.deepcopy(layer), x.view(-1, 256), grad.view(-1, 320))
    monkeypatch.setattr(fp8train.cast, "eager_kernel", lambda hp: False)
    # The general path (the eager fast path, fp8train.eager, calls the kernels directly).
    monkeypatch.setattr(fp8train.eager, "EAGER_DEVICES", frozenset())
    torch_path = _fwd_bwd(copy.deepcopy(layer), x.view(-1, 256), grad.view(-1, 320))
    names = ("output", "grad_input", "grad_weight")
    for name, a, b in zip(names, with_kernels, torch_path, strict=True):
        assert torch.equal(a, b), name


def test_empty_scalar_is_a_0d_fp32_tensor_that_compiles_to_no_kernel():
    """Inductor allocates empty_scalar without a kernel, where a 0-d torch.empty becomes a
    kernel that fills it (fused here with the multiply beside it)."""
    scalar = empty_scalar(torch.device("cpu"))
    assert (scalar.shape, scalar.dtype) == ((), torch.float32)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return empty_scalar(x.device), x * 2

    torch._dynamo.reset()
    (scalar, doubled), codes = run_and_get_code(torch.compile(f, fullgraph=True), torch.ones(8))
    assert scalar.shape == ()
    assert torch.equal(doubled, torch.full((8,), 2.0))
    kernels = re.findall(r"\b(cpp_fused\w*|triton_\w+_fused\w*)", "\n".join(codes))
    assert kernels, "no generated kernel found: the check below would pass vacuously"
    assert not [name for name in kernels if "empty" in name]
