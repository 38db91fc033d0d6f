"""Named recipes: what each builds, its accuracy against fp32, and the robustness to outliers
that finer scales buy (blockwise >= rowwise >= tensorwise)."""

import copy
import re

import pytest
import torch
from torch import nn

from fp8train import Float8Linear, Float8LinearConfig, compute_error
from fp8train.cast import cast_for_gemm
from fp8train.config import E4M3, Float8LinearRecipeName, Gemm, Role

RECIPES = [name.value for name in Float8LinearRecipeName]
M, K, N = 256, 256, 384


def test_recipes_build_what_they_promise():
    tensorwise = Float8LinearConfig.from_recipe_name("tensorwise")
    assert tensorwise == Float8LinearConfig()
    rowwise = Float8LinearConfig.from_recipe_name(Float8LinearRecipeName.ROWWISE)
    assert rowwise.cast_config(Role.GRAD_OUTPUT, Gemm.GRAD_WEIGHT).target_dtype == E4M3
    assert rowwise.cast_config(Role.INPUT, Gemm.OUTPUT).scaling_granularity == "rowwise"
    assert rowwise.round_scales_to_power_of_2
    gw_hp = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    assert not gw_hp.cast_config(Role.INPUT, Gemm.GRAD_WEIGHT).enabled
    assert gw_hp.cast_config(Role.INPUT, Gemm.OUTPUT).enabled
    blockwise = Float8LinearConfig.from_recipe_name("blockwise", recompute_weight_cast=False)
    assert blockwise.cast_config(Role.WEIGHT, Gemm.GRAD_INPUT).scaling_granularity == "blockwise"
    assert not blockwise.recompute_weight_cast


def test_unknown_recipe_lists_the_recipes():
    with pytest.raises(ValueError, match="'rowise' is not a Float8LinearRecipeName: choose one of"):
        Float8LinearConfig.from_recipe_name("rowise")


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return [out, x.grad, layer.weight.grad]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_output_and_gradients_against_fp32(recipe):
    reference = nn.Linear(K, N, bias=False)
    layer = Float8Linear.from_float(
        copy.deepcopy(reference), Float8LinearConfig.from_recipe_name(recipe)
    )
    x, grad = torch.randn(M, K), torch.randn(M, N)
    for expected, actual in zip(fwd_bwd(reference, x, grad), fwd_bwd(layer, x, grad), strict=True):
        assert compute_error(expected, actual) >= 20


def test_finer_scales_keep_precision_next_to_outlier_channels():
    """A few input channels 10^4 times larger than the rest, and tokens whose magnitudes span
    two decades. 100x outliers cost float8 nothing (a float format: every value keeps 3
    mantissa bits while it stays in e4m3's 2^15 normal range); at 10^4 a tensorwise scale
    pushes the other values into subnormals. Measured on the values that are not outliers."""
    torch.manual_seed(0)
    rows = torch.logspace(-2, 0, M)[torch.randperm(M)][:, None]
    x = torch.randn(M, K) * rows
    outliers = [5, 77, 200]
    x[:, outliers] *= 1e4
    normal = torch.ones(K, dtype=torch.bool)
    normal[outliers] = False
    sqnr = {}
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        config = Float8LinearConfig.from_recipe_name(recipe)
        back = cast_for_gemm(x, Role.INPUT, Gemm.OUTPUT, config).to_hp(torch.float32)
        sqnr[recipe] = compute_error(x[:, normal], back[:, normal]).item()
    assert sqnr["blockwise"] > sqnr["rowwise"] > sqnr["tensorwise"] + 5


def test_blockwise_refuses_layers_not_in_whole_blocks():
    config = Float8LinearConfig.from_recipe_name("blockwise")
    with pytest.raises(ValueError, match="in_features=64 not a multiple of 128"):
        Float8Linear(64, 128, config=config)
    layer = Float8Linear(128, 128, config=config, fqn="layers.0.wq")
    with pytest.raises(ValueError, match="'layers.0.wq'.*tokens.*=64 is not a multiple of 128"):
        layer(torch.randn(64, 128))


