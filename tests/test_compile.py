"""torch.compile tier: one graph and no recompiles over eager -> aot_eager -> inductor, and the
save policy read off what the partitioner hands the compiled backward.

The partitioner ignores save_for_backward, so these tests do not ask the autograd.Function what
it saves: they record the placeholders of the backward graph that aot_autograd (the min-cut
partitioner that aot_eager and inductor use) or inductor itself produced.
"""

import copy
import functools
import re

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.utils import run_and_get_code
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from benchmarks.saved_by_block import saved_by_backward
from fp8train import (
    Float8Linear,
    Float8LinearConfig,
    compute_error,
    convert_to_float8_training,
    sync_float8_amax_and_scale_history,
)
from fp8train.kernels import HAS_TRITON
from fp8train.models import ModelArgs, Transformer
from tests.conftest import (
    DEVICES,
    FLOAT8_GPU_REASON,
    Projections,
    all_roles_config,
    one_pass_delayed_config,
)

M, K, N = 64, 96, 48
E4M3 = torch.float8_e4m3fn
TORCH_2_13 = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


# ---------------------------------------------------------------------------- graph breaks


# Inductor compiles slowly on the CPU: it runs the default policy only.
GRAPH_CASES = [
    ("eager", True),
    ("eager", False),
    ("aot_eager", True),
    ("aot_eager", False),
    ("inductor", True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("backend", "recompute_weight_cast"), GRAPH_CASES)
def test_llama_model_is_one_graph_without_recompiles(backend, device, recompute_weight_cast):
    torch._dynamo.reset()
    counters.clear()
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=176, max_seq_len=32)
    model = Transformer(args).to(device)
    convert_to_float8_training(
        model,
        config=Float8LinearConfig(recompute_weight_cast=recompute_weight_cast),
        module_filter_fn=lambda module, fqn: fqn != "lm_head",
    )
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    tokens = torch.randint(0, args.vocab_size, (2, 32), device=device)
    for _ in range(2):
        compiled(tokens).float().sum().backward()
    assert counter.frame_count == 1
    assert sum(counters["recompiles"].values()) == 0
    assert compute_error(model(tokens), compiled(tokens)) > 40


@pytest.mark.parametrize(
    ("make_config", "graphs"),
    # One-pass delayed scaling compiles again once, when the scales become ready.
    [(Float8LinearConfig, 1), (one_pass_delayed_config, 2)],
    ids=["dynamic", "one-pass-delayed"],
)
def test_blocks_compiled_one_by_one_share_their_graphs(make_config, graphs):
    """Compiling each block (as examples/train_llama.py does) compiles the block's code once
    for all layers: nothing a layer's forward reads at trace time, such as its name, may
    differ between layers, or each layer recompiles, and past dynamo's recompile limit
    fullgraph fails."""
    torch._dynamo.reset()
    counters.clear()
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, ffn_dim=176, max_seq_len=32)
    model = Transformer(args)
    convert_to_float8_training(
        model, config=make_config(), module_filter_fn=lambda module, fqn: fqn != "lm_head"
    )
    counter = CompileCounterWithBackend("eager")
    for block in model.layers:
        block.compile(fullgraph=True, backend=counter)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    for _ in range(3):
        model(tokens).float().sum().backward()
        sync_float8_amax_and_scale_history(model)
    assert counter.frame_count == graphs


