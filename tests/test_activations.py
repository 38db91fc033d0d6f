"""fp8train.float8_swiglu: SwiGLU whose two inputs are kept for backward in float8."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from benchmarks.saved_by_block import saved_by_backward
from fp8train import Float8LinearConfig, compute_error, convert_to_float8_training, float8_swiglu
from fp8train.cast import to_float8
from fp8train.config import ScalingGranularity
from fp8train.models import FeedForward, ModelArgs, Transformer
from tests.conftest import DEVICES, train_losses

E4M3 = torch.float8_e4m3fn


def halves(
    rows: int = 64,
    hidden: int = 96,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
):
    generator = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(2, rows // 2, hidden, generator=generator) * 3 for _ in range(2))
    return (t.to(device, dtype).requires_grad_() for t in (gate, up))


def dequantized(hp: torch.Tensor) -> torch.Tensor:
    """hp at its float8 copy's values: what float8_swiglu computes from."""
    fp8 = to_float8(hp.reshape(-1, hp.shape[-1]), E4M3, ScalingGranularity.ROWWISE, reduce_dim=-1)
    return fp8.to_hp(torch.float32).reshape(hp.shape)


@pytest.mark.parametrize("device", DEVICES)
def test_output_and_gradients_are_swiglu_at_the_float8_copies(device):
    # On a GPU the copies come from the eager rowwise cast kernel; the reference from the
    # same cast path.
    gate, up = halves(device=device)
    grad = torch.randn_like(gate)
    out = float8_swiglu(gate, up)
    out.backward(grad)
    # The reference: SwiGLU by autograd at the float8 copies' values.
    a = dequantized(gate.detach()).requires_grad_()
    b = dequantized(up.detach()).requires_grad_()
    reference = F.silu(a) * b
    reference.backward(grad)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gate.grad, a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up.grad, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exact_forward", [False, True])
def test_eager_chunks_of_rows_give_the_same_bits_as_one_pass(monkeypatch, exact_forward):
    import fp8train.cast

    gate, up = halves(rows=64, hidden=96, dtype=torch.bfloat16)
    grad = torch.randn_like(gate)
    results = []
    monkeypatch.setattr(fp8train.cast, "EAGER_PIECE_MIN_ELEMENTS", 0)
    for pieces in (1, 13):  # 13 pieces of 5 rows, the last of 4
        monkeypatch.setattr(fp8train.cast, "EAGER_PIECES", pieces)
        gate.grad = up.grad = None
        out = float8_swiglu(gate, up, exact_forward=exact_forward)
        out.backward(grad)
        results.append((out, gate.grad, up.grad))
    for whole, chunked in zip(*results, strict=True):
        assert torch.equal(whole, chunked)


