"""fp8train.filters.auto_filter: the modelled cost, against the H200 figures it was fitted to."""

import pytest
import torch
from torch import nn

from fp8train import Float8Linear, Float8LinearConfig, convert_to_float8_training
from fp8train.filters import CostModel, auto_filter
from tests.conftest import DEVICES

TOKENS = 16384
# (K, N) -> measured fwd+bwd speedup over bf16 on the H200 (compiled, eager), from
# benchmarks/results/linear_h200_2026-12-03.md
MEASURED = {
    (8192, 1280): (1.11, 0.88),
    (1024, 8192): (1.05, 0.61),
    (8192, 7168): (1.59, 1.60),
    (3584, 8192): (1.42, 1.53),
}


@pytest.mark.parametrize(("k", "n"), MEASURED)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_the_model_is_within_10_percent_of_the_measured_speedups(k, n, compiled):
    model, config = CostModel(), Float8LinearConfig()
    modelled = model.hp_time(TOKENS, k, n) / model.float8_time(TOKENS, k, n, config, compiled)
    measured = MEASURED[(k, n)][0 if compiled else 1]
    assert modelled == pytest.approx(measured, rel=0.1)


def test_the_filter_keeps_large_layers_and_leaves_small_and_thin_ones_out():
    layers = nn.ModuleDict(
        {
            "ffn": nn.Linear(8192, 7168),
            "small": nn.Linear(1024, 1024),
            "thin": nn.Linear(1024, 8192),
            "lm_head": nn.Linear(8192, 32000),
        }
    )
    compiled = auto_filter(TOKENS, also=lambda module, fqn: fqn != "lm_head")
    eager = auto_filter(TOKENS, compiled=False)
    assert [compiled(m, fqn) for fqn, m in layers.items()] == [True, False, False, False]
    assert [eager(m, fqn) for fqn, m in layers.items()] == [True, False, False, True]
    # fewer tokens, less to win: the same FFN layer at 512 tokens is left out
    assert not auto_filter(512)(layers["ffn"], "ffn")


def test_rowwise_moves_more_bytes_and_is_modelled_slower():
    model = CostModel()
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    assert model.float8_time(TOKENS, 4096, 4096, rowwise, True) > model.float8_time(
        TOKENS, 4096, 4096, Float8LinearConfig(), True
    )


def test_convert_with_the_auto_filter():
    model = nn.Sequential(nn.Linear(4096, 14336), nn.Linear(64, 64))
    convert_to_float8_training(model, module_filter_fn=auto_filter(TOKENS))
    assert isinstance(model[0], Float8Linear) and type(model[1]) is nn.Linear


def test_the_eager_host_time_decides_the_thin_layers():
    wqkv = nn.Linear(8192, 1280)
    # 1.9 ms a layer (the host before the eager fast path) leaves it out; 0.6 ms keeps it
    assert not auto_filter(TOKENS, compiled=False)(wqkv, "wqkv")
    fast_host = CostModel(eager_cpu_s=0.6e-3)
    assert auto_filter(TOKENS, compiled=False, model=fast_host)(wqkv, "wqkv")
    assert auto_filter(TOKENS, compiled=True, model=fast_host)(wqkv, "wqkv")


def test_eager_high_precision_is_bound_by_its_host_time_too():
    model = CostModel(eager_cpu_s=1e-3, eager_hp_cpu_s=1e-3)
    assert model.high_precision_time(256, 256, 256, compiled=False) == 1e-3
    assert model.high_precision_time(256, 256, 256, compiled=True) == model.hp_time(256, 256, 256)
    # both bound by the same host time: float8 cannot win
    assert not auto_filter(256, compiled=False, model=model)(nn.Linear(256, 256), "small")


@pytest.mark.parametrize("device", DEVICES)
def test_measure_host_times_both_layers_and_keeps_the_other_constants(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # CPU bf16 matmuls are slow
    model = CostModel.measure_host(device, dtype=dtype, steps=10, hp_flops=1e12)
    assert model.hp_flops == 1e12 and model.fp8_flops == CostModel().fp8_flops
    assert 0 < model.eager_hp_cpu_s < 1 and 0 < model.eager_cpu_s < 1
    assert model.eager_cpu_s != CostModel().eager_cpu_s


def test_measure_host_without_a_gpu_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="none is available: pass device="):
        CostModel.measure_host()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": 0}, r"tokens=0\): give the tokens per step, a positive int"),
        ({"tokens": "16"}, r"tokens='16'\)"),
        ({"tokens": 2.5}, r"tokens=2.5\)"),
        ({"tokens": 16, "margin": None}, r"margin=None\): give a positive number"),
    ],
)
def test_auto_filter_refuses_what_is_not_a_token_count_or_margin(kwargs, match):
    with pytest.raises(ValueError, match=match):
        auto_filter(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fp8_flops": 0}, "fp8_flops=0: give a finite number, above 0"),
        ({"hp_flops": -1.0}, "hp_flops=-1.0: give a finite number, above 0"),
        ({"eager_cpu_s": float("nan")}, "eager_cpu_s=nan: give a finite number, 0 or more"),
    ],
)
def test_cost_model_refuses_rates_and_times_that_would_divide_by_zero_or_mislead(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)
    assert CostModel(eager_cpu_s=0.0).eager_cpu_s == 0.0  # no host time: allowed
