"""Float8Linear numerics against fp32, on real scaled gemms and in emulation."""

import copy
import re

import pytest
import torch
from torch import nn

from fp8train import Float8Linear, Float8LinearConfig, compute_error
from tests.conftest import (
    DEVICES,
    all_roles_config,
    hp_grad_weight_config,
    one_pass_delayed_config,
    record_casts,
)

# SQNR floors in dB against the fp32 layer (20 dB: 10% of the signal's norm).
OUTPUT_SQNR = 20.0
GRAD_SQNR = 15.0
# Emulation and the scaled gemm multiply the same float8 bytes: they differ by accumulation
# order and output rounding only.
AGREEMENT_SQNR = 40.0

SHAPES = [
    pytest.param((16,), 64, 48, id="2d"),
    pytest.param((2, 8), 64, 48, id="3d"),
    # weird shapes: nothing a multiple of 16, padded
    pytest.param((7,), 100, 37, id="odd-padded"),
    pytest.param((3, 5), 24, 40, id="3d-odd-padded"),
]
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulate"])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("lead,in_features,out_features", SHAPES)
def test_fwd_bwd_against_fp32(
    device, granularity, emulate, hp_dtype, lead, in_features, out_features
):
    reference = nn.Linear(in_features, out_features, device=device)
    config = all_roles_config(granularity, emulate=emulate, pad_inner_dim=True)
    fp8 = Float8Linear.from_float(copy.deepcopy(reference).to(hp_dtype), config)
    x = torch.randn(*lead, in_features, device=device)
    grad = torch.randn(*lead, out_features, device=device)

    ref_out, ref_gx, ref_gw, ref_gb = run_fwd_bwd(reference, x, grad)
    out, gx, gw, gb = run_fwd_bwd(fp8, x.to(hp_dtype), grad.to(hp_dtype))

    assert out.dtype == gx.dtype == hp_dtype and gw.dtype == hp_dtype
    assert out.shape == ref_out.shape and gx.shape == x.shape
    assert compute_error(ref_out, out) >= OUTPUT_SQNR
    assert compute_error(ref_gx, gx) >= GRAD_SQNR
    assert compute_error(ref_gw, gw) >= GRAD_SQNR
    assert compute_error(ref_gb, gb) >= 30  # bias grad is a plain high-precision sum


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_emulation_agrees_with_scaled_mm(device, granularity, hp_dtype):
    base = nn.Linear(64, 48, device=device, dtype=hp_dtype)
    x = torch.randn(4, 16, 64, device=device, dtype=hp_dtype)
    grad = torch.randn(4, 16, 48, device=device, dtype=hp_dtype)
    real = run_fwd_bwd(
        Float8Linear.from_float(copy.deepcopy(base), all_roles_config(granularity)), x, grad
    )
    emulated = run_fwd_bwd(
        Float8Linear.from_float(copy.deepcopy(base), all_roles_config(granularity, emulate=True)),
        x,
        grad,
    )
    for name, a, b in zip(("output", "grad_input", "grad_weight"), real, emulated, strict=False):
        assert compute_error(b, a) >= AGREEMENT_SQNR, name


def test_high_precision_grad_weight_gemm_is_exact_to_fp32():
    config = hp_grad_weight_config()
    reference = nn.Linear(64, 48)
    x, grad = torch.randn(32, 64), torch.randn(32, 48)
    ref = run_fwd_bwd(reference, x, grad)
    out = run_fwd_bwd(Float8Linear.from_float(copy.deepcopy(reference), config), x, grad)
    torch.testing.assert_close(out[2], ref[2])
    assert compute_error(ref[0], out[0]) >= OUTPUT_SQNR


def test_frozen_weight_gets_no_grad_and_any_token_count_runs():
    layer = Float8Linear(64, 48, bias=False)
    layer.weight.requires_grad_(False)
    x = torch.randn(5, 64, requires_grad=True)  # 5 tokens: only the grad_weight gemm minds
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad.shape == x.shape


