"""Delayed and static scaling: the history, the sync, the first step, non-finite amaxes,
checkpoints, and torch.compile without graph breaks or recompiles."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import fp8train.delayed as delayed_module
from fp8train import (
    CastConfig,
    DelayedScalingConfig,
    Float8Linear,
    Float8LinearConfig,
    compute_error,
    convert_to_float8_training,
    strip_float8_state,
    sync_float8_amax_and_scale_history,
    to_float8,
)
from fp8train.config import E4M3, E5M2
from tests.conftest import DEVICES, FLOAT8_GPU_REASON, Projections

M, K, N = 32, 64, 48
DELAYED = CastConfig(scaling_type="delayed")


def delayed_config(**kwargs) -> Float8LinearConfig:
    return Float8LinearConfig(
        cast_config_input=DELAYED,
        cast_config_weight=DELAYED,
        cast_config_grad_output=DELAYED,
        **kwargs,
    )


def test_without_a_sync_delayed_scaling_trains_as_dynamic_scaling():
    """Until the first sync a delayed cast scales from its own tensor's amax: a loop that
    never syncs gets dynamic scaling's outputs and gradients, bit for bit (docs/scaling.md)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(K, K), nn.ReLU(), nn.Linear(K, N))
    models = [
        convert_to_float8_training(copy.deepcopy(base), config=config)
        for config in (delayed_config(), Float8LinearConfig())
    ]
    for step in range(3):
        x = torch.randn(M, K) * (step + 1)  # a new amax each step
        outputs = [model(x) for model in models]
        for out in outputs:
            out.square().sum().backward()
        assert torch.equal(*outputs)
        for delayed_param, dynamic_param in zip(*(m.parameters() for m in models), strict=True):
            assert torch.equal(delayed_param.grad, dynamic_param.grad)


@pytest.mark.parametrize("sync", [False, True], ids=["never-synced", "synced"])
def test_training_without_a_sync_warns_once(sync, monkeypatch):
    monkeypatch.setattr(delayed_module, "UNSYNCED_CALLS_TO_WARN", 3)
    monkeypatch.setattr(delayed_module, "_WARNED_UNSYNCED", False)
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(K, K), nn.Linear(K, N)), config=delayed_config()
    )
    with torch.no_grad():  # evaluation is not training: never counted
        for _ in range(5):
            model(torch.randn(M, K))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            model(torch.randn(M, K)).sum().backward()
            if sync:
                sync_float8_amax_and_scale_history(model)
    messages = [str(w.message) for w in caught if "without a sync" in str(w.message)]
    if sync:
        assert messages == []
    else:  # once for the process, not once per layer or per call
        assert len(messages) == 1 and "sync_float8_amax_and_scale_history(model)" in messages[0]
        assert caught[0].filename == __file__  # points at the caller of the model


def test_invalid_combinations_are_refused():
    with pytest.raises(ValueError, match="keeps one scale per tensor"):
        CastConfig(scaling_type="delayed", scaling_granularity="rowwise")
    for scale in (None, 0.0, -1.0, float("inf"), 1e-50, 1e300):  # 0 or inf in fp32 too
        with pytest.raises(ValueError, match="needs a finite, positive static_scale within"):
            CastConfig(scaling_type="static", static_scale=scale)
    with pytest.raises(TypeError, match=r"static_scale='2.0': give a number"):
        CastConfig(scaling_type="static", static_scale="2.0")
    with pytest.raises(ValueError, match="set scaling_type='static'"):
        CastConfig(static_scale=2.0)
    with pytest.raises(ValueError, match="give both gemms the same cast"):
        Float8LinearConfig(
            cast_config_input=DELAYED, cast_config_input_for_grad_weight=CastConfig()
        )
    with pytest.raises(ValueError, match="history_len=0"):
        DelayedScalingConfig(history_len=0)
    # Delayed weights all-gather in float8 too (tests/test_fsdp.py); rowwise ones cannot.
    Float8LinearConfig(cast_config_weight=DELAYED, enable_fsdp_float8_all_gather=True)


def test_dynamic_layers_have_no_float8_state():
    assert set(Float8Linear(K, N).state_dict()) == {"weight", "bias"}
    keys = set(Float8Linear(K, N, config=delayed_config()).state_dict())
    assert "fp8_amax_history_grad_output" in keys and "fp8_scale_weight" in keys