def test_dynamic_token_counts_share_one_graph():
    """Under dynamic shapes the alignment checks guard only on what the config needs: a
    tensorwise layer must not install blockwise's `tokens % 128` guard and recompile when a
    multiple of 128 arrives. (aot_eager: inductor adds divisibility guards of its own.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = Float8Linear(64, 48)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    # 2048 x 64 elements passes the size from which eager casts work in pieces
    # (fp8train.cast.EAGER_PIECE_MIN_ELEMENTS): compiled code must not test it.
    for tokens in (32, 48, 128, 256, 2048):
        x = torch.randn(tokens, 64)
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
        frames.append(counter.frame_count)
    assert frames == frames[:1] * len(frames)


# ------------------------------------------------------------- what the backward receives


class BackwardInputs:
    """An aot_eager backend (the min-cut partitioner) that records, for each backward graph,
    the (dtype, shape) of what forward handed it (tangents left out)."""

    def __init__(self) -> None:
        self.graphs: list[list[tuple[torch.dtype, tuple[int, ...]]]] = []
        self.backend = aot_autograd(
            fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
            bw_compiler=self._record,
            partition_fn=min_cut_rematerialization_partition,
        )

    def _record(self, gm, example_inputs):  # noqa: ANN001, ANN202
        self.graphs.append(
            [
                (node.meta["val"].dtype, tuple(node.meta["val"].shape))
                for node in gm.graph.nodes
                if node.op == "placeholder" and not node.name.startswith("tangents")
            ]
        )
        return make_boxed_func(gm.forward)


def backward_inputs(fn, *inputs, backend: str = "aot_eager"):  # noqa: ANN001, ANN201
    """Run `fn(*inputs)` compiled, forward and backward; the (dtype, shape) of what its
    backward graph received from aot_eager's partitioner or inductor's."""
    if backend == "inductor":
        return [(t.dtype, tuple(t.shape)) for t in saved_by_backward(fn, *inputs)]
    torch._dynamo.reset()
    recorder = BackwardInputs()
    compiled = torch.compile(fn, backend=recorder.backend, fullgraph=True)
    compiled(*inputs).sum().backward()
    (graph,) = recorder.graphs
    return graph


def float8_of(graph, shape) -> bool:  # noqa: ANN001
    return any(dtype == E4M3 and sorted(s) == sorted(shape) for dtype, s in graph)


# (recompute_weight_cast, recompute_input_cast, backend): every policy through the min-cut
# partitioner; inductor (slow to compile on the CPU) on the two that differ in every role.
POLICY_CASES = [
    pytest.param(True, False, "aot_eager", id="recompute-weight-keep-fp8-input-aot_eager"),
    pytest.param(True, True, "aot_eager", id="recompute-weight-keep-hp-input-aot_eager"),
    pytest.param(False, False, "aot_eager", id="keep-fp8-weight-keep-fp8-input-aot_eager"),
    pytest.param(False, True, "aot_eager", id="keep-fp8-weight-keep-hp-input-aot_eager"),
    pytest.param(True, False, "inductor", id="recompute-weight-keep-fp8-input-inductor"),
    pytest.param(False, True, "inductor", id="keep-fp8-weight-keep-hp-input-inductor"),
]


@pytest.mark.parametrize(("recompute_weight_cast", "recompute_input_cast", "backend"), POLICY_CASES)
def test_compiled_backward_receives_what_the_policy_keeps(
    recompute_weight_cast, recompute_input_cast, backend
):
    config = Float8LinearConfig(
        recompute_weight_cast=recompute_weight_cast, recompute_input_cast=recompute_input_cast
    )
    _check_policy_kept(config, recompute_weight_cast, recompute_input_cast, backend, "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("recompute_weight_cast", "recompute_input_cast"),
    [(True, False), (True, True), (False, False), (False, True)],
    ids=["recompute-weight-keep-fp8-input", "recompute-weight-keep-hp-input",
         "keep-fp8-weight-keep-fp8-input", "keep-fp8-weight-keep-hp-input"],
)  # fmt: skip
def test_compiled_cast_kernels_keep_what_the_policy_keeps(
    recompute_weight_cast, recompute_input_cast, device
):
    """The same policies with compiled_cast_kernels: on CUDA the casts are fp8train's triton
    ops, other nodes for the partitioner, and the tags must steer it alike."""
    config = Float8LinearConfig(
        recompute_weight_cast=recompute_weight_cast,
        recompute_input_cast=recompute_input_cast,
        compiled_cast_kernels=True,
    )
    _check_policy_kept(config, recompute_weight_cast, recompute_input_cast, "aot_eager", device)


def _check_policy_kept(config, recompute_weight_cast, recompute_input_cast, backend, device):  # noqa: ANN001, ANN202
    layer = Float8Linear(K, N, bias=False, config=config, device=device)
    x = torch.randn(M, K, requires_grad=True, device=device)
    graph = backward_inputs(layer, x, backend=backend)

    # input: float8 (M, K) for the grad_weight gemm, or the hp input to recast, never both.
    assert float8_of(graph, (M, K)) is not recompute_input_cast
    assert ((torch.float32, (M, K)) in graph) is recompute_input_cast
    # weight: float8 for the grad_input gemm, or the hp parameter to recast (which costs no
    # memory), never both.
    assert float8_of(graph, (N, K)) is not recompute_weight_cast
    assert ((torch.float32, (N, K)) in graph) is recompute_weight_cast
    # Besides those, only scales.
    big = [entry for entry in graph if entry[1] != ()]
    assert len(big) == 2


@pytest.mark.parametrize(
    "config",
    [
        Float8LinearConfig(),
        Float8LinearConfig(recompute_weight_cast=False),
        all_roles_config("rowwise"),
        all_roles_config("rowwise", recompute_input_cast=True),
        all_roles_config("rowwise", recompute_weight_cast=False),
        Float8LinearConfig(compiled_cast_kernels=True),
        Float8LinearConfig(compiled_cast_kernels=True, recompute_weight_cast=False),
        Float8LinearConfig(emulate=True),
    ],
    ids=["tensorwise", "tensorwise-keep-fp8-weight", "rowwise", "rowwise-keep-hp-input",
         "rowwise-keep-fp8-weight", "cast-kernels", "cast-kernels-keep-fp8-weight", "emulate"],
)  # fmt: skip
def test_compiled_and_eager_give_the_same_gradients(config):
    torch._dynamo.reset()
    layer = Float8Linear(K, N, config=config)
    x = torch.randn(M, K)
    grads = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        fn(xi).square().sum().backward()
        grads.append((xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
    for eager, compiled in zip(*grads, strict=True):
        assert torch.equal(eager, compiled)


def _graph_targets(fn, *inputs) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """The call_function targets of the forward and the backward graph that aot_autograd
    (the min-cut partitioner) hands its compilers."""
    forward: list[str] = []
    backward: list[str] = []

    def recorder(targets: list[str]):  # noqa: ANN202
        def record(gm, _):  # noqa: ANN001, ANN202
            targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)

        return record

    torch._dynamo.reset()
    backend = aot_autograd(
        fw_compiler=recorder(forward),
        bw_compiler=recorder(backward),
        partition_fn=min_cut_rematerialization_partition,
    )
    # square(): grad_output then varies (sum() alone gives an expanded scalar one).
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs).square().sum().backward()
    return forward, backward


def _forward_graph_targets(fn, *inputs) -> list[str]:  # noqa: ANN001
    """The call_function targets of the forward graph aot_autograd hands its compiler."""
    return _graph_targets(fn, *inputs)[0]


@pytest.mark.skipif(
    FLOAT8_GPU_REASON is not None or not HAS_TRITON, reason=str(FLOAT8_GPU_REASON or "Triton")
)
def test_compiled_cast_kernels_trace_the_casts_as_fp8train_kernels():
    """With compiled_cast_kernels the compiled forward casts through fp8train's Triton kernels
    (its triton ops, traced into kernel launches inductor makes itself), and no amax or
    float8 conversion is left for inductor to generate; without it, the casts are aten ops.
    (On the CPU the same ops trace into their torch path.)"""
    x = torch.randn(M, K, device="cuda", requires_grad=True)
    on = Float8Linear(K, N, config=Float8LinearConfig(compiled_cast_kernels=True)).cuda()
    targets = _forward_graph_targets(on, x)
    # The input and the weight: one amax kernel each; the weight's cast one kernel, the input's
    # two (from an fp32 tensor the cast kernel writes its two layouts in two launches, see
    # fp8train.kernels.cast_2d; from bf16 in one).
    assert sum("triton_kernel_wrapper" in t for t in targets) == 5
    # No torch-path cast: its amax (vector_norm) and its saturation (clamp).
    assert "aten.linalg_vector_norm.default" not in targets
    assert "aten.clamp.default" not in targets
    targets = _forward_graph_targets(Float8Linear(K, N).cuda(), x)
    assert not any("triton_kernel_wrapper" in t for t in targets)
    assert "aten.linalg_vector_norm.default" in targets
    assert "aten.clamp.default" in targets


@pytest.mark.skipif(
    FLOAT8_GPU_REASON is not None or not HAS_TRITON, reason=str(FLOAT8_GPU_REASON or "Triton")
)
def test_compiled_cast_kernels_launch_nothing_but_their_kernels():
    """The code inductor generates for a compiled layer with compiled_cast_kernels: per cast
    the amax kernel and the cast kernel, and no fill of a 0-d scale buffer (a 0-d
    torch.empty costs a kernel under inductor, fp8train.kernels.empty_scalar)."""
    layer = Float8Linear(K, N, config=Float8LinearConfig(compiled_cast_kernels=True)).cuda()
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer.to(torch.bfloat16), fullgraph=True)
    _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    code = "\n".join(codes)
    assert "_amax_partials_kernel" in code
    assert "_cast_kernel" in code
    assert not re.search(r"triton_\w*_fused_\w*empty", code)


@pytest.mark.skipif(
    FLOAT8_GPU_REASON is not None or not HAS_TRITON, reason=str(FLOAT8_GPU_REASON or "Triton")
)
@pytest.mark.parametrize("cast_kernels", [False, True], ids=["inductor-casts", "cast-kernels"])
def test_cuda_graphs_replay_the_compiled_steps_exactly(cast_kernels):
    """torch.compile(mode="reduce-overhead") records the compiled float8 steps as CUDA graphs
    and replays them: over steps that warm up, record and replay, every output and gradient
    equals the default mode's."""
    config = Float8LinearConfig(compiled_cast_kernels=cast_kernels)
    layer = Float8Linear(K, N, config=config).cuda().to(torch.bfloat16)
    inputs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    results = []
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        compiled = torch.compile(layer, mode=mode, fullgraph=True)
        steps = []
        for x in inputs:
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            out = compiled(xi)
            out.float().square().sum().backward()
            # Clones: a replayed graph's outputs live in memory the next replay overwrites.
            steps.append((out.detach().clone(), xi.grad.clone(), layer.weight.grad.clone()))
        results.append(steps)
    for step, (default, graphed) in enumerate(zip(*results, strict=True)):
        names = ("output", "grad_input", "grad_weight")
        for name, a, b in zip(names, default, graphed, strict=True):
            assert torch.equal(a, b), f"step {step}, {name}: max |diff| {(a - b).abs().max()}"


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_cast_kernels_match_eager_bit_for_bit(device):
    """Same output and gradients as eager mode (which on CUDA runs the same kernels)."""
    config = Float8LinearConfig(compiled_cast_kernels=True)
    layer = Float8Linear(K, N, config=config).to(device)
    x = torch.randn(M, K, device=device)
    results = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad, layer.weight.grad.clone()))
    for name, eager, compiled in zip(
        ("output", "grad_input", "grad_weight"), *results, strict=True
    ):
        assert torch.equal(eager, compiled), f"{name}: max |diff| {(eager - compiled).abs().max()}"


