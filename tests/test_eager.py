"""The eager fast path (fp8train.eager) against the general path, bit for bit, and which calls
take it. On the CPU the path is switched on for the test (it runs on CUDA by default)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fp8train.eager
from fp8train import (
    CastConfig,
    Float8GemmConfig,
    Float8Linear,
    Float8LinearConfig,
    cast_weights_once,
)
from fp8train.eager import EagerPlan, eager_plan
from fp8train.stats import record
from tests.conftest import DEVICES, all_roles_config, one_pass_delayed_config

FAST_CONFIGS = {
    "default": Float8LinearConfig(),
    "keep-float8-weight": Float8LinearConfig(recompute_weight_cast=False),
    "keep-float8-input": Float8LinearConfig(recompute_input_cast=False),
    "power-of-2-scales": Float8LinearConfig(round_scales_to_power_of_2=True),
    "fast-accum-everywhere": Float8LinearConfig(
        gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True),
        gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True),
    ),
    "e4m3-gradients": Float8LinearConfig(
        cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn)
    ),
}

GENERAL_CONFIGS = {
    "rowwise": all_roles_config("rowwise"),
    "delayed": one_pass_delayed_config(),
    "static-input": Float8LinearConfig(
        cast_config_input=CastConfig(scaling_type="static", static_scale=2.0)
    ),
    "hp-grad-weight": Float8LinearConfig(
        cast_config_input_for_grad_weight=CastConfig(scaling_type="disabled"),
        cast_config_grad_output_for_grad_weight=CastConfig(scaling_type="disabled"),
    ),
    "hp-everywhere": Float8LinearConfig(
        cast_config_input=CastConfig(scaling_type="disabled"),
        cast_config_weight=CastConfig(scaling_type="disabled"),
        cast_config_grad_output=CastConfig(scaling_type="disabled"),
    ),
    "recompute-input": Float8LinearConfig(recompute_input_cast=True),
    "emulate": Float8LinearConfig(emulate=True),
}


@pytest.fixture
def fast_casts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Switches the fast path on for the CPU too, and counts the casts it makes."""
    monkeypatch.setattr(fp8train.eager, "EAGER_DEVICES", frozenset({"cpu", "cuda"}))
    calls = []
    original = fp8train.eager._cast

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8train.eager, "_cast", counting)
    return calls


def _fwd_bwd(layer, x, grad, input_grad: bool):  # noqa: ANN001, ANN202
    x = x.detach().clone().requires_grad_(input_grad)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad)
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return [out, *grads]