def test_first_step_scales_from_the_data_like_dynamic_scaling():
    dynamic = Float8Linear(K, N)
    delayed = Float8Linear.from_float(copy.deepcopy(dynamic), delayed_config())
    x, grad = torch.randn(M, K), torch.randn(M, N)
    results = []
    for layer in (dynamic, delayed):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(grad)
        results.append((out, xi.grad, layer.weight.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_sync_rolls_the_history_and_scales_from_its_max():
    layer = Float8Linear(
        K,
        N,
        bias=False,
        config=delayed_config(delayed_scaling_config=DelayedScalingConfig(history_len=3)),
    )
    amaxes = []
    for magnitude in (1.0, 4.0, 2.0, 0.5):
        x = torch.randn(M, K)
        x[0, 0] = magnitude * 10  # the amax of this step's input
        amaxes.append(x.abs().max())
        layer(x).sum().backward()
        sync_float8_amax_and_scale_history(layer)
        assert layer.fp8_initialized_input
        expected = torch.stack(amaxes[::-1][:3])
        assert torch.equal(layer.fp8_amax_history_input[: len(expected)], expected)
        assert layer.fp8_amax_input == 0  # reset for the next step
        assert torch.equal(layer.fp8_scale_input, 448.0 / expected.max())


def test_a_no_grad_forward_records_its_amaxes_for_the_next_sync():
    """The documented behaviour (docs/scaling.md): evaluation under no_grad records the input's
    and weight's amaxes, as float8_experimental did, and the next sync folds them into the
    history with the training step's; grad_output, which has no backward there, records
    nothing."""
    layer = Float8Linear(K, N, bias=False, config=delayed_config())
    layer(torch.randn(M, K)).sum().backward()
    sync_float8_amax_and_scale_history(layer)
    with torch.no_grad():
        layer(torch.full((M, K), 100.0))
    assert layer.fp8_amax_input == 100.0 and layer.fp8_amax_grad_output == 0
    layer(torch.randn(M, K)).sum().backward()  # a training step with smaller inputs
    sync_float8_amax_and_scale_history(layer)
    assert layer.fp8_amax_history_input[0] == 100.0
    assert torch.equal(layer.fp8_scale_input, 448.0 / torch.tensor(100.0))


def test_most_recent_scale_fn_and_the_scale_reaching_the_cast():
    config = delayed_config(delayed_scaling_config=DelayedScalingConfig(scale_fn="most_recent"))
    layer = Float8Linear(K, N, bias=False, config=config)
    layer(torch.randn(M, K) * 100).sum().backward()
    sync_float8_amax_and_scale_history(layer)
    x = torch.randn(M, K)
    scale = layer.fp8_scale_input.clone()
    with torch.no_grad():
        out = layer(x)
    # The cast used the stored scale (from step 1's amax), not this input's own.
    expected = torch.mm(
        to_float8(x, E4M3)._data.float() * 0
        + (x * scale).clamp(-448, 448).to(E4M3).float() / scale,
        (layer.weight * layer.fp8_scale_weight).clamp(-448, 448).to(E4M3).float().t()
        / layer.fp8_scale_weight,
    )
    assert compute_error(expected, out) > 40
    assert layer.fp8_amax_grad_output == 0 and layer.fp8_amax_history_grad_output[0] > 0
    assert (
        layer.fp8_scale_grad_output == torch.finfo(E5M2).max / layer.fp8_amax_history_grad_output[0]
    )


@pytest.mark.parametrize("miscompiling_toolchain", [False, True])
def test_a_non_finite_weight_amax_is_explained(miscompiling_toolchain, monkeypatch):
    """A weight's amax is non-finite only if the weight is: the warning says a non-finite
    gradient reached the optimizer and, on a GPU whose ptxas miscompiles float8 casts, points
    at fp8train.toolchain_problem()."""
    problem = "ptxas 12.8 miscompiles" if miscompiling_toolchain else None
    monkeypatch.setattr(delayed_module, "toolchain_problem", lambda: problem)
    layer = Float8Linear(K, N, bias=False, config=delayed_config())
    layer(torch.randn(M, K)).sum().backward()
    sync_float8_amax_and_scale_history(layer)
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")  # as an optimizer step with a NaN gradient leaves it
    layer(torch.randn(M, K)).sum().backward()
    with pytest.warns(UserWarning, match="<root>:weight") as caught:
        sync_float8_amax_and_scale_history(layer)
    message = str(caught[0].message)
    assert "a non-finite gradient reached the optimizer" in message
    assert ("fp8train.toolchain_problem()" in message) is miscompiling_toolchain


def test_an_input_amax_alone_gets_no_weight_hint():
    layer = Float8Linear(K, N, bias=False, config=delayed_config())
    layer(torch.randn(M, K)).sum().backward()
    sync_float8_amax_and_scale_history(layer)
    x = torch.randn(M, K)
    x[1, 1] = float("inf")
    layer(x).sum().backward()
    with pytest.warns(UserWarning, match="non-finite amax in <root>:input") as caught:
        sync_float8_amax_and_scale_history(layer)
    assert "optimizer" not in str(caught[0].message)


def test_non_finite_amax_never_enters_the_history():
    layer = Float8Linear(K, N, bias=False, config=delayed_config())
    layer(torch.randn(M, K)).sum().backward()
    sync_float8_amax_and_scale_history(layer)
    history, scale = layer.fp8_amax_history_input.clone(), layer.fp8_scale_input.clone()
    x = torch.randn(M, K)
    x[1, 1] = float("inf")
    loss = layer(x).sum()
    loss.backward()
    assert not torch.isfinite(loss)  # the inf reaches the loss, as in bf16
    with pytest.warns(UserWarning, match="non-finite amax in <root>:input"):
        sync_float8_amax_and_scale_history(layer)
    assert torch.equal(layer.fp8_amax_history_input, history)
    assert torch.equal(layer.fp8_scale_input, scale)
    assert torch.isfinite(layer.fp8_scale_input) and layer.fp8_scale_input > 0


def test_static_scale_is_the_given_one():
    config = Float8LinearConfig(
        cast_config_input=CastConfig(scaling_type="static", static_scale=4.0)
    )
    layer = Float8Linear(K, N, bias=False, config=config)
    x = torch.randn(M, K)
    with torch.no_grad():
        out = layer(x)
    x8 = (x * 4.0).clamp(-448, 448).to(E4M3).float() / 4.0
    w8 = to_float8(layer.weight.detach(), E4M3).to_hp(torch.float32)
    assert compute_error(x8 @ w8.t(), out) > 40


@pytest.mark.parametrize("device", DEVICES)
def test_static_scale_turns_an_inf_into_nan_not_a_saturated_value(device):
    """A static scale never sees the data: the cast itself makes an inf NaN, on the torch path
    and in the eager kernel alike, so that it reaches the loss."""
    config = Float8LinearConfig(
        cast_config_input=CastConfig(scaling_type="static", static_scale=4.0)
    )
    layer = Float8Linear(K, N, bias=False, config=config).to(device)
    x = torch.randn(M, K, device=device)
    x[3, 5] = float("inf")
    with torch.no_grad():
        out = layer(x)
    assert out[3].isnan().all() and torch.isfinite(out[:3]).all()
    # The float8 NaN itself is the positive one (0x7f) on every device, as the kernel's:
    # the torch path makes it as |inf - inf|, and x86 gives inf - inf a negative sign.
    from fp8train.cast import cast_layouts
    from fp8train.config import ScalingGranularity

    scale = torch.tensor(4.0, device=device)
    (cast,) = cast_layouts(x, E4M3, ScalingGranularity.TENSORWISE, (False,), scale=scale)
    assert cast._data.view(torch.uint8)[3, 5].item() == 0x7F


def test_delayed_training_tracks_fp32():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(K, 128), nn.ReLU(), nn.Linear(128, N))
    model = convert_to_float8_training(copy.deepcopy(reference), config=delayed_config())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, model)]
    for _ in range(10):
        x = torch.randn(M, K)
        for module, optimizer in zip((reference, model), optimizers, strict=True):
            module(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        sync_float8_amax_and_scale_history(model)
    x = torch.randn(M, K)
    assert compute_error(reference(x), model(x)) > 20


def test_checkpoints_round_trip_and_load_both_ways():
    model = convert_to_float8_training(nn.Sequential(nn.Linear(K, N)), config=delayed_config())
    model(torch.randn(M, K)).sum().backward()
    sync_float8_amax_and_scale_history(model)
    state = model.state_dict()
    restored = convert_to_float8_training(nn.Sequential(nn.Linear(K, N)), config=delayed_config())
    restored.load_state_dict(state)
    for name, tensor in restored.state_dict().items():
        assert torch.equal(tensor, state[name])
    # The unconverted model's checkpoint loads strictly; the state starts uninitialized.
    plain = nn.Sequential(nn.Linear(K, N))
    fresh = convert_to_float8_training(nn.Sequential(nn.Linear(K, N)), config=delayed_config())
    fresh.load_state_dict(plain.state_dict())
    assert not fresh[0].fp8_initialized_input
    # The other way: PyTorch names the extra keys; strip_float8_state removes them.
    with pytest.raises(RuntimeError, match="fp8_amax_history_input"):
        plain.load_state_dict(state)
    plain.load_state_dict(strip_float8_state(state))
    assert torch.equal(plain[0].weight, model[0].weight)


def train_compiled_and_eager(config: Float8LinearConfig, backend, steps: int):  # noqa: ANN001, ANN201
    """A two-layer delayed model trained `steps` steps compiled and, as a copy, eagerly, with
    a sync after each: (compiled model, eager model, the compile counter)."""
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(K, 128), nn.ReLU(), nn.Linear(128, N)), config=config
    )
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(steps):
        x = torch.randn(M, K)
        for module, target in ((compiled, model), (eager, eager)):
            module(x).square().sum().backward()
            sync_float8_amax_and_scale_history(target)
    return model, eager, counter


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_delayed_scaling_has_one_graph_and_no_recompiles(backend):
    torch._dynamo.reset()
    model, eager, counter = train_compiled_and_eager(delayed_config(), backend, steps=3)
    assert counter.frame_count == 1
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        if name.endswith(("history_input", "scale_input", "initialized_input")):
            assert torch.equal(a, b), name
    assert compute_error(eager[0].weight.grad, model[0].weight.grad) > 40