def _small_block() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 LLaMA-style block small enough to compile with inductor on the CPU in seconds,
    its input and its rotary tables."""
    from fp8train.models import TransformerBlock, rotary_cos_sin

    args = ModelArgs(dim=64, n_heads=2, ffn_dim=176, max_seq_len=96)
    torch.manual_seed(0)
    bf16 = TransformerBlock(args).to(torch.bfloat16)
    x = torch.randn(1, 96, 64, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_cos_sin(96, 32, 10000.0, x.device)
    return bf16, x, cos, sin


TRANSPOSE_CASES = [
    pytest.param(Float8LinearConfig, id="dynamic"),
    pytest.param(one_pass_delayed_config, id="delayed-one-pass"),
]


@pytest.mark.parametrize("make_config", TRANSPOSE_CASES)
def test_compiled_transpose_kernels_copy_grad_output_in_an_op_of_its_own(make_config, monkeypatch):
    """compiled_transpose_kernels=("grad_output",): backward casts grad_output once, row-major,
    and the transpose op copies those bytes column-major for the grad_weight gemm, so that
    inductor cannot fold the strided store into the cast's kernel. Forward is unchanged; off,
    no such op is traced. (On the CPU the triton op traces into its torch path: an opaque
    custom op stands in for it, as benchmarks/saved_by_block.py --opaque-casts does.)"""
    import fp8train.cast
    from benchmarks.saved_by_block import _opaque_transpose_op

    monkeypatch.setattr(fp8train.cast, "_transpose_op", _opaque_transpose_op)
    x = torch.randn(M, K, requires_grad=True)
    graphs = {}
    for roles in (False, ("grad_output",)):
        layer = Float8Linear(K, N, config=make_config(compiled_transpose_kernels=roles))
        graphs[roles] = _graph_targets(layer, x)
    op = "saved_by_block.column_major.default"
    (forward_off, backward_off), (forward_on, backward_on) = graphs.values()
    assert op not in forward_off + backward_off
    assert forward_on == forward_off
    assert backward_on.count(op) == 1


@pytest.mark.parametrize("exposed", [True, False], ids=["bad-ptxas", "fine"])
def test_auto_transpose_kernels_follow_the_toolchain(exposed, monkeypatch):
    """The default compiled_transpose_kernels="auto" traces the transpose op where
    fp8train.toolchain_problem() finds the ptxas that miscompiles kernels storing both
    layouts, and not elsewhere; an explicit False keeps it out either way."""
    import fp8train.cast
    import fp8train.toolchain as toolchain
    from benchmarks.saved_by_block import _opaque_transpose_op

    monkeypatch.setattr(fp8train.cast, "_transpose_op", _opaque_transpose_op)
    monkeypatch.setattr(toolchain, "_auto_transpose_roles", frozenset())  # restored after
    monkeypatch.setattr(toolchain, "toolchain_problem", lambda: "ptxas 12.8" if exposed else None)
    x = torch.randn(M, K, requires_grad=True)
    op = "saved_by_block.column_major.default"
    _, backward = _graph_targets(Float8Linear(K, N), x)
    assert backward.count(op) == (1 if exposed else 0)
    off = Float8Linear(K, N, config=Float8LinearConfig(compiled_transpose_kernels=False))
    assert op not in _graph_targets(off, x)[1]


def _same_steps_with_and_without_transposes(base, make_config, inputs, capture_code=False):  # noqa: ANN001, ANN201
    """Two compiled steps of copies of `base`, without and with compiled_transpose_kernels=
    ("grad_output",), delayed scaling synced after each: asserts that their outputs and
    gradients are equal, bit for bit; returns the code inductor generated in each step
    (with `capture_code`; compiled afresh, not served from a cache, so that it is seen)."""
    from fp8train import sync_float8_amax_and_scale_history

    results, codes = [], []
    for roles in (False, ("grad_output",)):
        layer = copy.deepcopy(base)
        layer.config = make_config(compiled_transpose_kernels=roles)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)
        steps = []
        for x in inputs:
            layer.zero_grad()
            xi = x.clone().requires_grad_()

            def step(xi=xi, compiled=compiled):  # noqa: ANN202
                out = compiled(xi)
                out.float().square().sum().backward()
                return out

            if capture_code:
                with (
                    torch._inductor.config.patch(fx_graph_cache=False),
                    torch._functorch.config.patch(enable_autograd_cache=False),
                ):
                    out, code = run_and_get_code(step)  # resets dynamo: compiles afresh
                codes.append("\n".join(code))
            else:
                out = step()
            sync_float8_amax_and_scale_history(layer)
            steps.append((out.detach(), xi.grad, layer.weight.grad.clone()))
        results.append(steps)
    for off, on in zip(*results, strict=True):
        for name, a, b in zip(("output", "grad_input", "grad_weight"), off, on, strict=True):
            assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max()}"
    return codes


@pytest.mark.parametrize("make_config", TRANSPOSE_CASES)
@pytest.mark.parametrize("opaque", [False, True], ids=["torch-path", "opaque-op"])
def test_compiled_transpose_kernels_change_no_number(make_config, opaque, monkeypatch):
    """Inductor, over two steps with delayed scaling's sync in between (its second step casts
    with recorded scales): the outputs and gradients with the transpose op equal those
    without, bit for bit, both with the op's torch path (what the CPU traces) and with an
    opaque op that inductor calls as it calls the GPU's kernel."""
    import fp8train.cast
    from benchmarks.saved_by_block import _opaque_transpose_op

    if opaque:
        monkeypatch.setattr(fp8train.cast, "_transpose_op", _opaque_transpose_op)
    inputs = [torch.randn(M, K) for _ in range(2)]
    _same_steps_with_and_without_transposes(
        Float8Linear(K, N, config=make_config()), make_config, inputs
    )


