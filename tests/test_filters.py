"""fp8train.filters.auto_filter: the modelled cost, against the H200 figures it was fitted to."""

import pytest
from torch import nn

from fp8train import Float8Linear, Float8LinearConfig, convert_to_float8_training
from fp8train.filters import CostModel, auto_filter

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