def test_input_without_grad_still_gives_weight_grad():
    layer = Float8Linear(64, 48)
    layer(torch.randn(16, 64)).sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


def test_autocast_runs_the_layer_in_the_autocast_dtype():
    layer = Float8Linear(64, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(16, 64))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_get_a_clear_error(transform):
    layer = Float8Linear(64, 48)
    x = torch.randn(16, 64)
    params = dict(layer.named_parameters())

    def loss(p: dict) -> torch.Tensor:
        return torch.func.functional_call(layer, p, (x,)).sum()

    with pytest.raises(RuntimeError, match="does not run under torch.func transforms"):
        if transform == "grad":
            torch.func.grad(loss)(params)
        else:
            torch.func.vmap(layer)(torch.randn(2, 16, 64))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise", "delayed"])
def test_a_layer_on_the_meta_device_gives_shapes_forward_and_backward(recipe):
    """Shape-only runs (a model built on the meta device, as for FSDP2's deferred init, run
    to count FLOPs or check shapes) work as with nn.Linear; autocast knows no meta device."""
    if recipe == "delayed":
        config = one_pass_delayed_config()
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    layer = Float8Linear(128, 256, config=config, device="meta")
    x = torch.empty(2, 64, 128, device="meta", requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (2, 64, 256) and out.device.type == "meta"
    assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape


@pytest.mark.parametrize(
    "in_features,out_features,match",
    [
        (100, 48, "in_features=100 not a multiple of 16"),
        (64, 40, "out_features=40 not a multiple of 16"),
        (100, 40, "in_features=100 and out_features=40"),
    ],
)
def test_misaligned_layer_is_refused_with_both_fixes(in_features, out_features, match):
    with pytest.raises(ValueError, match=match) as error:
        Float8Linear(in_features, out_features)
    assert "pad_inner_dim=True" in str(error.value) and "module_filter_fn" in str(error.value)


def test_misaligned_token_count_fails_in_forward_naming_the_layer():
    layer = Float8Linear(64, 48, fqn="blocks.0.ffn.w1")
    with pytest.raises(ValueError, match=r"'blocks.0.ffn.w1'.*tokens.*=7 .*pad_inner_dim=True"):
        layer(torch.randn(7, 64))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("no_backward", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("device", DEVICES)
def test_without_a_backward_any_token_count_runs(device, recipe, no_backward, compiled):
    """Evaluation and generation (one token at a time) run no grad_weight gemm, the only gemm
    that needs the token count to be a multiple of 16: they take any count."""
    reference = nn.Linear(64, 48, device=device)
    layer = Float8Linear.from_float(
        copy.deepcopy(reference), Float8LinearConfig.from_recipe_name(recipe)
    )
    torch._dynamo.reset()  # each token count and grad mode is a graph of Float8Linear.forward
    run = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    context = torch.no_grad if no_backward == "no_grad" else torch.inference_mode
    for tokens in (1, 7):
        x = torch.randn(tokens, 64, device=device)
        with context():
            out = run(x)
        assert compute_error(reference(x), out) >= OUTPUT_SQNR
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="=7 not a multiple of 16"):
        layer(torch.randn(7, 64, device=device))  # with a backward to come, forward refuses


@pytest.mark.parametrize("device", DEVICES)
def test_blockwise_without_a_weight_gradient_takes_any_token_count(device):
    """Only the grad_weight gemm's casts run along the tokens in blocks of 128."""
    reference = nn.Linear(128, 256, device=device)
    layer = Float8Linear.from_float(
        copy.deepcopy(reference), Float8LinearConfig.from_recipe_name("blockwise")
    )
    for tokens in (1, 7, 130):
        x = torch.randn(tokens, 128, device=device)
        with torch.no_grad():
            assert compute_error(reference(x), layer(x)) >= OUTPUT_SQNR
    with pytest.raises(ValueError, match="=7 is not a multiple of 128"):
        layer(torch.randn(7, 128, device=device))  # a weight gradient to come: refused


def test_one_token_rowwise_on_a_cpu_without_rowwise_gemms_is_emulated(monkeypatch):
    """Before torch 2.13 the CPU's _scaled_mm takes no rowwise scales: fp8train emulates those
    gemms there. One token's rowwise scale has one element, yet it is rowwise all the same."""
    import fp8train.gemm

    monkeypatch.setattr(fp8train.gemm, "_CPU_ROWWISE", False)
    tensorwise_only = torch._scaled_mm

    def scaled_mm(a, b, scale_a, scale_b, **kwargs):  # noqa: ANN001, ANN202, ANN003
        if scale_a.dim() or scale_b.dim():  # torch 2.11's CPU check, roughly
            raise RuntimeError("rowwise scales on the CPU")
        return tensorwise_only(a, b, scale_a, scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    reference = nn.Linear(64, 48)
    layer = Float8Linear.from_float(
        copy.deepcopy(reference), Float8LinearConfig.from_recipe_name("rowwise")
    )
    x = torch.randn(1, 64)
    with torch.no_grad():
        assert compute_error(reference(x), layer(x)) >= OUTPUT_SQNR


def test_emulation_needs_no_alignment():
    layer = Float8Linear(100, 37, config=Float8LinearConfig(emulate=True))
    layer(torch.randn(7, 100)).sum().backward()
    assert layer.weight.grad.shape == (37, 100)


def test_unsupported_weight_dtype_is_refused():
    with pytest.raises(ValueError, match="float64 is not float32, bfloat16 or float16"):
        Float8Linear.from_float(nn.Linear(64, 48).double())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_unsupported_input_dtype_is_refused_naming_the_layer(dtype):
    layer = Float8Linear(64, 48, fqn="blocks.0.ffn.w1")
    with pytest.raises(TypeError, match=rf"'blocks.0.ffn.w1': input dtype {dtype} is not"):
        layer(torch.ones(16, 64, dtype=dtype))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "config", [Float8LinearConfig(), one_pass_delayed_config()], ids=["dynamic", "delayed"]
)
def test_no_tokens_give_linears_empty_output_and_zero_gradients(config, compiled):
    """An empty batch (or a mixture-of-experts expert that got no tokens) runs as in
    nn.Linear, eager and compiled, and records no amax."""
    torch.manual_seed(0)
    reference = nn.Linear(64, 48)
    layer = Float8Linear.from_float(copy.deepcopy(reference), config)
    history = [b.clone() for b in layer.buffers()]
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    x = torch.randn(2, 0, 64, requires_grad=True)
    out = run(x)
    out.sum().backward()
    reference(torch.randn(2, 0, 64)).sum().backward()
    assert out.shape == (2, 0, 48)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=0, atol=0)
    assert layer.weight.grad.abs().sum() == 0 and x.grad.shape == x.shape
    assert all(torch.equal(a, b) for a, b in zip(history, layer.buffers(), strict=True))