@pytest.mark.skipif(
    FLOAT8_GPU_REASON is not None or not HAS_TRITON, reason=str(FLOAT8_GPU_REASON or "Triton")
)
@pytest.mark.parametrize("make_config", TRANSPOSE_CASES)
def test_compiled_transpose_kernels_launch_the_kernel_and_change_no_number(make_config):
    """On the GPU: inductor's code launches fp8train's transpose kernel, and two bf16 steps
    (delayed scaling synced in between) give the same outputs and gradients as without it."""
    inputs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    base = Float8Linear(K, N, config=make_config()).cuda().to(torch.bfloat16)
    codes = _same_steps_with_and_without_transposes(base, make_config, inputs, capture_code=True)
    # codes: off's two steps, then on's.
    assert "_transpose_kernel" not in codes[0] and "_transpose_kernel" in codes[2]


def test_compiled_transpose_kernels_keep_what_a_block_keeps_without_them(monkeypatch):
    """A compiled LLaMA-style block (one-pass delayed scaling, the case the copies are for)
    keeps for backward exactly what it keeps without them, even with every role named, with
    the op as opaque as the GPU's kernel: grad_output exists in backward only, and the
    inputs' and weights' casts that backward remakes ask for one layout each, which the op
    leaves to inductor."""
    import fp8train.cast
    from benchmarks.saved_by_block import _opaque_transpose_op, describe

    monkeypatch.setattr(fp8train.cast, "_transpose_op", _opaque_transpose_op)
    bf16, x, cos, sin = _small_block()
    off, on = (
        describe(saved_by_backward(block, x, cos, sin), block)
        for block in (
            convert_to_float8_training(
                copy.deepcopy(bf16),
                config=one_pass_delayed_config(compiled_transpose_kernels=roles),
            )
            for roles in (False, True)
        )
    )
    assert on == off


