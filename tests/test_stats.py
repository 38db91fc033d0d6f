"""fp8train.stats: per-cast numerics of the recorded steps, nothing when off."""

import pytest
import torch
from torch import nn

from fp8train import Float8Linear, compute_error, convert_to_float8_training, stats, to_float8
from fp8train.config import E4M3
from tests.conftest import all_roles_config

M, K, N = 32, 64, 48


def two_layers(config=None) -> nn.Module:  # noqa: ANN001
    model = nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Linear(N, K))
    return convert_to_float8_training(model, config=config)


def step(model: nn.Module) -> None:
    model(torch.randn(M, K, requires_grad=True)).square().sum().backward()


def test_records_every_cast_of_every_layer_tensorwise():
    model = two_layers()
    with stats.record(model) as recorder:
        step(model)
    seen = [(r.layer, r.role, r.gemm) for r in recorder.records]
    # Tensorwise, grad_output's one cast serves both backward gemms: three casts per layer.
    for layer in ("0", "2"):
        assert (layer, "input", "output") in seen
        assert (layer, "weight", "output") in seen
        assert (layer, "grad_output", "grad_input") in seen
    assert len(seen) == 6
    assert all(
        r.float8_dtype == ("e5m2" if r.role == "grad_output" else "e4m3fn")
        for r in recorder.records
    )


def test_rowwise_records_the_backward_casts_along_the_other_dim():
    model = two_layers(all_roles_config("rowwise"))
    with stats.record(model) as recorder:
        step(model)
    seen = {(r.role, r.gemm) for r in recorder.records if r.layer == "0"}
    assert seen == {
        ("input", "output"),
        ("input", "grad_weight"),
        ("weight", "output"),
        ("weight", "grad_input"),
        ("grad_output", "grad_input"),
        ("grad_output", "grad_weight"),
    }


def test_stats_are_those_of_the_cast():
    layer = Float8Linear(K, N, bias=False)
    x = torch.randn(M, K)
    x[0, 0] = 1e4  # one outlier: the smallest values underflow to zero
    x[1, :8] = 1e-6
    with stats.record(layer) as recorder:
        layer(x)
    (record, _) = recorder.records
    reference = to_float8(x, E4M3)
    assert record.amax == pytest.approx(1e4)
    assert record.scale == pytest.approx(reference._scale.item())
    assert record.sqnr_db == pytest.approx(compute_error(x, reference.to_hp()).item())
    assert record.flushed >= 8 / x.numel()
    assert record.saturated == 0  # a dynamic scale maps amax onto the float8 maximum
    assert "| input | output | e4m3fn |" in recorder.table()


def test_nothing_is_recorded_outside_the_context_or_when_compiled():
    model = two_layers()
    with stats.record(model) as recorder:
        pass
    step(model)
    assert recorder.records == []
    assert all(m._observer is None for m in model.modules() if isinstance(m, Float8Linear))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with stats.record(model) as recorder:
        step(compiled)
    assert recorder.records == []
    assert "no float8 casts recorded" in recorder.table()


def test_a_model_without_float8_layers_is_refused():
    with (
        pytest.raises(ValueError, match="convert it with convert_to_float8_training"),
        stats.record(nn.Linear(K, N)),
    ):
        pass