def _casts_waiting_for_a_reduction(graph: torch.fx.GraphModule) -> tuple[int, int]:
    """(float8 casts in `graph`, how many of them depend on a reduction: an amax taken before
    the cast, which makes it a second pass over the tensor)."""
    reductions = ("amax", "linalg_vector_norm", "aten.max.default")

    def ancestors(node: torch.fx.Node, seen: set) -> set:
        for parent in node.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                ancestors(parent, seen)
        return seen

    def is_float8(node: torch.fx.Node) -> bool:
        value = node.meta.get("val")
        return isinstance(value, torch.Tensor) and value.dtype in (E4M3, E5M2)

    casts = [
        n
        for n in graph.graph.nodes
        if n.op == "call_function" and is_float8(n) and not any(map(is_float8, n.all_input_nodes))
    ]
    waiting = [
        n
        for n in casts
        if any(any(r in str(a.target) for r in reductions) for a in ancestors(n, set()))
    ]
    return len(casts), len(waiting)


@pytest.mark.parametrize("backend", ["capture", "inductor"])
def test_compiled_one_pass_recompiles_once_and_casts_without_waiting_for_the_amax(backend):
    """DelayedScalingConfig(compiled_one_pass=True): step 1 scales from the data (its casts
    wait for their amax); after the first sync the graph recompiles once, and then no float8
    cast depends on a reduction, so inductor is free to take amax and cast in one pass. The
    numerics are those of eager delayed scaling."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs: list) -> object:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    config = delayed_config(delayed_scaling_config=DelayedScalingConfig(compiled_one_pass=True))
    inner = (
        aot_autograd(fw_compiler=capture, bw_compiler=capture) if backend == "capture" else backend
    )
    model, eager, counter = train_compiled_and_eager(config, inner, steps=4)
    assert counter.frame_count == 2  # step 1, then once the scales are ready
    for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        if "fp8_" in name:
            torch.testing.assert_close(a, b, msg=name)
    assert compute_error(eager[0].weight.grad, model[0].weight.grad) > 40
    if backend == "capture":
        (first_fw, first_bw), (ready_fw, ready_bw) = graphs[:2], graphs[2:4]
        # Step 1: every cast waits for its amax (2 layers: input, weight; grad_output).
        assert _casts_waiting_for_a_reduction(first_fw)[1] > 0
        assert _casts_waiting_for_a_reduction(first_bw)[1] > 0
        for graph in (ready_fw, ready_bw):
            casts, waiting = _casts_waiting_for_a_reduction(graph)
            assert casts > 0 and waiting == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_one_pass_turns_an_inf_into_nan(backend, device):
    """Without the amax before the cast, the scale cannot turn NaN: the cast itself makes an
    inf NaN (as the eager kernel does), never a saturated finite value; inductor too, on the
    CPU and in Triton (the cast writes that NaN as |inf - inf|, which it must not simplify
    away)."""
    config = delayed_config(delayed_scaling_config=DelayedScalingConfig(compiled_one_pass=True))
    layer = Float8Linear(K, N, bias=False, config=config).to(device)
    # Two steps: on CUDA the host learns that the scales are an earlier step's one sync late
    # (it does not wait for the GPU), and until then a cast scales from this step's amax.
    for _ in range(2):
        layer(torch.randn(M, K, device=device)).sum().backward()
        sync_float8_amax_and_scale_history(layer)
    assert layer._fp8_ready_roles
    x = torch.randn(M, K, device=device)
    x[3, 5] = float("inf")
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    out = compiled(x)
    assert out[3].isnan().all() and torch.isfinite(out[:3]).all()


def _kernels_reading(code: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """For each named input shape of an inductor output `code`: how many generated kernels
    (C++ or Triton; not extern gemms) are launched with that graph input as an argument."""
    import re

    inputs = {
        name: tuple(map(int, dims.split(",")))
        for name, dims in re.findall(r"assert_size_stride\((\w+), \(([\d, ]+)\)", code)
    }
    kernels = set(re.findall(r"^(\w+) = async_compile\.", code, re.MULTILINE))
    launches = [
        line for line in code.splitlines()
        if (m := re.match(r"\s*(\w+)(?:\.run)?\(", line)) and m.group(1) in kernels
    ]  # fmt: skip
    counts = {}
    for label, shape in shapes.items():
        (name,) = [n for n, s in inputs.items() if s == shape]
        counts[label] = sum(bool(re.search(rf"\b{name}\b", line)) for line in launches)
    return counts


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_one_pass_reads_input_and_weight_once(device):
    """Once the scales are an earlier step's, a compiled one-pass cast and the amax it records
    for the next step are one kernel: the input and the weight are each read by one kernel
    (inductor's, on the CPU and in Triton), not by an amax kernel and a cast kernel."""
    from torch._inductor.utils import run_and_get_code

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = delayed_config(delayed_scaling_config=DelayedScalingConfig(compiled_one_pass=True))
    layer = Float8Linear(256, 512, bias=False, config=config).to(device, dtype)
    for _ in range(2):  # on CUDA the host learns that the scales are ready one sync late
        layer(torch.randn(384, 256, device=device, dtype=dtype)).sum().backward()
        sync_float8_amax_and_scale_history(layer)
    assert layer._fp8_ready_roles
    torch._dynamo.reset()
    with torch.no_grad():
        _, codes = run_and_get_code(
            torch.compile(layer, fullgraph=True),
            torch.randn(384, 256, device=device, dtype=dtype),
        )
    reads = _kernels_reading(codes[-1], {"input": (384, 256), "weight": (512, 256)})
    assert reads == {"input": 1, "weight": 1}, codes[-1]


def test_sync_compiles_fullgraph():
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(K, K), nn.Linear(K, N)), config=delayed_config()
    )
    sync = torch.compile(sync_float8_amax_and_scale_history, fullgraph=True, backend="aot_eager")
    amaxes = []
    for _ in range(3):
        x = torch.randn(M, K)
        amaxes.append(x.abs().max())
        model(x).sum().backward()
        sync(model)
    assert torch.equal(model[0].fp8_amax_history_input[:3], torch.stack(amaxes[::-1]))