def test_default_input_policy_keeps_the_float8_input_of_a_layer_alone():
    """recompute_input_cast=None leaves the choice to the partitioner: for a layer whose hp
    input nothing else keeps, it keeps the float8 input."""
    layer = Float8Linear(K, N, bias=False)
    graph = backward_inputs(layer, torch.randn(M, K, requires_grad=True))
    assert float8_of(graph, (M, K)) and (torch.float32, (M, K)) not in graph


@pytest.mark.parametrize("recompute_input_cast", [None, False], ids=["default", "keep-fp8-input"])
def test_compiled_layers_reading_one_input_keep_one_float8_copy(recompute_input_cast):
    """The partitioner's CSE merges the three identical casts of the shared input (it compares
    op arguments with ==, so the casts must hold no NaN constant): backward gets one float8
    copy of it and one scale, not three (and one scale per weight, for its recast)."""
    module = Projections(K, N, Float8LinearConfig(recompute_input_cast=recompute_input_cast))
    graph = backward_inputs(module, torch.randn(M, K, requires_grad=True))
    assert [entry for entry in graph if entry[0] == E4M3] == [(E4M3, (M, K))]
    assert graph.count((torch.float32, ())) == 1 + 3


def amax_reductions(fn, *inputs) -> int:  # noqa: ANN001
    """How many amax reductions the compiled forward and backward of `fn(*inputs)` run."""
    torch._dynamo.reset()
    found = []

    def record(gm, _):  # noqa: ANN001, ANN202
        amaxes = (torch.ops.aten.linalg_vector_norm.default, torch.ops.aten.amax.default)
        found.append(sum(node.target in amaxes for node in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition
    )
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs).sum().backward()
    return sum(found)


