"""The one cast path: amax -> scale -> saturated float8, tensorwise and rowwise."""

import pytest
import torch

from fp8train import (
    Float8LinearConfig,
    Float8Tensor,
    Gemm,
    Role,
    ScalingGranularity,
    compute_error,
    to_float8,
)
from fp8train.cast import cast_for_gemm, quantize
from fp8train.scaling import EPS, amax_to_scale
from tests.conftest import DEVICES, all_roles_config, hp_grad_weight_config

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Largest relative rounding error of a normal float8 number: half an ulp, 2^-(mantissa bits+1).
REL_ERROR = {E4M3: 2.0**-4, E5M2: 2.0**-3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
def test_tensorwise_scale_maps_amax_to_float8_max(device, fp8_dtype, hp_dtype):
    hp = (torch.randn(64, 48, device=device) * 3).to(hp_dtype)
    fp8 = to_float8(hp, fp8_dtype)
    assert isinstance(fp8, Float8Tensor)
    assert fp8._data.dtype == fp8_dtype and fp8.dtype == hp_dtype
    assert fp8._scale.dtype == torch.float32 and fp8._scale.dim() == 0
    amax = hp.abs().max().float()
    torch.testing.assert_close(fp8._scale, torch.finfo(fp8_dtype).max / amax)
    # The largest element lands on (or within rounding of) the largest float8 value.
    assert fp8._data.float().abs().max() == torch.finfo(fp8_dtype).max


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
def test_round_trip_error_is_within_half_an_ulp(device, fp8_dtype, hp_dtype):
    hp = (torch.randn(128, 64, device=device) * 10).to(hp_dtype)
    back = to_float8(hp, fp8_dtype).to_hp(torch.float32)
    hp32 = hp.float()
    # Only elements in float8's normal range (the rest are subnormals, absolute error).
    normal = (
        hp32.abs() * (torch.finfo(fp8_dtype).max / hp32.abs().max()) >= torch.finfo(fp8_dtype).tiny
    )
    rel = ((back - hp32).abs() / hp32.abs())[normal]
    # The hp dtype's own rounding of the dequantized value adds at most its own half ulp.
    slack = {torch.float32: 0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[hp_dtype]
    assert rel.max().item() <= REL_ERROR[fp8_dtype] + slack + 1e-6


@pytest.mark.parametrize("reduce_dim,scale_shape", [(-1, (32, 1)), (0, (1, 48))])
def test_rowwise_scales_reduce_along_the_given_dim(reduce_dim, scale_shape):
    hp = torch.randn(32, 48)
    hp[3] *= 1e5  # one huge row: under tensorwise scaling the others sink into subnormals
    fp8 = to_float8(hp, E4M3, "rowwise", reduce_dim=reduce_dim)
    assert fp8._scale.shape == scale_shape
    expected = 448.0 / hp.abs().amax(dim=reduce_dim, keepdim=True)
    torch.testing.assert_close(fp8._scale, expected)
    if reduce_dim == -1:
        small = torch.arange(32) != 3
        rowwise_sqnr = compute_error(hp[small], fp8.to_hp()[small])
        tensorwise_sqnr = compute_error(hp[small], to_float8(hp, E4M3).to_hp()[small])
        assert rowwise_sqnr > 25 and rowwise_sqnr > tensorwise_sqnr + 10


@pytest.mark.parametrize(
    ("granularity", "reduce_dim", "block", "shape"),
    [
        (ScalingGranularity.TENSORWISE, None, None, (37, 48)),
        (ScalingGranularity.TENSORWISE, None, None, (5, 9, 48)),  # pieces of the first dim
        (ScalingGranularity.ROWWISE, -1, None, (37, 48)),  # a scale per row: cut with the rows
        (ScalingGranularity.ROWWISE, 0, None, (37, 48)),  # a scale per column: shared
        (ScalingGranularity.BLOCKWISE, None, (1, 128), (256, 256)),  # pieces of rows
        (ScalingGranularity.BLOCKWISE, None, (128, 128), (512, 256)),  # pieces of block rows
    ],
)
def test_eager_pieces_give_the_bytes_of_one_pass(
    monkeypatch, granularity, reduce_dim, block, shape
):
    import fp8train.cast

    hp = torch.randn(shape) * 100
    hp.view(-1)[::7] = 1e-30  # subnormals and saturated values in every piece
    hp.view(-1)[::11] = 1e6
    # Rows of different magnitudes: rowwise scales that differ from row to row.
    hp *= torch.logspace(-3, 3, shape[0]).view(-1, *[1] * (len(shape) - 1))
    casts = []
    monkeypatch.setattr(fp8train.cast, "EAGER_PIECE_MIN_ELEMENTS", 0)
    for pieces in (1, 4, 1000):  # whole, 4 pieces, one row each
        monkeypatch.setattr(fp8train.cast, "EAGER_PIECES", pieces)
        fp8 = to_float8(hp, E4M3, granularity, reduce_dim=reduce_dim, block=block)
        casts.append(fp8._data.view(torch.uint8))
    assert all(torch.equal(casts[0], other) for other in casts[1:])


def test_eager_pieces_turn_an_inf_into_nan_under_a_given_scale(monkeypatch):
    import fp8train.cast

    monkeypatch.setattr(fp8train.cast, "EAGER_PIECE_MIN_ELEMENTS", 0)
    hp = torch.ones(16, 8)
    hp[13, 2] = float("inf")
    fp8 = quantize(hp, torch.tensor(2.0), E4M3)
    assert fp8._data.float().isnan().nonzero().tolist() == [[13, 2]]
    assert (fp8._data.float()[~hp.isinf()] == 2).all()


def test_saturates_instead_of_overflowing():
    hp = torch.tensor([1.0, 2.0, 1000.0, -1000.0])
    fp8 = quantize(hp, torch.tensor(1.0), E4M3)
    assert fp8._data.float().tolist() == [1.0, 2.0, 448.0, -448.0]
    assert not torch.isnan(fp8._data.float()).any()


def test_all_zeros_give_a_finite_scale_and_zeros():
    fp8 = to_float8(torch.zeros(16, 16), E4M3)
    assert torch.isfinite(fp8._scale) and fp8._scale > 0
    torch.testing.assert_close(fp8._scale, torch.tensor(448.0 / EPS))
    assert (fp8.to_hp() == 0).all()


def test_power_of_2_scales_round_down():
    amax = torch.tensor([3.0, 0.5, 448.0, 1e-3])
    scale = amax_to_scale(amax, E4M3, round_to_power_of_2=True)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    assert (scale <= 448.0 / amax).all() and (scale > 224.0 / amax).all()


def test_nan_input_propagates():
    hp = torch.randn(8, 8)
    hp[2, 3] = float("nan")
    assert torch.isnan(to_float8(hp, E4M3).to_hp()).any()


@pytest.mark.parametrize(
    "role,gemm,rowwise_scale_shape",
    [
        (Role.INPUT, Gemm.OUTPUT, (32, 1)),
        (Role.INPUT, Gemm.GRAD_WEIGHT, (1, 48)),
        (Role.WEIGHT, Gemm.OUTPUT, (32, 1)),
        (Role.WEIGHT, Gemm.GRAD_INPUT, (1, 48)),
        (Role.GRAD_OUTPUT, Gemm.GRAD_INPUT, (32, 1)),
        (Role.GRAD_OUTPUT, Gemm.GRAD_WEIGHT, (1, 48)),
    ],
)
def test_cast_for_gemm_follows_role_and_gemm(role, gemm, rowwise_scale_shape):
    hp = torch.randn(32, 48)
    tensorwise = cast_for_gemm(hp, role, gemm, Float8LinearConfig())
    expected_dtype = E5M2 if role is Role.GRAD_OUTPUT else E4M3
    assert tensorwise._data.dtype == expected_dtype and tensorwise._scale.dim() == 0
    config = all_roles_config("rowwise")
    assert cast_for_gemm(hp, role, gemm, config)._scale.shape == rowwise_scale_shape


def test_disabled_cast_returns_the_hp_tensor():
    config = hp_grad_weight_config()
    hp = torch.randn(4, 4)
    assert cast_for_gemm(hp, Role.INPUT, Gemm.GRAD_WEIGHT, config) is hp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("shape", "granularity", "reduce_dim"),
    [((0, 64), "tensorwise", None), ((0, 64), "rowwise", -1), ((0, 64), "rowwise", 0),
     ((16, 0), "rowwise", -1), ((16, 0), "tensorwise", None)],
)  # fmt: skip
def test_an_empty_tensor_casts_to_an_empty_float8_tensor_with_finite_scales(
    device, shape, granularity, reduce_dim
):
    fp8 = to_float8(
        torch.randn(shape, device=device), E4M3, ScalingGranularity(granularity),
        reduce_dim=reduce_dim,
    )  # fmt: skip
    assert fp8.shape == shape and fp8.to_hp().shape == shape
    assert torch.isfinite(fp8._scale).all()


@pytest.mark.parametrize(
    ("hp", "float8_dtype", "error", "match"),
    [
        (torch.ones(4, 16, dtype=torch.int64), E4M3, TypeError, "int64 is not float32"),
        (torch.ones(4, 16, dtype=torch.float64), E4M3, TypeError, "float64 is not float32"),
        (torch.ones(4, 16), torch.bfloat16, ValueError, "bfloat16 is not a float8 dtype"),
    ],
)
def test_to_float8_refuses_what_it_cannot_cast_by_name(hp, float8_dtype, error, match):
    with pytest.raises(error, match=match):
        to_float8(hp, float8_dtype)


def test_to_float8_takes_granularity_names_and_names_a_missing_or_bad_argument():
    hp = torch.randn(128, 256)
    assert to_float8(hp, E4M3, "tensorwise")._scale.shape == ()
    assert to_float8(hp, E4M3, "blockwise", block=(1, 128))._scale.shape == (128, 2)
    with pytest.raises(ValueError, match="'tensorwize' is not a ScalingGranularity"):
        to_float8(hp, E4M3, "tensorwize")
    with pytest.raises(ValueError, match="rowwise scaling needs reduce_dim.*got None"):
        to_float8(hp, E4M3, "rowwise")
    with pytest.raises(ValueError, match="within the tensor's 2 dims; got 5"):
        to_float8(hp, E4M3, "rowwise", reduce_dim=5)
    with pytest.raises(ValueError, match=r"blockwise scaling needs block=\(rows, cols\)"):
        to_float8(hp, E4M3, "blockwise")
    with pytest.raises(ValueError, match=r"whose dims the block \(128, 128\) divides"):
        to_float8(torch.randn(2, 128, 256), E4M3, "blockwise", block=(128, 128))