def test_sync_launches_as_many_ops_for_many_layers_as_for_two():
    """The sync runs once per step for every delayed layer of a model: its work is a few
    batched ops whatever the number of layers (views aside), not a kernel per layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if not func.is_view:  # views launch nothing
                self.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for layers in (2, 12):
        model = convert_to_float8_training(
            nn.Sequential(*[nn.Linear(K, K) for _ in range(layers)]), config=delayed_config()
        )
        model(torch.randn(M, K)).sum().backward()
        with Ops() as ops:
            sync_float8_amax_and_scale_history(model)
        counts.append(ops.count)
    assert counts[0] == counts[1] and counts[0] < 48, counts


def test_sync_marks_scales_ready_and_a_load_clears_the_mark():
    layer = Float8Linear(K, N, bias=False, config=delayed_config())
    assert layer._fp8_ready_roles == set()
    layer(torch.randn(M, K, requires_grad=True)).sum().backward()
    sync_float8_amax_and_scale_history(layer)
    assert {role.value for role in layer._fp8_ready_roles} == {"input", "weight", "grad_output"}
    layer.load_state_dict(layer.state_dict())
    assert layer._fp8_ready_roles == set()


def test_a_model_dropped_between_syncs_is_freed(monkeypatch):
    """On CUDA a sync leaves its flags to be read at the next one. Under FSDP2 every layer
    reaches the root model through the shared FSDP state; a layer that references its root
    stands in for that here. The pending flags must not keep such a model alive."""
    import gc
    import weakref

    from fp8train import delayed

    deferred = delayed._PendingCheck.__init__

    def as_on_cuda(self, checks):  # noqa: ANN001, ANN202
        deferred(self, checks)
        self.on_cpu = False  # read at the next sync, as the flags of a CUDA model are

    monkeypatch.setattr(delayed._PendingCheck, "__init__", as_on_cuda)

    def train_one_step() -> weakref.ref:
        model = nn.Sequential(nn.Linear(K, N, bias=False))
        convert_to_float8_training(model, config=delayed_config())
        object.__setattr__(model[0], "root", model)  # a cycle through the root, as FSDP2's
        model(torch.randn(M, K)).sum().backward()
        sync_float8_amax_and_scale_history(model)
        assert model in delayed._PENDING  # deferred, as on CUDA
        model(torch.randn(M, K)).sum().backward()
        sync_float8_amax_and_scale_history(model)  # reads the first step's flags
        assert {role.value for role in model[0]._fp8_ready_roles} == {
            "input", "weight", "grad_output"
        }  # fmt: skip
        return weakref.ref(model)

    model = train_one_step()
    gc.collect()
    assert model() is None


@pytest.mark.parametrize("cast", ["to", "bfloat16", "half", "double"])
def test_delayed_state_stays_fp32_when_the_model_changes_dtype(cast):
    """model.to(bf16) and friends convert parameters, not the scaling state: an amax history
    in bf16 would round every amax and scale."""
    model = nn.Sequential(nn.Linear(K, N, bias=False))
    convert_to_float8_training(model, config=delayed_config())
    model[0].fp8_amax_history_input[0] = 1 + 2**-20  # not representable in bf16 or fp16
    model = model.to(torch.bfloat16) if cast == "to" else getattr(model, cast)()
    layer = model[0]
    assert layer.weight.dtype != torch.float32
    for name in ("amax", "amax_history", "scale"):
        for role in ("input", "weight", "grad_output"):
            assert getattr(layer, f"fp8_{name}_{role}").dtype == torch.float32, (name, role)
    assert layer.fp8_initialized_input.dtype == torch.bool
    assert layer.fp8_amax_history_input[0].item() == 1 + 2**-20


@pytest.mark.skipif(FLOAT8_GPU_REASON is not None, reason=str(FLOAT8_GPU_REASON))
def test_a_bf16_delayed_model_trains_on_the_gpu():
    """A model cast with .to("cuda", torch.bfloat16): fp32 state for the kernels' atomics, and
    finite gradients in the first (two-pass) step and the later one-pass steps. (A bf16
    grad_output with a delayed scale once gave NaN grad_inputs.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 256))
    convert_to_float8_training(model, config=delayed_config())
    model = model.to("cuda", torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        loss = model(x).float().square().mean()
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        sync_float8_amax_and_scale_history(model)
        optimizer.step()
        optimizer.zero_grad()
    assert model[0]._fp8_ready_roles and model[0].fp8_amax_grad_output.dtype == torch.float32


@pytest.mark.skipif(FLOAT8_GPU_REASON is not None, reason=str(FLOAT8_GPU_REASON))
def test_one_pass_delayed_cast_equals_the_two_pass_cast_on_the_gpu():
    """From the second step on, the eager CUDA cast records the amax in its own pass: the
    outputs, gradients, amaxes and scales are those of the two-pass path."""
    torch.manual_seed(0)
    one_pass = Float8Linear(256, 512, bias=False, config=delayed_config()).cuda()
    two_pass = copy.deepcopy(one_pass)
    for step in range(3):
        x = torch.randn(128, 256, device="cuda")
        results = []
        for layer in (one_pass, two_pass):
            xi = x.clone().requires_grad_()
            out = layer(xi)
            out.square().sum().backward()
            results.append((out, xi.grad, layer.weight.grad, layer.fp8_amax_grad_output.clone()))
            sync_float8_amax_and_scale_history(layer)
            layer.weight.grad = None
        two_pass._fp8_ready_roles.clear()  # always the two-pass path
        if step:
            assert one_pass._fp8_ready_roles
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
        for name in ("scale_input", "scale_weight", "scale_grad_output", "amax_history_input"):
            assert torch.equal(getattr(one_pass, f"fp8_{name}"), getattr(two_pass, f"fp8_{name}"))


@pytest.mark.skipif(FLOAT8_GPU_REASON is not None, reason=str(FLOAT8_GPU_REASON))
def test_on_the_gpu_a_non_finite_amax_is_reported_at_the_next_sync():
    layer = Float8Linear(64, 32, bias=False, config=delayed_config()).cuda()
    x = torch.randn(16, 64, device="cuda")
    x[0, 0] = float("inf")
    layer(x.requires_grad_()).sum().backward()
    sync_float8_amax_and_scale_history(layer)  # no host read here
    layer(torch.randn(16, 64, device="cuda", requires_grad=True)).sum().backward()
    with pytest.warns(UserWarning, match="non-finite amax in <root>:input in the previous step"):
        sync_float8_amax_and_scale_history(layer)
    assert torch.isfinite(layer.fp8_scale_input) and layer.fp8_scale_input > 0


# ---------------------------------------------------------------- tied input scales


def _train(module: nn.Module, steps: int = 3, fn=None) -> list[torch.Tensor]:  # noqa: ANN001
    """Outputs and gradients of `steps` steps, each followed by the sync."""
    torch.manual_seed(1)
    results = []
    for _ in range(steps):
        x = torch.randn(M, K, requires_grad=True)
        out = (module if fn is None else fn)(x)
        out.square().sum().backward()
        sync_float8_amax_and_scale_history(module)
        results += [out.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
    return results


def test_tied_input_scales_train_exactly_as_separate_ones():
    """Tied, q, k and v scale their input from one state (q's): over steps and syncs every
    output and gradient equals the untied layers', whose histories all hold the same amaxes;
    the tied state is synced once (its history rolled once per step), and the other layers'
    own input buffers stay unused."""
    from fp8train import tie_delayed_input_scales

    torch.manual_seed(0)
    base = Projections(K, N, delayed_config())
    tied, separate = copy.deepcopy(base), copy.deepcopy(base)
    tie_delayed_input_scales([tied.q, tied.k, tied.v])
    for a, b in zip(_train(tied), _train(separate), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(tied.q.fp8_amax_history_input, separate.q.fp8_amax_history_input)
    assert torch.equal(tied.q.fp8_scale_input, separate.v.fp8_scale_input)
    assert (tied.q.fp8_amax_history_input[:3] > 0).all()
    assert tied.q.fp8_amax_history_input[3] == 0  # three steps: rolled three times, not nine
    assert not tied.k.fp8_amax_history_input.any() and not tied.v.fp8_initialized_input


@pytest.mark.parametrize("tie", [False, True], ids=["separate", "tied"])
def test_compiled_tied_layers_keep_one_float8_copy_of_their_input(tie):
    """Compiled, delayed layers that read one input cast it once only when their scales are
    one tensor: untied, backward keeps a float8 copy per layer (their scales are equal, but
    the compiler cannot know); tied, the casts merge and backward keeps one, as with
    dynamic scaling."""
    from fp8train import tie_delayed_input_scales
    from tests.test_compile import backward_inputs

    module = Projections(K, N, delayed_config(recompute_input_cast=False))
    if tie:
        tie_delayed_input_scales([module.q, module.k, module.v])
    _train(module, steps=2)  # the scales are an earlier step's, as in a run
    graph = backward_inputs(module, torch.randn(M, K, requires_grad=True))
    assert [entry for entry in graph if entry[0] == E4M3] == [(E4M3, (M, K))] * (1 if tie else 3)


def test_compiled_tied_layers_train_as_eager():
    from fp8train import tie_delayed_input_scales

    torch.manual_seed(0)
    base = Projections(K, N, delayed_config())
    tie_delayed_input_scales([base.q, base.k, base.v])
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    torch._dynamo.reset()
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for a, b in zip(_train(eager), _train(compiled, fn=fn), strict=True):
        assert torch.equal(a, b)


def test_model_functions_name_what_they_take_when_given_something_else():
    from fp8train import precompute_float8_dynamic_scale_for_fsdp, strip_float8_state

    parts = [nn.Linear(32, 32), nn.Linear(32, 32)]
    for function in (sync_float8_amax_and_scale_history, precompute_float8_dynamic_scale_for_fsdp):
        with pytest.raises(TypeError, match=f"{function.__name__} takes the model .*got a list"):
            function(parts)
    with pytest.raises(TypeError, match=r"takes a state_dict, got a Linear: pass model.state_d"):
        strip_float8_state(parts[0])


def test_tying_refuses_what_it_cannot_tie():
    from fp8train import tie_delayed_input_scales

    delayed = Float8Linear(K, N, config=delayed_config())
    with pytest.raises(ValueError, match="at least two layers"):
        tie_delayed_input_scales([delayed])
    with pytest.raises(TypeError, match="convert the model with convert_to_float8_training"):
        tie_delayed_input_scales([delayed, nn.Linear(K, N)])
    dynamic = Float8Linear(K, N, config=Float8LinearConfig(), fqn="layers.0.wk")
    with pytest.raises(ValueError, match="'layers.0.wk' does not scale its input with delayed"):
        tie_delayed_input_scales([delayed, dynamic])
    history_8 = Float8Linear(
        K, N, config=delayed_config(delayed_scaling_config=DelayedScalingConfig(history_len=8))
    )
    with pytest.raises(ValueError, match="different rules"):
        tie_delayed_input_scales([delayed, history_8])
    with pytest.raises(ValueError, match="in_features=32"):
        tie_delayed_input_scales([delayed, Float8Linear(32, N, config=delayed_config())])


def test_the_bundled_model_ties_its_shared_inputs():
    """wq, wk and wv tie to wq, w3 to w1; wo and w2, which read inputs of their own, stay
    untied; a dynamic model has nothing to tie."""
    from fp8train.models import ModelArgs, Transformer, tie_shared_delayed_inputs

    args = ModelArgs(dim=64, n_layers=2, n_heads=2, ffn_dim=128, vocab_size=64, max_seq_len=16)
    model = convert_to_float8_training(Transformer(args), config=delayed_config())
    tie_shared_delayed_inputs(model)
    for block in model.layers:
        attention, ffn = block.attention, block.feed_forward
        assert attention.wk._fp8_state_sources == {"input": attention.wq}
        assert attention.wv._fp8_state_sources == {"input": attention.wq}
        assert ffn.w3._fp8_state_sources == {"input": ffn.w1}
        for layer in (attention.wq, attention.wo, ffn.w1, ffn.w2):
            assert layer._fp8_state_sources == {}
    dynamic = convert_to_float8_training(Transformer(args))
    tie_shared_delayed_inputs(dynamic)
    assert all(not getattr(m, "_fp8_state_sources", {}) for m in dynamic.modules())


def test_a_layer_tied_again_takes_the_layers_tied_to_it_along():
    """Tying a layer that others are tied to moves them too: all read one state, synced once."""
    from fp8train import tie_delayed_input_scales
    from fp8train.config import Role
    from fp8train.delayed import state_source

    torch.manual_seed(0)
    module = Projections(K, N, delayed_config())
    tie_delayed_input_scales([module.q, module.k])
    tie_delayed_input_scales([module.v, module.q])
    assert {state_source(layer, Role.INPUT) for layer in module.children()} == {module.v}
    _train(module, steps=2)
    assert (module.v.fp8_amax_history_input[:2] > 0).all()
    assert module.v.fp8_amax_history_input[2] == 0  # two steps: rolled twice
    assert not module.q.fp8_amax_history_input.any()


def test_find_shared_inputs_groups_the_layers_that_read_one_tensor_and_leaves_no_trace():
    from fp8train import find_shared_inputs
    from fp8train.models import ModelArgs, Transformer

    args = ModelArgs(dim=64, n_layers=2, n_heads=2, ffn_dim=128, vocab_size=64, max_seq_len=16)
    model = convert_to_float8_training(Transformer(args), config=delayed_config())
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    groups = find_shared_inputs(model, torch.randint(0, 64, (2, 16)))
    assert [[layer.fqn for layer in group] for group in groups] == [
        [f"layers.{i}.{name}" for name in names]
        for i in range(2)
        for names in (("attention.wq", "attention.wk", "attention.wv"),
                      ("feed_forward.w1", "feed_forward.w3"))
    ]  # fmt: skip
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    model.layers[0] = torch.compile(model.layers[0])
    with pytest.raises(ValueError, match="before compiling"):
        find_shared_inputs(model, torch.randint(0, 64, (2, 16)))


def test_activation_checkpointing_records_the_same_history_and_scales():
    """The recomputed forward records its amaxes again: the same maxima, the same state."""
    from torch.utils.checkpoint import checkpoint

    config = delayed_config()
    torch.manual_seed(0)
    plain = convert_to_float8_training(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), config=config
    )
    checkpointed = copy.deepcopy(plain)
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        for model, run in (
            (plain, plain),
            (checkpointed, lambda x: checkpoint(checkpointed, x, use_reentrant=False)),
        ):
            run(x.clone().requires_grad_()).pow(2).mean().backward()
            sync_float8_amax_and_scale_history(model)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= 0.1 * parameter.grad
                    parameter.grad = None
    for key, value in plain.state_dict().items():
        assert torch.equal(checkpointed.state_dict()[key], value), key