@pytest.mark.parametrize(("granularity", "casts"), [("tensorwise", 3), ("rowwise", 6)])
@pytest.mark.parametrize("recompute_input_cast", [None, True], ids=["default", "keep-hp-input"])
def test_compiled_recasts_in_backward_reuse_the_forward_amax(
    granularity, casts, recompute_input_cast
):
    """A cast recomputed in backward (the weight's by default, the input's with
    recompute_input_cast=True) takes the scale that forward found from the same tensor, so
    each distinct cast finds its amax once (tensorwise: input, weight, grad_output; rowwise:
    each of them along both dims), and backward's recast is one pass over the hp tensor."""
    config = all_roles_config(granularity, recompute_input_cast=recompute_input_cast)
    layer = Float8Linear(K, N, bias=False, config=config)
    assert amax_reductions(layer, torch.randn(M, K, requires_grad=True)) == casts


def test_compiled_rowwise_default_keeps_the_float8_input_and_recasts_the_weight():
    layer = Float8Linear(K, N, bias=False, config=all_roles_config("rowwise"))
    graph = backward_inputs(layer, torch.randn(M, K, requires_grad=True))
    assert float8_of(graph, (M, K)) and (torch.float32, (M, K)) not in graph
    assert (torch.float32, (N, K)) in graph and not float8_of(graph, (N, K))