def test_no_grad_forward_casts_only_for_the_output_gemm(monkeypatch):
    """Evaluation and inference: the same output, and no cast or copy kept for a backward
    that will not run (one layout per operand)."""
    torch.manual_seed(0)
    layer = Float8Linear(64, 32, bias=False, config=Float8LinearConfig())
    x = torch.randn(16, 64)
    calls = record_casts(monkeypatch)
    with torch.no_grad():
        evaluated = layer(x)
    assert [call.layouts for call in calls] == [1, 1]
    assert torch.equal(evaluated, layer(x.requires_grad_()).detach())


@pytest.mark.parametrize("eager_path", ["general", "fast"])
@pytest.mark.parametrize("backward", ["exact", "fast"])
def test_each_gemm_runs_with_the_accumulation_its_config_names(monkeypatch, eager_path, backward):
    """The output gemm accumulates fast by default, the backward gemms exactly; the gemm
    configs change that per gemm, on the general path and on the eager fast path (switched on
    for the CPU here) alike."""
    import fp8train.eager
    from fp8train import Float8GemmConfig

    if eager_path == "fast":
        monkeypatch.setattr(fp8train.eager, "EAGER_DEVICES", frozenset({"cpu"}))
    flags = []
    scaled_mm = torch._scaled_mm

    def recording(*args, use_fast_accum=False, **kwargs):  # noqa: ANN002, ANN003, ANN202
        flags.append(use_fast_accum)
        return scaled_mm(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    gemm = Float8GemmConfig(use_fast_accum=backward == "fast")
    config = Float8LinearConfig(gemm_config_grad_input=gemm, gemm_config_grad_weight=gemm)
    layer = Float8Linear(64, 32, bias=False, config=config)
    x = torch.randn(16, 64, requires_grad=True)
    out = layer(x)
    assert layer._takes_eager_path(x) == (eager_path == "fast")
    assert flags == [True]  # the output gemm
    out.sum().backward()
    assert flags[1:] == [backward == "fast"] * 2  # grad_input and grad_weight


def test_float8_matmul_is_a_bias_free_float8_linear():
    from fp8train import float8_matmul

    torch.manual_seed(0)
    layer = Float8Linear(64, 48, bias=False)
    weight = layer.weight.detach().clone().requires_grad_()
    x = torch.randn(2, 8, 64)
    out = float8_matmul(x, weight)
    out.sum().backward()
    layer(x).sum().backward()
    torch.testing.assert_close(out, layer(x), rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, layer.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("x", "weight", "error", "match"),
    [
        (torch.randn(16, 64), torch.randn(64, 48), ValueError, r"\(16, 64\) and weight \(64, 48\)"),
        (torch.randn(16, 64), torch.randn(48, 64, 1), ValueError, r"give a weight \(N, K\)"),
        (torch.randn(16, 64).double(), torch.randn(48, 64), TypeError, "float64 is not"),
        (torch.randn(16, 100), torch.randn(48, 100), ValueError,
         r"float8 matmul: weight \(48, 100\) has K=100, not a multiple of 16.*pad the operands"),
        (torch.randn(16, 64).numpy(), torch.randn(48, 64), TypeError,
         "input is a ndarray, not a torch.Tensor"),
    ],
)  # fmt: skip
def test_float8_matmul_refuses_bad_operands_by_name(x, weight, error, match):
    from fp8train import float8_matmul

    with pytest.raises(error, match=match):
        float8_matmul(x, weight)


@pytest.mark.parametrize("shape", [(16, 48), (2, 8, 63), ()], ids=["2d", "3d", "0d"])
def test_an_input_of_the_wrong_width_is_refused_naming_the_layer(shape):
    layer = Float8Linear(64, 48, fqn="blocks.0.ffn.w1")
    with pytest.raises(
        ValueError, match=re.escape(f"'blocks.0.ffn.w1': input {tuple(shape)} and weight (48, 64)")
    ):
        layer(torch.randn(shape))


def test_an_input_that_is_not_a_tensor_is_refused_naming_its_type():
    layer = Float8Linear(64, 48, fqn="blocks.0.ffn.w1")
    with pytest.raises(TypeError, match="'blocks.0.ffn.w1': input is a list, not a torch.Tensor"):
        layer([[0.0] * 64] * 16)


def test_float8_matmul_of_no_tokens_is_empty_with_a_zero_weight_gradient():
    from fp8train import float8_matmul

    weight = torch.randn(48, 64, requires_grad=True)
    out = float8_matmul(torch.randn(0, 64), weight)
    out.sum().backward()
    assert out.shape == (0, 48) and weight.grad.abs().sum() == 0


def test_a_weight_cast_to_float64_after_conversion_is_named():
    layer = Float8Linear(64, 48, fqn="blocks.0.ffn.w1").double()
    with pytest.raises(TypeError, match=r"'blocks.0.ffn.w1': weight dtype torch.float64.*after"):
        layer(torch.randn(16, 64, dtype=torch.float64))
