"""Gradient accumulation with one weight cast per optimizer step (fp8train.cast_weights_once)."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from fp8train import Float8LinearConfig, cast_weights_once, convert_to_float8_training
from tests.conftest import record_casts

MICRO_BATCHES = 4


def make_model(config: Float8LinearConfig | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 32))
    return convert_to_float8_training(model, config=config)


def accumulate(model: nn.Module, inputs: list[torch.Tensor], once: bool, forward=None) -> None:  # noqa: ANN001
    forward = forward or model
    context = (
        cast_weights_once(model)
        if once
        else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    )
    with context:
        for x in inputs:
            forward(x).square().mean().backward()


def weight_casts(monkeypatch, model: nn.Module):  # noqa: ANN001, ANN201
    """From now on, counts the casts whose input is one of the model's weights: call the
    result for the count so far."""
    weights = {p.data_ptr() for p in model.parameters() if p.dim() == 2}
    calls = record_casts(monkeypatch)
    return lambda: sum(call.data_ptr in weights for call in calls)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("recompute_weight_cast", [True, False])
def test_one_cast_per_step_gives_the_gradients_of_one_cast_per_micro_batch(
    monkeypatch, recipe, recompute_weight_cast
):
    config = Float8LinearConfig.from_recipe_name(
        recipe, recompute_weight_cast=recompute_weight_cast
    )
    per_micro_batch, once = make_model(config), make_model(config)
    inputs = [torch.randn(32, 64) for _ in range(MICRO_BATCHES)]
    accumulate(per_micro_batch, inputs, once=False)
    casts = weight_casts(monkeypatch, once)
    accumulate(once, inputs, once=True)
    # Tensorwise: one cast of each weight serves both its gemms; rowwise needs one per gemm.
    assert casts() == 2 * (1 if recipe == "tensorwise" else 2)
    for a, b in zip(per_micro_batch.parameters(), once.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_without_the_block_each_micro_batch_casts_again(monkeypatch):
    model = make_model()
    casts = weight_casts(monkeypatch, model)
    accumulate(model, [torch.randn(32, 64) for _ in range(MICRO_BATCHES)], once=False)
    # Per micro-batch: each layer's forward cast, and the recast for the grad_input gemm in
    # backward (recompute_weight_cast=True), which the first layer has none of (its input
    # needs no gradient).
    assert casts() == (1 + 2) * MICRO_BATCHES


def test_a_weight_changed_inside_the_block_raises():
    model = make_model()
    with cast_weights_once(model):
        model(torch.randn(32, 64)).sum().backward()
        with torch.no_grad():
            model[0].weight.add_(1.0)
        with pytest.raises(RuntimeError, match="weight changed inside cast_weights_once"):
            model(torch.randn(32, 64))
    model(torch.randn(32, 64))  # outside the block: cast as usual


def test_compiled_accumulation_matches_eager_without_recompiles():
    eager, compiled = make_model(), make_model()
    counter = CompileCounterWithBackend("aot_eager")
    forward = torch.compile(compiled, backend=counter, fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for _ in range(3):
        inputs = [torch.randn(32, 64) for _ in range(MICRO_BATCHES)]
        accumulate(eager, inputs, once=True)
        accumulate(compiled, inputs, once=True, forward=forward)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert counter.frame_count == 1


def test_sharded_weights_are_refused(monkeypatch):
    # A real DTensor needs a process group (tests/test_fsdp.py has them); the guard is on the
    # type, so pretend.
    monkeypatch.setattr("fp8train.accumulate._is_dtensor", lambda tensor: True)
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather"):  # noqa: SIM117
        with cast_weights_once(make_model()):
            pass