def test_compiled_rowwise_keep_hp_input_keeps_the_hp_input_and_no_float8_copy():
    """Rowwise, backward's input cast is along the other dim than forward's: forward makes it
    for backward, in a region tagged for recomputation, so that the partitioner keeps the hp
    input it is made from (left to backward's own recast, it kept a float8 copy)."""
    layer = Float8Linear(
        K, N, bias=False, config=all_roles_config("rowwise", recompute_input_cast=True)
    )
    x = torch.randn(M, K, requires_grad=True)
    graph = backward_inputs(layer, x)
    assert (torch.float32, (M, K)) in graph and not float8_of(graph, (M, K))
    assert not float8_of(graph, (N, K))


@pytest.mark.xfail(
    reason="rowwise keep-fp8-weight under compile: the partitioner treats parameters as free to "
    "keep (torch._functorch.config.treat_parameters_as_free_to_save), so it keeps the hp weight "
    "and moves the weight's backward cast into backward",
    strict=True,
)
def test_compiled_rowwise_keep_fp8_weight_keeps_the_float8_weight():
    layer = Float8Linear(
        K, N, bias=False, config=all_roles_config("rowwise", recompute_weight_cast=False)
    )
    graph = backward_inputs(layer, torch.randn(M, K, requires_grad=True))
    assert float8_of(graph, (N, K))


def test_compiled_rowwise_keep_fp8_weight_with_parameters_counted_as_memory():
    """The workaround the README gives: with parameters counted as memory to keep, the
    partitioner keeps the float8 weight the policy asks for (and not the hp one)."""
    layer = Float8Linear(
        K, N, bias=False, config=all_roles_config("rowwise", recompute_weight_cast=False)
    )
    with torch._functorch.config.patch(treat_parameters_as_free_to_save=False):
        graph = backward_inputs(layer, torch.randn(M, K, requires_grad=True))
    assert float8_of(graph, (N, K)) and (torch.float32, (N, K)) not in graph


# ----------------------------------------------------------- activation checkpointing


