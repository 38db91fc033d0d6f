"""Property-based tests (hypothesis) of the cast and the linear layer over shapes, dtypes and
value ranges: denormals, huge values, all zeros, a single outlier."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8train import Float8Linear, compute_error, to_float8
from fp8train.config import E4M3, E5M2

HP = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative half-ulp of a float8 normal (3 and 2 mantissa bits) and its smallest subnormal.
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SMALLEST_SUBNORMAL = {E4M3: 2.0**-9, E5M2: 2.0**-16}
# Exponent ranges of the data's magnitude that each hp dtype holds without overflow.
EXPONENTS = {torch.float32: (-40, 35), torch.bfloat16: (-40, 35), torch.float16: (-6, 4)}

PATTERNS = ["normal", "zeros", "outlier", "denormal-heavy"]


@st.composite
def hp_tensors(draw) -> torch.Tensor:  # noqa: ANN001
    dtype = HP[draw(st.sampled_from(sorted(HP)))]
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    low, high = EXPONENTS[dtype]
    exponent = draw(st.integers(low, high))
    pattern = draw(st.sampled_from(PATTERNS))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, cols, generator=generator) * 10.0**exponent
    if pattern == "zeros":
        x.zero_()
    elif pattern == "outlier":
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] *= 1e4
    elif pattern == "denormal-heavy":
        x[:, : max(1, cols // 2)] *= 1e-12
    finite = torch.finfo(dtype).max / 2  # finite input: an outlier must not overflow fp16
    return x.clamp(-finite, finite).to(dtype)


@settings(max_examples=150, deadline=None)
@given(hp=hp_tensors(), float8_dtype=st.sampled_from([E4M3, E5M2]))
def test_cast_round_trip_is_finite_saturated_and_within_half_an_ulp(hp, float8_dtype):
    fp8 = to_float8(hp, float8_dtype)
    scale = fp8._scale
    assert torch.isfinite(scale) and scale > 0
    data = fp8._data.float()
    assert not torch.isnan(data).any()
    assert data.abs().max() <= torch.finfo(float8_dtype).max
    x = hp.float()
    back = fp8.to_hp(torch.float32)
    # Each element: half an ulp of its float8 value, or half the smallest subnormal (scaled
    # back) where it falls below the normal range; 0.1% slack for the fp32 products.
    bound = torch.maximum(
        HALF_ULP[float8_dtype] * x.abs(),
        torch.full_like(x, SMALLEST_SUBNORMAL[float8_dtype] / 2) / scale,
    )
    assert ((back - x).abs() <= bound * 1.001).all()
    if not hp.any():
        assert not back.any()


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.sampled_from([16, 32, 48]),
    in_features=st.sampled_from([16, 32, 64]),
    out_features=st.sampled_from([16, 48]),
    exponent=st.integers(-15, 15),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_gives_finite_accurate_results_from_finite_inputs(
    tokens, in_features, out_features, exponent, seed
):
    torch.manual_seed(seed)
    layer = Float8Linear(in_features, out_features, bias=False)
    reference = torch.nn.Linear(in_features, out_features, bias=False)
    reference.weight = torch.nn.Parameter(layer.weight.detach().clone())
    x = torch.randn(tokens, in_features) * 10.0**exponent
    out = layer(x.clone().requires_grad_())
    out.sum().backward()
    expected = reference(x)
    assert torch.isfinite(out).all() and torch.isfinite(layer.weight.grad).all()
    # Tensorwise e4m3 gemms on random data give about 28 dB (benchmarks/check_numerics.py).
    assert compute_error(expected, out) > 20


@settings(max_examples=60, deadline=None)
@given(
    gate=hp_tensors(),
    up_exponent=st.integers(-3, 3),
    exact_forward=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_float8_swiglu_gives_finite_results_from_finite_inputs(
    gate, up_exponent, exact_forward, seed
):
    from hypothesis import assume

    from fp8train import float8_swiglu
    from fp8train.config import ScalingGranularity

    generator = torch.Generator().manual_seed(seed)
    up = (torch.randn(gate.shape, generator=generator) * 10.0**up_exponent).to(gate.dtype)
    exact = torch.nn.functional.silu(gate.float()) * up.float()
    # Where SwiGLU itself overflows the dtype there is no finite answer to give.
    assume(exact.abs().max() < torch.finfo(gate.dtype).max / 4)
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = float8_swiglu(gate, up, exact_forward=exact_forward)
    out.float().sum().backward()
    assert torch.isfinite(out).all()
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()
    if exact_forward:
        assert torch.equal(out, exact.to(gate.dtype))
    else:
        # SwiGLU at the float8 copies' values, rounded once to the dtype.
        a, b = (
            to_float8(t.detach(), E4M3, ScalingGranularity.ROWWISE, reduce_dim=-1).to_hp(
                torch.float32
            )
            for t in (gate, up)
        )
        expected = (torch.nn.functional.silu(a) * b).to(gate.dtype)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=0)
    if not gate.detach().any():
        assert not out.any()
