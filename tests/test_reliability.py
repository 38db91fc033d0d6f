"""Failure modes: clear errors for hardware that cannot run float8, non-finite values that
reach the loss as they would in bf16 instead of being hidden, and a quiet import."""

import subprocess
import sys

import pytest
import torch

from fp8train import Float8Linear, Float8LinearConfig, to_float8
from fp8train.config import E4M3, E5M2
from fp8train.linear import check_device
from fp8train.scaling import amax_to_scale
from tests.conftest import DEVICES

M, K, N = 32, 64, 48


def test_gpu_without_float8_gemms_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"'layers.0.wq': NVIDIA A100 \(compute capability 8.0\)"):
        check_device(torch.device("cuda", 0), Float8LinearConfig(), "layers.0.wq")
    with pytest.raises(ValueError, match="set emulate=True"):
        check_device(torch.device("cuda", 0), Float8LinearConfig())
    check_device(torch.device("cuda", 0), Float8LinearConfig(emulate=True))


def test_hopper_and_the_cpu_pass_the_device_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_device(torch.device("cuda", 0), Float8LinearConfig())
    check_device(torch.device("cpu"), Float8LinearConfig())


@pytest.mark.parametrize("float8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize(
    "amax", [0.0, 1e-45, 1e-30, 1.0, 3e38], ids=["zero", "denormal", "tiny", "one", "huge"]
)
def test_finite_amax_gives_a_finite_positive_scale(amax, float8_dtype):
    for power_of_2 in (False, True):
        scale = amax_to_scale(torch.tensor(amax), float8_dtype, round_to_power_of_2=power_of_2)
        assert torch.isfinite(scale) and scale > 0


@pytest.mark.parametrize("amax", [float("inf"), float("nan")])
def test_non_finite_amax_gives_a_nan_scale_not_zero(amax):
    scale = amax_to_scale(torch.tensor([[1.0], [amax]]), E4M3)
    assert torch.isfinite(scale[0]) and torch.isnan(scale[1])


def test_inf_in_a_row_poisons_that_cast_visibly():
    hp = torch.randn(4, 8)
    hp[1, 2] = float("inf")
    tensorwise = to_float8(hp, E4M3).to_hp()
    assert torch.isnan(tensorwise).all()
    rowwise = to_float8(hp, E4M3, "rowwise", reduce_dim=-1).to_hp()
    assert torch.isnan(rowwise[1]).all() and torch.isfinite(rowwise[[0, 2, 3]]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_input_reaches_the_loss_and_the_gradients(bad, device):
    layer = Float8Linear(K, N, device=device)
    x = torch.randn(M, K, device=device)
    x[3, 5] = bad
    loss = layer(x).square().mean()
    loss.backward()
    assert not torch.isfinite(loss)
    assert not torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_gradient_reaches_the_weight_gradient(device):
    layer = Float8Linear(K, N, device=device)
    x = torch.randn(M, K, device=device, requires_grad=True)
    grad = torch.randn(M, N, device=device)
    grad[0, 0] = float("nan")
    layer(x).backward(grad)
    assert not torch.isfinite(layer.weight.grad).all()
    assert not torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_huge_finite_values_saturate_to_finite_outputs(device):
    layer = Float8Linear(K, N, bias=False, device=device)
    x = torch.randn(M, K, device=device) * 1e30
    out = layer(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_moving_a_layer_to_a_float8_gpu_passes_the_device_check(device):
    layer = Float8Linear(K, N).to(device)
    assert layer.weight.device.type == device


def test_importing_the_library_logs_nothing():
    # torch logs a warning for each Triton op registered where Triton is absent (CPU builds).
    done = subprocess.run(
        [sys.executable, "-c", "import fp8train"], capture_output=True, text=True, check=True
    )
    assert done.stderr == ""
    assert done.stdout == ""