def test_blockwise_keeps_the_float8_input_in_blocks_along_the_tokens():
    layer = Float8Linear(K, N, bias=False, config=Float8LinearConfig.from_recipe_name("blockwise"))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(torch.randn(M, K, requires_grad=True))
    out.sum().backward()
    # The input for the grad_weight gemm: 128 x 1 blocks (along M), one scale each; the
    # weight parameter itself (its 128 x 128 cast is recomputed in backward).
    shapes = [(t.dtype, tuple(t.shape)) for t in saved]
    assert shapes == [(E4M3, (M, K)), (torch.float32, (M // 128, K)), (torch.float32, (N, K))]


def test_blockwise_compiles_fullgraph():
    layer = Float8Linear(K, N, config=Float8LinearConfig.from_recipe_name("blockwise"))
    x = torch.randn(M, K)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
    compiled(x).sum().backward()


def test_blockwise_compiled_backward_keeps_the_float8_input():
    from tests.test_compile import backward_inputs

    layer = Float8Linear(K, N, bias=False, config=Float8LinearConfig.from_recipe_name("blockwise"))
    graph = backward_inputs(layer, torch.randn(M, K, requires_grad=True))
    # The float8 input and its 128 x 1 block scales; the hp weight, recast in backward with
    # the 128 x 128 block scales forward found.
    assert sorted(graph, key=str) == sorted(
        [
            (E4M3, (M, K)),
            (torch.float32, (M // 128, K)),
            (torch.float32, (N, K)),
            (torch.float32, (N // 128, K // 128)),
        ],
        key=str,
    )


def _block_scaled_gemm_here() -> str | None:
    """Why torch's block-scaled gemm cannot run here, or None where it can."""
    from fp8train.gemm import _has_block_scaled_gemm

    if not torch.cuda.is_available():
        return "needs CUDA"
    if not _has_block_scaled_gemm(None):
        return "torch's block-scaled gemm needs sm90 and CUDA >= 12.9"
    return None


needs_block_scaled_gemm = pytest.mark.skipif(
    _block_scaled_gemm_here() is not None, reason=str(_block_scaled_gemm_here())
)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@needs_block_scaled_gemm
@pytest.mark.parametrize("shape", [(256, 512, 768), (384, 1280, 640)])
@pytest.mark.parametrize("compiled", [False, True])
def test_blockwise_gemms_run_block_scaled_on_sm90_and_match_the_emulation(shape, compiled):
    """All three gemms of a blockwise layer take torch's block-scaled gemm (1x128 x 128x128
    forward and grad_input, 1x128 x 1x128 grad_weight) and agree with the emulated gemms,
    which dequantize the same float8 operands. 1280 / 128 = 10 blocks: the 128x128 scales
    are padded to a multiple of 4 along K."""
    m, k, n = shape
    torch.manual_seed(0)
    reference = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    recipe = Float8LinearConfig.from_recipe_name
    hardware = Float8Linear.from_float(copy.deepcopy(reference), recipe("blockwise"))
    emulated = Float8Linear.from_float(copy.deepcopy(reference), recipe("blockwise", emulate=True))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if compiled:
        from torch._inductor.utils import run_and_get_code

        run = torch.compile(hardware, fullgraph=True)
        actual, codes = run_and_get_code(lambda: fwd_bwd(run, x, grad))
        # One call per gemm (the op's name also appears in the code's comments).
        calls = re.compile(r"^\s*\w+ = torch\.ops\.fp8train\.block_scaled_mm\.default\(", re.M)
        assert sum(len(calls.findall(code)) for code in codes) == 3, codes
    else:
        counter = _CountOps()
        with counter:
            actual = fwd_bwd(hardware, x, grad)
        assert counter.ops.count("aten._scaled_mm_v2") == 3, counter.ops
    expected = fwd_bwd(emulated, x, grad)
    for want, got in zip(expected, actual, strict=True):
        assert compute_error(want.float(), got.float()) >= 40