def test_close_to_high_precision_swiglu():
    gate, up = halves(dtype=torch.bfloat16)
    grad = torch.randn_like(gate)
    float8_swiglu(gate, up).backward(grad)
    fp8_grads = gate.grad.clone(), up.grad.clone()
    gate.grad = up.grad = None
    reference = F.silu(gate.float()) * up.float()
    (reference.to(gate.dtype)).backward(grad)
    out = float8_swiglu(gate.detach(), up.detach())
    # e4m3 with a scale per row: about 30 dB; below 25 would mean a wrong scale or layout.
    assert compute_error(reference, out) > 25
    for fp8_grad, hp_grad in zip(fp8_grads, (gate.grad, up.grad), strict=True):
        assert fp8_grad.dtype == torch.bfloat16
        assert compute_error(hp_grad, fp8_grad) > 25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_forward_computes_the_output_from_the_halves_and_backward_from_the_copies(dtype):
    gate, up = halves(dtype=dtype)
    grad = torch.randn_like(gate)
    out = float8_swiglu(gate, up, exact_forward=True)
    out.backward(grad)
    exact_grads = gate.grad.clone(), up.grad.clone()
    # The output: SwiGLU of the halves in fp32, rounded once.
    assert torch.equal(out, (F.silu(gate.float()) * up.float()).to(dtype).detach())
    # The gradients: those of the default mode, taken at the float8 copies.
    gate.grad = up.grad = None
    float8_swiglu(gate, up).backward(grad)
    assert torch.equal(exact_grads[0], gate.grad) and torch.equal(exact_grads[1], up.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_exact_forward_gives_the_exact_output(backend, device):
    # Compiled, the output is written as q + (exact - q), with q SwiGLU at the copies, so
    # that forward reads the copies: its value must still be the exact one, not q's.
    torch._dynamo.reset()
    gate, up = halves(rows=64, hidden=96, device=device)
    grad = torch.randn_like(gate)
    compiled = torch.compile(
        lambda g, u: float8_swiglu(g, u, exact_forward=True), backend=backend, fullgraph=True
    )
    out = compiled(gate, up)
    out.backward(grad)
    reference = F.silu(gate.detach()) * up.detach()
    torch.testing.assert_close(out, reference, rtol=2e-6, atol=1e-6)
    assert compute_error(reference, out) > 100  # the float8 output is about 30 dB
    expected = [t.clone() for t in (gate.grad, up.grad)]
    gate.grad = up.grad = None
    float8_swiglu(gate, up).backward(grad)
    torch.testing.assert_close(expected[0], gate.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(expected[1], up.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exact_forward", [False, True])
def test_backward_keeps_only_the_float8_copies_and_their_scales(exact_forward):
    gate, up = halves(rows=64, hidden=96)
    saved = []

    def pack(tensor):  # noqa: ANN001, ANN202
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        float8_swiglu(gate, up, exact_forward=exact_forward)
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == [
        ("torch.float32", (64, 1)),
        ("torch.float32", (64, 1)),
        ("torch.float8_e4m3fn", (64, 96)),
        ("torch.float8_e4m3fn", (64, 96)),
    ]
    # Plain PyTorch keeps gate, silu(gate) and up in the inputs' precision.
    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        F.silu(gate) * up
    bytes_of = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    assert bytes_of(saved) < bytes_of(plain) / 5


@pytest.mark.parametrize("exact_forward", [False, True])
@pytest.mark.parametrize("float8_linears", [False, True])
def test_compiled_feed_forward_keeps_the_float8_halves_and_neither_hp_half(
    float8_linears, exact_forward
):
    torch.manual_seed(0)
    args = ModelArgs(
        dim=64, ffn_dim=192, float8_swiglu=True, float8_swiglu_exact_forward=exact_forward
    )
    ffn = FeedForward(args)
    if float8_linears:
        convert_to_float8_training(ffn, config=Float8LinearConfig())
    x = torch.randn(2, 64, 64, requires_grad=True)
    saved = saved_by_backward(ffn, x)
    # Activations of the hidden width (w2's weight, (64, 192), apart).
    hidden = sorted(str(t.dtype) for t in saved if tuple(t.shape) == (128, 192))
    halves_fp8 = ["torch.float8_e4m3fn", "torch.float8_e4m3fn"]
    if float8_linears and not exact_forward:
        # The two float8 halves alone: backward remakes w2's float8 input from them, as
        # forward made it.
        assert hidden == halves_fp8
    elif float8_linears:
        # Forward's output came from the hp halves, which are gone: w2 keeps its own
        # float8 input beside the two halves.
        assert hidden == [*halves_fp8, "torch.float8_e4m3fn"]
    else:
        # A high-precision w2 keeps its own input (SwiGLU's output) for its grad_weight.
        assert hidden == ["torch.float32", *halves_fp8]


@pytest.mark.parametrize("exact_forward", [False, True])
def test_compiles_without_graph_breaks_and_matches_eager(exact_forward):
    torch.manual_seed(0)
    args = ModelArgs(
        dim=64, ffn_dim=192, float8_swiglu=True, float8_swiglu_exact_forward=exact_forward
    )
    ffn = FeedForward(args)
    convert_to_float8_training(ffn, config=Float8LinearConfig())
    compiled_ffn = copy.deepcopy(ffn)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_ffn, fullgraph=True, backend=counter)
    x = torch.randn(2, 32, 64)
    for module in (ffn, compiled):
        module(x).square().sum().backward()
    assert counter.frame_count == 1
    for eager_p, compiled_p in zip(ffn.parameters(), compiled_ffn.parameters(), strict=True):
        torch.testing.assert_close(compiled_p.grad, eager_p.grad, rtol=1e-4, atol=1e-5)


def test_composes_with_activation_checkpointing():
    gate, up = halves()
    grad = torch.randn_like(gate)
    float8_swiglu(gate, up).backward(grad)
    expected = gate.grad.clone(), up.grad.clone()
    gate.grad = up.grad = None
    out = torch.utils.checkpoint.checkpoint(float8_swiglu, gate, up, use_reentrant=False)
    out.backward(grad)
    torch.testing.assert_close(gate.grad, expected[0])
    torch.testing.assert_close(up.grad, expected[1])


def test_compiled_inside_activation_checkpointing_matches_eager():
    torch.manual_seed(0)
    ffn = FeedForward(ModelArgs(dim=64, ffn_dim=192, float8_swiglu=True))
    convert_to_float8_training(ffn, config=Float8LinearConfig())
    compiled_ffn = copy.deepcopy(ffn)

    def checkpointed(module):  # noqa: ANN001, ANN202
        return lambda x: torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)

    compiled = torch.compile(checkpointed(compiled_ffn), fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 32, 64)
    for fn in (checkpointed(ffn), compiled):
        fn(x).square().sum().backward()
    for eager_p, compiled_p in zip(ffn.parameters(), compiled_ffn.parameters(), strict=True):
        torch.testing.assert_close(compiled_p.grad, eager_p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exact_forward", [False, True])
def test_a_model_with_float8_swiglu_trains(exact_forward):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(float8_swiglu=True, float8_swiglu_exact_forward=exact_forward))
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    losses = train_losses(loss, model.parameters())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize(
    ("gate", "up", "kwargs", "match"),
    [
        (torch.randn(4, 8), torch.randn(4, 16), {}, "must have one shape"),
        (torch.randn(4, 8), torch.randn(4, 8, dtype=torch.bfloat16), {}, "one high-precision"),
        (torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32), {}, "floating"),
        (torch.randn(4, 8), torch.randn(4, 8), {"float8_dtype": torch.bfloat16}, "is not one of"),
        (torch.randn(4, 8).double(), torch.randn(4, 8).double(), {}, "float32, bfloat16 or"),
        (torch.randn(()), torch.randn(()), {}, "scalar; it needs a last dim"),
    ],
)
def test_bad_input_is_refused_by_name(gate, up, kwargs, match):
    with pytest.raises(ValueError, match=match):
        float8_swiglu(gate, up, **kwargs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_tokens_give_an_empty_output_and_empty_gradients(compiled):
    gate = torch.randn(2, 0, 32, requires_grad=True)
    up = torch.randn(2, 0, 32, requires_grad=True)
    swiglu = torch.compile(float8_swiglu, fullgraph=True) if compiled else float8_swiglu
    out = swiglu(gate, up)
    out.sum().backward()
    assert out.shape == (2, 0, 32)
    assert gate.grad.shape == gate.shape and up.grad.shape == up.shape