class Block(torch.nn.Module):
    def __init__(self, config: Float8LinearConfig | None = None) -> None:
        super().__init__()
        self.up = Float8Linear(K, 2 * K, bias=False, config=config)
        self.down = Float8Linear(2 * K, K, bias=False, config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _save_gemm_outputs(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN202
    if func in (torch.ops.aten._scaled_mm.default, torch.ops.aten.mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def with_checkpoint(block: Block, selective: bool):  # noqa: ANN201
    context_fn = (
        functools.partial(create_selective_checkpoint_contexts, _save_gemm_outputs)
        if selective
        else None
    )
    kwargs = {"context_fn": context_fn} if selective else {}
    return lambda x: checkpoint(block, x, use_reentrant=False, **kwargs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("selective", [False, True], ids=["full-ac", "selective-ac"])
def test_activation_checkpointing_gives_the_same_gradients(selective, compiled):
    block = Block()
    x = torch.randn(M, K)
    grads = []
    for fn in (block, with_checkpoint(block, selective)):
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
        block.zero_grad()
        xi = x.clone().requires_grad_()
        fn(xi).square().sum().backward()
        grads.append((xi.grad, block.up.weight.grad.clone(), block.down.weight.grad.clone()))
    for plain, checkpointed in zip(*grads, strict=True):
        assert torch.equal(plain, checkpointed)


@pytest.mark.xfail(
    not TORCH_2_13,
    reason="torch < 2.13 does not tag the ops inside an autograd.Function with the enclosing "
    "checkpoint's policy: the forward gemm output and the float8 inputs are kept",
    strict=True,
)
def test_compiled_full_checkpoint_keeps_only_the_block_input():
    block = Block()
    x = torch.randn(M, K, requires_grad=True)
    graph = backward_inputs(with_checkpoint(block, selective=False), x)
    # The block input and the two weights; the float8 casts are recomputed with the rest.
    assert sorted(graph, key=str) == sorted(
        [(torch.float32, (M, K)), (torch.float32, (2 * K, K)), (torch.float32, (K, 2 * K))],
        key=str,
    )


def test_compiled_selective_checkpoint_keeps_what_its_policy_saves():
    block = Block()
    x = torch.randn(M, K, requires_grad=True)
    graph = backward_inputs(with_checkpoint(block, selective=True), x)
    # The user's policy saves the gemm outputs; no float8 copy of a layer input is forced in.
    assert (torch.float32, (M, 2 * K)) in graph
    assert not any(dtype == E4M3 for dtype, _ in graph)


def test_cast_kernels_for_weights_and_gradients_keep_what_inductors_casts_keep(monkeypatch):
    """Cast kernels are opaque to the partitioner: for the inputs it keeps their float8
    outputs, where it recasts inductor's casts in backward from tensors kept anyway. Limited
    to the weights' and gradients' casts, which backward never keeps from forward, the block
    keeps what it keeps with inductor's casts. Custom ops running the torch path stand in for
    the GPU's triton ops (benchmarks/saved_by_block.py --opaque-casts)."""
    import fp8train.cast
    from benchmarks.saved_by_block import _opaque_cast_ops, describe

    monkeypatch.setattr(fp8train.cast, "_cast_ops", _opaque_cast_ops)
    bf16, x, cos, sin = _small_block()
    kept = {}
    for roles in (False, True, ("weight", "grad_output")):
        config = Float8LinearConfig(compiled_cast_kernels=roles)
        block = convert_to_float8_training(copy.deepcopy(bf16), config=config)
        kept[roles] = describe(saved_by_backward(block, x, cos, sin), block)
    assert kept[True]["float8 MiB"] > 0
    assert kept[("weight", "grad_output")] == kept[False]
    assert kept[False]["float8 MiB"] == 0


def test_inductor_recasts_every_input_of_a_llama_block_in_backward():
    """Under inductor a LLaMA-style block keeps no float8 copy by default: each linear input
    is remade in backward from what the block keeps anyway (the norm's input, attention's
    output, SwiGLU's halves) and recast there, so float8 keeps less than bf16 and nothing that
    bf16 does not keep too (benchmarks/saved_by_block.py; the end-to-end peak analysis)."""
    from benchmarks.saved_by_block import describe

    bf16, x, cos, sin = _small_block()
    fp8 = convert_to_float8_training(copy.deepcopy(bf16))
    kept = {
        name: describe(saved_by_backward(block, x, cos, sin), block)
        for name, block in (("bf16", bf16), ("fp8", fp8))
    }
    assert kept["fp8"]["float8 MiB"] == 0
    assert kept["fp8"]["kept MiB"] < kept["bf16"]["kept MiB"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_frozen_weight_compiles_and_gives_the_eager_input_gradient(recipe):
    """A frozen layer (fine-tuning) keeps nothing of its input for backward: compiled, the
    input's gradient and the bias's are eager's."""
    torch._dynamo.reset()
    layer = Float8Linear.from_float(
        torch.nn.Linear(64, 48), Float8LinearConfig.from_recipe_name(recipe)
    )
    layer.weight.requires_grad_(False)
    compiled_layer = copy.deepcopy(layer)
    compiled = torch.compile(compiled_layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(32, 64, requires_grad=True)
    x_compiled = x.detach().clone().requires_grad_()
    layer(x).pow(2).sum().backward()
    compiled(x_compiled).pow(2).sum().backward()
    torch.testing.assert_close(x_compiled.grad, x.grad)
    torch.testing.assert_close(compiled_layer.bias.grad, layer.bias.grad)
    assert layer.weight.grad is None and compiled_layer.weight.grad is None
