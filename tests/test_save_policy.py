"""What a Float8Linear keeps between forward and backward, read off the saved tensors."""

import copy
import dataclasses

import pytest
import torch

from fp8train import Float8Linear, Float8LinearConfig
from tests.conftest import all_roles_config, hp_grad_weight_config, record_casts

M, K, N = 64, 96, 48
E4M3 = torch.float8_e4m3fn


def saved_by_forward(layer: Float8Linear, x: torch.Tensor) -> list[torch.Tensor]:
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    out.sum().backward()
    return saved


def describe(saved: list[torch.Tensor], weight: torch.nn.Parameter) -> list[tuple]:
    """(what, dtype, shape) per saved tensor; the weight parameter itself is named."""
    return [
        ("weight parameter" if t is weight else "tensor", t.dtype, tuple(t.shape)) for t in saved
    ]


def nbytes(saved: list[torch.Tensor], weight: torch.nn.Parameter) -> int:
    """Bytes that forward adds to memory: the parameter is held anyway and costs nothing."""
    return sum(t.numel() * t.element_size() for t in saved if t is not weight)


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "recompute_input_cast", [False, True], ids=["keep-fp8-input", "keep-hp-input"]
)
@pytest.mark.parametrize(
    "recompute_weight_cast", [True, False], ids=["recompute-weight", "keep-fp8-weight"]
)
def test_tensorwise_save_policy(recompute_weight_cast, recompute_input_cast, hp_dtype):
    config = Float8LinearConfig(
        recompute_weight_cast=recompute_weight_cast, recompute_input_cast=recompute_input_cast
    )
    layer = Float8Linear(K, N, bias=False, dtype=hp_dtype, config=config)
    x = torch.randn(M, K, dtype=hp_dtype, requires_grad=True)
    saved = saved_by_forward(layer, x)

    expected = []
    if recompute_input_cast:
        expected.append(("tensor", hp_dtype, (M, K)))
    else:
        expected += [("tensor", E4M3, (M, K)), ("tensor", torch.float32, ())]
    if recompute_weight_cast:
        expected.append(("weight parameter", hp_dtype, (N, K)))
    else:
        expected += [("tensor", E4M3, (N, K)), ("tensor", torch.float32, ())]
    # In eager mode a recomputed dynamic tensorwise cast reuses forward's scale (the tensor and
    # so its amax are unchanged), which spares backward an amax pass: 4 bytes per recast.
    recasts = int(recompute_input_cast) + int(recompute_weight_cast)
    expected += [("tensor", torch.float32, ())] * recasts
    assert describe(saved, layer.weight) == expected

    hp_size = hp_dtype.itemsize
    expected_bytes = (
        (M * K * hp_size if recompute_input_cast else M * K + 4)
        + (0 if recompute_weight_cast else N * K + 4)
        + 4 * recasts
    )
    assert nbytes(saved, layer.weight) == expected_bytes
    # Nothing of the weight's size in float8 is kept when the cast is recomputed.
    if recompute_weight_cast:
        assert not any(t.dtype == E4M3 and t.shape == (N, K) for t in saved)


def test_rowwise_keeps_the_input_scaled_for_the_grad_weight_gemm():
    config = all_roles_config("rowwise", recompute_weight_cast=False)
    layer = Float8Linear(K, N, bias=False, config=config)
    saved = saved_by_forward(layer, torch.randn(M, K, requires_grad=True))
    # input: one scale per column (reduced over the tokens, the grad_weight gemm's inner dim);
    # weight: one scale per input feature (reduced over N, the grad_input gemm's inner dim).
    assert describe(saved, layer.weight) == [
        ("tensor", E4M3, (M, K)),
        ("tensor", torch.float32, (1, K)),
        ("tensor", E4M3, (N, K)),
        ("tensor", torch.float32, (1, K)),
    ]


def test_high_precision_grad_weight_gemm_keeps_the_hp_input():
    config = hp_grad_weight_config()
    layer = Float8Linear(K, N, bias=False, config=config)
    saved = saved_by_forward(layer, torch.randn(M, K, requires_grad=True))
    assert describe(saved, layer.weight) == [
        ("tensor", torch.float32, (M, K)),
        ("weight parameter", torch.float32, (N, K)),
        ("tensor", torch.float32, ()),  # forward's weight scale, for backward's recast
    ]


def test_float8_input_saves_half_of_bf16_training():
    # The first layer of a model: its input needs no gradient, so neither layer keeps the
    # weight (nn.Linear would keep a view of it, free but not the parameter object).
    x = torch.randn(M, K, dtype=torch.bfloat16)
    bf16 = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
    fp8 = Float8Linear.from_float(copy.deepcopy(bf16))
    bf16_bytes = nbytes(saved_by_forward(bf16, x), bf16.weight)
    fp8_bytes = nbytes(saved_by_forward(fp8, x), fp8.weight)
    assert bf16_bytes == M * K * 2
    assert fp8_bytes == M * K + 4  # the float8 input and its scale


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_every_policy_gives_the_same_gradients(granularity):
    """Recomputing a cast gives the same float8 bytes as keeping it: the policy is free of
    numerical effect."""
    base = Float8Linear(K, N)
    x, grad = torch.randn(M, K), torch.randn(M, N)
    results = []
    for recompute_weight_cast in (True, False):
        for recompute_input_cast in (True, False):
            layer = copy.deepcopy(base)
            layer.config = all_roles_config(
                granularity,
                recompute_weight_cast=recompute_weight_cast,
                recompute_input_cast=recompute_input_cast,
            )
            xi = x.clone().requires_grad_()
            layer(xi).backward(grad)
            results.append((xi.grad, layer.weight.grad))
    for grad_input, grad_weight in results[1:]:
        assert torch.equal(grad_input, results[0][0])
        assert torch.equal(grad_weight, results[0][1])


