"""Float8Tensor: its op table, strictness and flatten/unflatten."""

import pytest
import torch

from fp8train import Float8Tensor, to_float8
from fp8train.gemm import scaled_mm

E4M3 = torch.float8_e4m3fn


def test_construction_checks_dtypes():
    with pytest.raises(TypeError, match="data must be float8"):
        Float8Tensor(torch.randn(2, 2), torch.tensor(1.0), torch.float32)
    with pytest.raises(TypeError, match="scale must be float32"):
        Float8Tensor(torch.zeros(2, 2, dtype=E4M3), torch.tensor(1.0).half(), torch.float32)


def test_looks_like_its_high_precision_tensor():
    fp8 = to_float8(torch.randn(6, 4, dtype=torch.bfloat16), E4M3)
    assert fp8.dtype == torch.bfloat16 and fp8.shape == (6, 4)
    assert "Float8Tensor" in repr(fp8) and "float8_e4m3fn" in repr(fp8)


def test_listed_ops_keep_data_and_scale_consistent():
    hp = torch.randn(6, 4)
    fp8 = to_float8(hp, E4M3)
    reference = fp8.to_hp()
    torch.testing.assert_close(fp8.t().to_hp(), reference.t())
    torch.testing.assert_close(fp8.transpose(0, 1).to_hp(), reference.t())
    torch.testing.assert_close(fp8.view(4, 6).to_hp(), reference.view(4, 6))
    torch.testing.assert_close(fp8.reshape(24).to_hp(), reference.reshape(24))
    torch.testing.assert_close(fp8.detach().to_hp(), reference)
    clone = fp8.clone()
    assert clone._data.data_ptr() != fp8._data.data_ptr()
    torch.testing.assert_close(clone.to_hp(), reference)
    # Asking for a dtype dequantizes.
    converted = fp8.to(torch.float16)
    assert type(converted) is torch.Tensor and converted.dtype == torch.float16
    torch.testing.assert_close(converted.float(), reference, atol=1e-2, rtol=1e-3)


def test_rowwise_transpose_moves_the_scales_and_view_is_refused():
    fp8 = to_float8(torch.randn(6, 4), E4M3, "rowwise", reduce_dim=-1)
    transposed = fp8.t()
    assert transposed._scale.shape == (1, 6)
    torch.testing.assert_close(transposed.to_hp(), fp8.to_hp().t())
    with pytest.raises(NotImplementedError, match="only tensorwise Float8Tensors can be reshaped"):
        fp8.view(24)


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t + 1,
        lambda t: t * t,
        lambda t: torch.relu(t),
        lambda t: t.sum(),
        lambda t: torch.cat([t, t]),
    ],
    ids=["add", "mul", "relu", "sum", "cat"],
)
def test_unlisted_ops_raise(op):
    fp8 = to_float8(torch.randn(4, 4), E4M3)
    with pytest.raises(NotImplementedError, match=r"Float8Tensor does not implement aten\..*to_hp"):
        op(fp8)


def test_mm_of_two_float8_tensors_is_the_scaled_gemm():
    a = to_float8(torch.randn(32, 64), E4M3)
    b = to_float8(torch.randn(48, 64), E4M3).t()
    out = torch.mm(a, b)
    torch.testing.assert_close(out, scaled_mm(a, b, out_dtype=torch.float32))
    torch.testing.assert_close(out, a.to_hp() @ b.to_hp(), atol=1e-3, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="mm of a Float8Tensor with a high-precision"):
        torch.mm(a, torch.randn(64, 8))


def test_flatten_unflatten_round_trip():
    fp8 = to_float8(torch.randn(8, 16, dtype=torch.bfloat16), E4M3, "rowwise", reduce_dim=-1)
    names, ctx = fp8.__tensor_flatten__()
    inner = {name: getattr(fp8, name) for name in names}
    rebuilt = Float8Tensor.__tensor_unflatten__(inner, ctx, fp8.shape, fp8.stride())
    assert rebuilt.dtype == torch.bfloat16 and rebuilt._granularity == fp8._granularity
    assert torch.equal(rebuilt._data.view(torch.uint8), fp8._data.view(torch.uint8))
    assert torch.equal(rebuilt._scale, fp8._scale)


def test_compiled_function_takes_and_returns_float8_tensors():
    fp8 = to_float8(torch.randn(16, 32), E4M3)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def transpose(t):
        return t.t()

    out = transpose(fp8)
    assert isinstance(out, Float8Tensor)
    torch.testing.assert_close(out.to_hp(), fp8.to_hp().t())