def _assert_identical(fast, general) -> None:  # noqa: ANN001
    for a, b in zip(fast, general, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.stride() == b.stride()
            assert torch.equal(a, b), (a - b).abs().max()


def _general(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8train.eager, "EAGER_DEVICES", frozenset())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FAST_CONFIGS.values(), ids=FAST_CONFIGS.keys())
@pytest.mark.parametrize("lead", [(32,), (2, 24)], ids=["2d", "3d"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "no-input-grad"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fast_path_equals_the_general_path_bit_for_bit(
    device, config, lead, input_grad, bias, fast_casts, monkeypatch
):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = Float8Linear(64, 48, bias=bias, config=config, device=device, dtype=dtype)
    x = torch.randn(*lead, 64, device=device, dtype=dtype) * 3
    grad = torch.randn(*lead, 48, device=device, dtype=dtype)
    fast = _fwd_bwd(layer, x, grad, input_grad)
    assert fast_casts, "the fast path did not run"
    _general(monkeypatch)
    _assert_identical(fast, _fwd_bwd(layer, x, grad, input_grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [16, 7])  # no grad_weight gemm: any token count
def test_fast_path_with_a_frozen_weight_gives_only_the_input_gradient(
    device, tokens, fast_casts, monkeypatch
):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = Float8Linear(32, 64, bias=False, device=device, dtype=dtype)
    layer.weight.requires_grad_(False)
    x = torch.randn(tokens, 32, device=device, dtype=dtype)
    grad = torch.randn(tokens, 64, device=device, dtype=dtype)
    fast = _fwd_bwd(layer, x, grad, input_grad=True)
    # input and weight cast for the output gemm, grad_output and the weight for grad_input
    assert len(fast_casts) == 4 and layer.weight.grad is None
    _general(monkeypatch)
    _assert_identical(fast, _fwd_bwd(layer, x, grad, input_grad=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead", [(4, 16), (1, 1), (7,)], ids=["64-tokens", "1-token", "7-tokens"])
def test_fast_path_without_grad_casts_for_the_output_gemm_only(
    device, lead, fast_casts, monkeypatch
):
    """Any token count: without a backward no gemm needs a multiple of 16 (generation)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = Float8Linear(64, 32, device=device, dtype=dtype)
    x = torch.randn(*lead, 64, device=device, dtype=dtype)
    with torch.no_grad():
        fast = layer(x)
    assert len(fast_casts) == 2 and fast.grad_fn is None
    _general(monkeypatch)
    with torch.no_grad():
        assert torch.equal(fast, layer(x))


def test_fast_path_keeps_float8_bytes_for_backward(fast_casts):
    """What backward keeps: the float8 input and nothing in hp but the weight itself."""
    layer = Float8Linear(64, 48, bias=False)
    x = torch.randn(32, 64, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        layer(x)
    float8 = [t for t in kept if t.dtype == torch.float8_e4m3fn]
    assert [t.shape for t in float8] == [(32, 64)] and float8[0].t().is_contiguous()
    hp = [t for t in kept if t.dtype == torch.float32 and t.numel() > 1]
    assert len(hp) == 1 and hp[0] is layer.weight


@pytest.mark.parametrize("config", GENERAL_CONFIGS.values(), ids=GENERAL_CONFIGS.keys())
def test_configs_beyond_dynamic_tensorwise_take_the_general_path(config, fast_casts):
    assert eager_plan(config, 64, 48) is None
    layer = Float8Linear(64, 48, config=config)
    layer(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert not fast_casts


def test_plan_reads_the_config():
    plan = eager_plan(Float8LinearConfig(recompute_weight_cast=False), 64, 48)
    assert plan == EagerPlan(
        input_dtype=torch.float8_e4m3fn,
        weight_dtype=torch.float8_e4m3fn,
        grad_output_dtype=torch.float8_e5m2,
        fast_accum={"output": True, "grad_input": False, "grad_weight": False},
        keep_float8_weight=True,
        round_scales_to_power_of_2=False,
    )
    # Padded layers (pad_inner_dim) take the general path, which pads.
    assert eager_plan(Float8LinearConfig(pad_inner_dim=True), 100, 48) is None


def test_misaligned_tokens_take_the_general_path_and_its_error(fast_casts):
    layer = Float8Linear(64, 48, fqn="layers.0.wq")
    with pytest.raises(ValueError, match="layers.0.wq.*multiple of 16"):
        layer(torch.randn(10, 64))
    assert not fast_casts


def test_stats_and_cast_weights_once_take_the_general_path(fast_casts):
    layer = torch.nn.Sequential(Float8Linear(64, 48))
    x = torch.randn(32, 64, requires_grad=True)
    with record(layer):
        layer(x).sum().backward()
    with cast_weights_once(layer):
        layer(x).sum().backward()
    assert not fast_casts
    layer(x).sum().backward()
    assert fast_casts


def test_a_dispatch_mode_takes_the_general_path(fast_casts):
    """A dispatch mode (a flop counter, selective checkpointing) must see every op: the
    general path's casts are torch ops on the CPU."""
    layer = Float8Linear(64, 48)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(32, 64))
    assert not fast_casts and counter.get_total_flops() > 0


def test_a_new_config_on_the_layer_is_followed(fast_casts):
    layer = Float8Linear(64, 48)
    x = torch.randn(32, 64)
    layer(x)
    assert len(fast_casts) == 2
    layer.config = all_roles_config("rowwise")
    layer(x)
    assert len(fast_casts) == 2


def test_the_fast_path_runs_by_default_on_cuda_only():
    assert fp8train.eager.EAGER_DEVICES == frozenset({"cuda"})


class _SharedInput(torch.nn.Module):
    """Three projections of one normed input, as attention's q, k and v."""

    def __init__(self, config: Float8LinearConfig) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (
            Float8Linear(64, 32, bias=False, config=config) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(x, (64,))
        return self.wq(h) * self.wk(h) + self.wv(h)


@pytest.mark.parametrize("config", FAST_CONFIGS.values(), ids=FAST_CONFIGS.keys())
def test_layers_reading_one_input_cast_it_once_as_the_general_path_does(
    config, fast_casts, monkeypatch
):
    model = _SharedInput(config)
    x = torch.randn(2, 16, 64) * 2
    grad = torch.randn(2, 16, 32)
    fast = _fwd_bwd(model, x, grad, input_grad=True)
    # forward: the input once, three weights; backward: three grad_outputs (and three
    # weight recasts unless the float8 weight is kept)
    recasts = 0 if config.recompute_weight_cast is False else 3
    assert len(fast_casts) == 1 + 3 + 3 + recasts
    _general(monkeypatch)
    _assert_identical(fast, _fwd_bwd(model, x, grad, input_grad=True))


def test_an_input_changed_in_place_is_cast_again(fast_casts):
    first, second = Float8Linear(64, 32), Float8Linear(64, 32)
    h = torch.randn(16, 64, requires_grad=True) * 1  # made in forward: it has a grad_fn
    with torch.no_grad():
        first(h)
        h.mul_(2)
        changed = second(h)
    assert len(fast_casts) == 4
    with torch.no_grad():
        assert torch.equal(changed, Float8Linear.forward(second, h.clone()))


def test_fast_path_under_activation_checkpointing_equals_the_general_path(fast_casts, monkeypatch):
    """Eager (non-reentrant) checkpointing reruns forward in backward: the reruns cast again,
    and what they keep matches what forward kept."""
    model = _SharedInput(Float8LinearConfig())
    x = torch.randn(2, 16, 64)
    grad = torch.randn(2, 16, 32)

    def run():  # noqa: ANN202
        inp = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        out = torch.utils.checkpoint.checkpoint(model, inp, use_reentrant=False)
        out.backward(grad)
        return [out, inp.grad, *(p.grad for p in model.parameters())]

    fast = run()
    assert len(fast_casts) == 2 * 4 + 3 + 3  # forward twice (the rerun), then backward
    _general(monkeypatch)
    _assert_identical(fast, run())


def test_compiled_layers_take_the_general_path_without_graph_breaks(fast_casts):
    layer = Float8Linear(64, 48)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert not fast_casts


def test_fast_path_under_inference_mode_equals_the_general_path(fast_casts, monkeypatch):
    model = _SharedInput(Float8LinearConfig())
    x = torch.randn(2, 16, 64)
    with torch.inference_mode():
        fast = model(x)
    # Inference tensors have no grad_fn: each layer casts the input itself, as the general
    # path does (and no version counter is read).
    assert len(fast_casts) == 6
    _general(monkeypatch)
    with torch.inference_mode():
        assert torch.equal(fast, model(x))


@pytest.mark.parametrize("device", DEVICES)
def test_fast_path_takes_non_contiguous_inputs_and_gradients(device, fast_casts, monkeypatch):
    """A transposed input and the expanded gradient of `.sum()` (stride 0)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = Float8Linear(64, 48, device=device, dtype=dtype)
    x = torch.randn(64, 32, device=device, dtype=dtype).t()

    def run():  # noqa: ANN202
        inp = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        layer.zero_grad(set_to_none=True)
        out = layer(inp)
        out.sum().backward()
        return [out, inp.grad, layer.weight.grad, layer.bias.grad]

    fast = run()
    assert fast_casts and not x.is_contiguous()
    _general(monkeypatch)
    _assert_identical(fast, run())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "weight_dtype,input_dtype",
    [
        (torch.float32, torch.bfloat16),  # fp32 master weights, bf16 activations
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=["fp32-weight-bf16-input", "fp16", "bf16"],
)
def test_fast_path_equals_the_general_path_across_dtypes(
    device, weight_dtype, input_dtype, fast_casts, monkeypatch
):
    layer = Float8Linear(64, 48, device=device, dtype=weight_dtype)
    x = torch.randn(32, 64, device=device, dtype=input_dtype)
    grad = torch.randn(32, 48, device=device, dtype=input_dtype)
    fast = _fwd_bwd(layer, x, grad, input_grad=True)
    assert fast_casts and fast[0].dtype == input_dtype and fast[2].dtype == weight_dtype
    _general(monkeypatch)
    _assert_identical(fast, _fwd_bwd(layer, x, grad, input_grad=True))


@pytest.mark.parametrize("config", FAST_CONFIGS.values(), ids=FAST_CONFIGS.keys())
def test_fast_path_keeps_for_backward_what_the_general_path_keeps(config, fast_casts, monkeypatch):
    """The same saved tensors by dtype and shape (what saved-tensor hooks, offloading among
    them, see), so the same bytes."""
    layer = Float8Linear(64, 48, bias=False, config=config)
    x = torch.randn(32, 64, requires_grad=True)

    def kept() -> list[tuple[torch.dtype, tuple[int, ...]]]:
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: seen.append((t.dtype, tuple(t.shape))) or t, lambda t: t
        ):
            layer(x)
        return sorted(seen, key=str)

    fast = kept()
    assert fast_casts
    _general(monkeypatch)
    assert fast == kept()