def test_layers_reading_one_input_share_its_cast_and_its_kept_copy(monkeypatch):
    """q, k and v projections of one normed input: one cast, one float8 copy kept for
    backward, the gradients of separate casts (the same bytes)."""
    torch.manual_seed(0)
    projections = [Float8Linear(64, 32, bias=False) for _ in range(3)]
    x = torch.randn(16, 64, requires_grad=True)

    def run(share: bool):  # noqa: ANN202
        calls = record_casts(monkeypatch)
        for layer in projections:
            layer.weight.grad = None
        x.grad = None
        normed = x * 2  # made in this forward: shared; each a fresh tensor: not shared
        outs = [layer(normed if share else x * 2) for layer in projections]
        sum(out.square().sum() for out in outs).backward()
        monkeypatch.undo()
        grads = [x.grad.clone()] + [layer.weight.grad.clone() for layer in projections]
        return [call.shape for call in calls].count((16, 64)), grads

    shared_casts, shared_grads = run(share=True)
    separate_casts, separate_grads = run(share=False)
    assert (shared_casts, separate_casts) == (1, 3)
    for a, b in zip(shared_grads, separate_grads, strict=True):
        assert torch.equal(a, b)


def test_delayed_layers_reading_one_input_share_its_cast_and_keep_equal_histories(monkeypatch):
    """Delayed scaling: one cast (the first layer's scale) for q, k and v, and every layer's
    history gets the input's amax, so over steps and syncs the histories, scales and
    gradients are those of separate casts."""
    from fp8train import CastConfig, sync_float8_amax_and_scale_history

    delayed = CastConfig(scaling_type="delayed")
    config = Float8LinearConfig(
        cast_config_input=delayed, cast_config_weight=delayed, cast_config_grad_output=delayed
    )
    torch.manual_seed(0)
    base = torch.nn.ModuleList(Float8Linear(64, 32, bias=False, config=config) for _ in range(3))

    def run(share: bool):  # noqa: ANN202
        torch.manual_seed(1)
        projections = copy.deepcopy(base)
        counts, grads = [], []
        for _ in range(3):
            x = torch.randn(16, 64, requires_grad=True)
            calls = record_casts(monkeypatch)
            normed = x * 2  # made in this forward: shared; each a fresh tensor: not shared
            outs = [layer(normed if share else x * 2) for layer in projections]
            monkeypatch.undo()
            counts.append([call.shape for call in calls].count((16, 64)))
            sum(out.square().sum() for out in outs).backward()
            sync_float8_amax_and_scale_history(projections)
            grads += [x.grad] + [layer.weight.grad.clone() for layer in projections]
            projections.zero_grad()
        return counts, grads, projections

    shared_counts, shared_grads, shared = run(share=True)
    separate_counts, separate_grads, separate = run(share=False)
    assert shared_counts == [1, 1, 1] and separate_counts == [3, 3, 3]
    for a, b in zip(shared_grads, separate_grads, strict=True):
        assert torch.equal(a, b)
    histories = [layer.fp8_amax_history_input for layer in shared]
    assert histories[0][2] > 0  # three steps recorded
    for one, other in zip(shared, separate, strict=True):
        assert torch.equal(one.fp8_amax_history_input, histories[0])
        assert torch.equal(one.fp8_amax_history_input, other.fp8_amax_history_input)
        assert torch.equal(one.fp8_scale_input, other.fp8_scale_input)


def test_an_input_kept_in_high_precision_is_not_shared(monkeypatch):
    """recompute_input_cast=True keeps the hp input for backward: a shared float8 copy would
    live with it until backward, so each layer casts for itself and drops its cast."""
    from fp8train.policy import _INPUT_CASTS

    config = Float8LinearConfig(recompute_input_cast=True)
    projections = [Float8Linear(64, 32, bias=False, config=config) for _ in range(3)]
    x = torch.randn(16, 64, requires_grad=True)
    calls = record_casts(monkeypatch)
    normed = x * 2
    outs = [layer(normed) for layer in projections]
    assert [call.shape for call in calls].count((16, 64)) == 3
    assert normed not in _INPUT_CASTS
    sum(out.sum() for out in outs).backward()


def test_a_leaf_input_is_cast_on_every_call(monkeypatch):
    layer = Float8Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    calls = record_casts(monkeypatch)
    layer(x), layer(x)
    assert [call.shape for call in calls].count((16, 64)) == 2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_a_frozen_weight_keeps_no_input_and_an_input_without_grad_no_weight(recipe):
    """Backward reads the input only for grad_weight and the weight only for grad_input."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise":
        config = dataclasses.replace(config, recompute_weight_cast=False)  # keeps a float8 weight
    layer = Float8Linear(128, 256, bias=False, config=config)
    frozen = copy.deepcopy(layer).requires_grad_(False)
    # 16 tokens: no blockwise cast along the tokens runs without a weight gradient.
    x = torch.randn(16, 128, requires_grad=True)
    saved = saved_by_forward(frozen, x)
    assert all(16 not in t.shape for t in saved), describe(saved, frozen.weight)
    assert x.grad is not None
    x = torch.randn(128, 128)
    saved = saved_by_forward(layer, x)
    assert all(256 not in t.shape for t in saved), describe(saved, layer.weight)
    assert layer.weight.grad is not None
