"""fp8train.inductor: the post-grad pass that leaves compiled casts' saturation to Triton.

On the CPU the pass is forced on (`any_device=True`) to check what it rewrites and that it
rewrites nothing else; the bytes it must not change are checked on CUDA, against the same
compiled code without the pass and against eager mode."""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import fp8train.inductor
from fp8train import (
    Float8Linear,
    Float8LinearConfig,
    sync_float8_amax_and_scale_history,
)
from fp8train.cast import _saturated_cast
from fp8train.config import E4M3, E5M2
from fp8train.inductor import (
    SatfinitePass,
    amax_as_integer_max,
    drop_saturation_before_float8,
    install_satfinite_pass,
    uninstall_satfinite_pass,
)
from tests.conftest import FLOAT8_GPU_REASON, all_roles_config, one_pass_delayed_config

CLAMPS = (torch.ops.aten.clamp_min.default, torch.ops.aten.clamp_max.default)


def _clamped_conversions(graph: fx.Graph) -> int:
    """Conversions to float8 of a clamp's output (directly or through a where's branch)."""

    def clamped(node: object) -> bool:
        if not isinstance(node, fx.Node):
            return False
        if node.target is torch.ops.aten.where.self:
            return any(clamped(branch) for branch in node.args[1:])
        return node.target in CLAMPS

    return sum(
        1
        for node in graph.nodes
        if node.target is torch.ops.prims.convert_element_type.default
        and node.args[1] in (E4M3, E5M2)
        and clamped(node.args[0])
    )


class Recorder(CustomGraphPass):
    """Runs the pass on every graph (forced on whatever the device when `force`), recording
    the clamped conversions before and after and what the pass reports it changed."""

    def __init__(self, force: bool = True) -> None:
        self.force = force
        self.before, self.changed, self.after = [], [], []

    def __call__(self, graph: fx.Graph) -> None:
        self.before.append(_clamped_conversions(graph))
        self.changed.append(drop_saturation_before_float8(graph, any_device=self.force))
        self.after.append(_clamped_conversions(graph))

    def uuid(self) -> str:
        return f"test-recorder-{id(self)}"


CONFIGS = [
    pytest.param(Float8LinearConfig, id="tensorwise"),
    pytest.param(lambda: all_roles_config("rowwise"), id="rowwise"),
    pytest.param(one_pass_delayed_config, id="delayed-one-pass"),
]


def _train(layer: Float8Linear, x: torch.Tensor, fn, steps: int) -> list[torch.Tensor]:  # noqa: ANN001
    """`steps` fwd+bwd of `fn` (the layer, compiled or not); the last output and gradients."""
    for _ in range(steps):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.float().square().sum().backward()
        sync_float8_amax_and_scale_history(layer)
    return [out.detach(), xi.grad, layer.weight.grad.clone()]


def _assert_same(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    """Two _compiled_steps results equal bit for bit."""
    names = ("output", "grad_input", "grad_weight")
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        name = names[i] if i < len(names) else f"buffer {i - len(names)}"
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max()}"


def _compiled_steps(
    make_config,
    x: torch.Tensor,
    graph_pass: CustomGraphPass | None,
    steps: int,  # noqa: ANN001
) -> list[torch.Tensor]:
    """`steps` of a fresh seeded Float8Linear (x's device and dtype) compiled with
    `graph_pass` as inductor's post-grad pass: the last output, gradients and buffers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    k = x.shape[-1]
    layer = Float8Linear(k, k // 2, config=make_config()).to(x.device, x.dtype)
    with inductor_config.patch(post_grad_custom_post_pass=graph_pass, fx_graph_cache=False):
        out = _train(layer, x, torch.compile(layer, fullgraph=True), steps=steps)
    return out + [buffer.clone() for buffer in layer.buffers()]


@pytest.mark.parametrize("make_config", CONFIGS)
def test_pass_drops_the_clamp_in_front_of_every_cast(make_config):
    """Forward and backward: each cast's conversion loses its clamp, and nothing else
    does. Delayed scaling's casts (a where that turns an inf into NaN, around the clamp) too."""
    torch._dynamo.reset()
    layer = Float8Linear(64, 48, config=make_config())
    x = torch.randn(32, 64)
    recorder = Recorder()
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
        _train(layer, x, torch.compile(layer, fullgraph=True), steps=2)
    assert len(recorder.before) >= 2, "no forward and backward graph reached the pass"
    assert all(n > 0 for n in recorder.before), recorder.before
    assert recorder.changed == recorder.before
    assert recorder.after == [0] * len(recorder.after)


def test_pass_changes_no_number_of_dynamic_casts_on_the_cpu():
    """Dynamic scales keep every scaled value within float8's range (up to rounding, which the
    CPU's conversion rounds back in), so here even the CPU's code must give the same numbers
    without the clamp: the rewrite changed the conversion's input and nothing else."""
    x = torch.randn(32, 64)
    results = []
    for force in (False, True):
        recorder = Recorder(force)
        results.append(_compiled_steps(Float8LinearConfig, x, recorder, steps=1))
        assert (sum(recorder.changed) > 0) == force
    _assert_same(*results)


def _inf_to_nan_selects(graph: fx.Graph) -> int:
    return sum(1 for node in graph.nodes if node.target is torch.ops.aten.isinf.default)


def test_pass_turns_delayed_scalings_inf_to_nan_select_into_an_add():
    """Delayed casts turn an inf into NaN with `where(isinf(hp), |w - w|, w * scale)`; the
    pass writes it `w * scale + w * 0` (no compare, no select), in forward and backward."""
    counts = []

    class Counting(Recorder):
        def __call__(self, graph: fx.Graph) -> None:
            before = _inf_to_nan_selects(graph)
            super().__call__(graph)
            counts.append((before, _inf_to_nan_selects(graph)))

    torch._dynamo.reset()
    layer = Float8Linear(64, 48, config=one_pass_delayed_config())
    with inductor_config.patch(post_grad_custom_post_pass=Counting(), fx_graph_cache=False):
        _train(layer, torch.randn(32, 64), torch.compile(layer, fullgraph=True), steps=1)
    assert len(counts) >= 2 and all(before > 0 for before, _ in counts), counts
    assert all(after == 0 for _, after in counts), counts


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delayed_casts_inf_to_nan_as_an_add_keeps_every_value(dtype, hp_dtype):
    """The add gives the select's values, on the CPU too for values within the range (no
    saturation needed): NaN for an inf and for NaN, and the same bytes for the rest, the
    sign of -0.0 and of values that underflow to zero included."""
    values = [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1.0, -3.5, 0.3, 200.0, -300.0]
    values += [float("inf"), float("-inf"), float("nan")]
    hp = torch.tensor(values, dtype=hp_dtype).reshape(-1, 1).repeat(1, 8)

    def cast(hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return _saturated_cast(hp, scale, dtype, nonfinite_to_nan=True)

    torch._dynamo.reset()
    recorder = Recorder()
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
        compiled = torch.compile(cast, fullgraph=True)
        for scale in (1.0, 0.5):
            got = compiled(hp, torch.tensor(scale))
            want = cast(hp, torch.tensor(scale))
            nan = want.float().isnan()
            assert torch.equal(got.float().isnan(), nan), scale
            assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), scale
    assert recorder.changed == [1]


def test_pass_leaves_casts_that_are_not_fp8trains_alone():
    """The same clamp and conversion written outside fp8train (by another float8 library,
    say) stays as it is."""

    def cast(x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0).clamp(-448.0, 448.0).to(E4M3)

    torch._dynamo.reset()
    recorder = Recorder()
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
        torch.compile(cast, fullgraph=True)(torch.randn(16, 16))
    assert recorder.before == [1]
    assert recorder.changed == [0]


def test_pass_needs_a_device_whose_conversion_saturates():
    """Not forced, the pass leaves CPU code alone: the CPU's conversion turns an overflow into
    NaN."""
    torch._dynamo.reset()
    layer = Float8Linear(64, 48, config=Float8LinearConfig())
    recorder = Recorder(force=False)
    with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
        _train(layer, torch.randn(32, 64), torch.compile(layer, fullgraph=True), steps=1)
    assert all(n > 0 for n in recorder.before)
    assert recorder.changed == [0] * len(recorder.changed)


def _one_cast_graph(low: float, high: float, dtype: torch.dtype) -> fx.Graph:
    """clamp_min, clamp_max and a conversion, with an fp8train stack trace and fp32 values."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    low_node = graph.call_function(torch.ops.aten.clamp_min.default, (x, low))
    high_node = graph.call_function(torch.ops.aten.clamp_max.default, (low_node, high))
    out = graph.call_function(torch.ops.prims.convert_element_type.default, (high_node, dtype))
    graph.output(out)
    for node in (x, low_node, high_node):
        node.meta["val"] = torch.empty(4)
        node.meta["stack_trace"] = f'File "{fp8train.inductor._PACKAGE}/cast.py", line 1'
    return graph


@pytest.mark.parametrize(
    ("low", "high", "dtype", "rewritten"),
    [
        (-448.0, 448.0, E4M3, True),
        (-57344.0, 57344.0, E5M2, True),
        (-400.0, 400.0, E4M3, False),  # narrower than the type: the clamp changes values
        (-448.0, 448.0, E5M2, False),  # e4m3's range in front of an e5m2 conversion
        (0.0, 448.0, E4M3, False),
    ],
)
def test_pass_drops_only_a_clamp_to_the_float8_types_own_range(low, high, dtype, rewritten):
    graph = _one_cast_graph(low, high, dtype)
    assert drop_saturation_before_float8(graph, any_device=True) == int(rewritten)
    assert _clamped_conversions(graph) == int(not rewritten)
    graph.lint()


class _Other(CustomGraphPass):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1

    def uuid(self) -> str:
        return "someone-elses-pass"


def test_install_runs_ours_after_an_installed_pass_once_and_uninstall_restores_it(monkeypatch):
    """Both ways an inductor takes passes: a sequence (ours appended), or one pass (ours
    wraps the one installed and runs it first)."""
    for takes_a_sequence in (True, False):
        monkeypatch.setattr(fp8train.inductor, "_TAKES_A_SEQUENCE", takes_a_sequence)
        other = _Other()
        with inductor_config.patch(post_grad_custom_post_pass=other):
            install_satfinite_pass()
            installed = inductor_config.post_grad_custom_post_pass
            install_satfinite_pass()
            assert inductor_config.post_grad_custom_post_pass is installed
            if takes_a_sequence:
                assert installed[0] is other and isinstance(installed[1], SatfinitePass)
            else:
                assert isinstance(installed, SatfinitePass) and installed.then is other
                assert "someone-elses-pass" in installed.uuid()
                installed(fx.Graph())
                assert other.calls == 1
            uninstall_satfinite_pass()
            restored = inductor_config.post_grad_custom_post_pass
            assert restored == ([other] if takes_a_sequence else other)


def test_install_warns_and_keeps_a_plain_function_it_cannot_run_before_its_own(monkeypatch):
    monkeypatch.setattr(fp8train.inductor, "_TAKES_A_SEQUENCE", False)

    def plain(graph: fx.Graph) -> None:
        pass

    with inductor_config.patch(post_grad_custom_post_pass=plain):
        with pytest.warns(UserWarning, match="not a CustomGraphPass"):
            install_satfinite_pass()
        assert inductor_config.post_grad_custom_post_pass is plain


def test_a_layer_installs_the_pass_unless_its_config_says_not_to():
    off = Float8LinearConfig(compiled_satfinite=False, compiled_integer_amax=False)
    with inductor_config.patch(post_grad_custom_post_pass=None):
        Float8Linear(32, 32, config=off)
        assert inductor_config.post_grad_custom_post_pass is None
        Float8Linear(32, 32)
        installed = inductor_config.post_grad_custom_post_pass
        assert isinstance(installed, SatfinitePass)
        assert installed.satfinite and installed.integer_amax  # the defaults


needs_float8_gpu = pytest.mark.skipif(FLOAT8_GPU_REASON is not None, reason=str(FLOAT8_GPU_REASON))

SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1.0, -3.5, 447.0, 448.0, 449.0, 464.0, 500.0, -1e6]
SPECIAL += [57344.0, 61440.0, -7e4, 3e38, float("inf"), float("-inf"), float("nan")]


@needs_float8_gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("nonfinite_to_nan", [False, True], ids=["saturate", "inf-to-nan"])
def test_compiled_casts_keep_their_bytes_without_the_clamp_on_cuda(
    dtype, nonfinite_to_nan, monkeypatch
):
    """Values in, beyond and at the edge of both types' ranges, infs, NaN and zeros of both
    signs, each scaled by 1 and by 2**10: Triton's saturating conversion gives the bytes that
    the clamp gave (the same compiled code without the pass) and eager mode's values."""
    changed = []
    original = fp8train.inductor.drop_saturation_before_float8

    def recording(graph, **kwargs):  # noqa: ANN001, ANN202
        changed.append(original(graph, **kwargs))
        return changed[-1]

    monkeypatch.setattr(fp8train.inductor, "drop_saturation_before_float8", recording)
    hp = torch.tensor(SPECIAL, device="cuda")
    hp = torch.cat([hp, -hp, torch.randn(4096, device="cuda") * 1e3]).reshape(-1, 1).repeat(1, 16)

    def cast(hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return _saturated_cast(hp, scale, dtype, nonfinite_to_nan=nonfinite_to_nan)

    results = {}
    for name, installed in (("clamp", False), ("satfinite", True)):
        torch._dynamo.reset()
        pass_ = SatfinitePass() if installed else None
        with inductor_config.patch(post_grad_custom_post_pass=pass_, fx_graph_cache=False):
            compiled = torch.compile(cast, fullgraph=True)
            results[name] = [compiled(hp, torch.tensor(s, device="cuda")) for s in (1.0, 1024.0)]
    assert changed == [1], changed  # one graph (the scale is a tensor), one conversion
    scales = (1.0, 1024.0)
    for scale, clamp, satfinite in zip(scales, results["clamp"], results["satfinite"], strict=True):
        eager = cast(hp, torch.tensor(scale, device="cuda"))
        assert torch.equal(clamp.view(torch.uint8), satfinite.view(torch.uint8)), scale
        nan = eager.float().isnan()
        assert torch.equal(satfinite.float().isnan(), nan), scale
        assert torch.equal(satfinite.float()[~nan], eager.float()[~nan]), scale


@needs_float8_gpu
@pytest.mark.parametrize("make_config", CONFIGS)
def test_compiled_layers_give_the_same_numbers_with_the_pass_on_cuda(make_config):
    """A compiled Float8Linear (bf16) trains bit for bit as it does with the clamp."""
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for pass_ in (None, Recorder(force=False)):
        results.append(_compiled_steps(make_config, x, pass_, steps=3))
        if pass_ is not None:
            assert sum(pass_.changed) > 0 and sum(pass_.after) == 0
    _assert_same(*results)


def test_a_forced_pass_stays_when_layers_install_theirs():
    """A pass forced on for every device (as for instruction counts on a CPU) stays forced
    when float8 layers built later install the pass of their own."""
    with inductor_config.patch(post_grad_custom_post_pass=None):
        install_satfinite_pass(any_device=True)
        Float8Linear(32, 32)
        assert inductor_config.post_grad_custom_post_pass.any_device


class AmaxRecorder(CustomGraphPass):
    """Rewrites each graph's amaxes as integer maxima (any device: the rewrite is exact on
    every backend), recording how many changed."""

    def __init__(self) -> None:
        self.changed = []

    def __call__(self, graph: fx.Graph) -> None:
        self.changed.append(amax_as_integer_max(graph))

    def uuid(self) -> str:
        return f"test-amax-recorder-{id(self)}"


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=needs_float8_gpu)], ids=["cpu", "cuda"]
)
@pytest.mark.parametrize("make_config", CONFIGS)
def test_integer_amax_gives_the_same_numbers_and_scales(make_config, device):
    """A compiled Float8Linear with its amaxes taken as integer maxima trains as it does
    with inductor's float maxima: same output, gradients and delayed-scaling state (bf16 on
    CUDA, bit for bit)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(256 if device == "cuda" else 32, 64, device=device, dtype=dtype)
    results = []
    for rewrite in (False, True):
        recorder = AmaxRecorder() if rewrite else None
        results.append(_compiled_steps(make_config, x, recorder, steps=3))
        if rewrite:
            assert sum(recorder.changed) > 0
    _assert_same(*results)


def test_integer_amax_propagates_nan_and_inf_like_the_float_maximum():
    """The amax of a cast on inputs with inf, NaN, -0.0 and subnormals, bf16 and fp32, whole
    and by rows: the integer maximum gives what eager mode gives (NaN where it gives NaN)."""
    from fp8train.config import ScalingGranularity
    from fp8train.scaling import amax as cast_amax

    def amaxes(hp: torch.Tensor) -> list[torch.Tensor]:
        return [
            cast_amax(hp, ScalingGranularity.TENSORWISE, None),
            cast_amax(hp, ScalingGranularity.ROWWISE, -1),
        ]

    special = [0.0, -0.0, 1e-40, -3.0, 2.5, -7e37, float("inf"), float("-inf"), float("nan")]
    rows = [[v, 1.0, -2.0, 0.5] for v in special] + [[-0.0, -1e-40, 0.0, -5.0]]
    for dtype in (torch.float32, torch.bfloat16):
        for hp in (torch.tensor(rows, dtype=dtype), torch.tensor(rows[:6], dtype=dtype)):
            torch._dynamo.reset()
            recorder = AmaxRecorder()
            with inductor_config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
                compiled = torch.compile(amaxes, fullgraph=True)(hp)
            assert sum(recorder.changed) == 2, recorder.changed
            for got, want in zip(compiled, amaxes(hp), strict=True):
                assert torch.equal(got.isnan(), want.isnan()), (dtype, hp)
                assert torch.equal(got[~got.isnan()], want[~want.isnan()]), (dtype, hp)


def test_integer_amax_works_without_the_satfinite_part():
    """compiled_integer_amax alone installs a pass that rewrites the amaxes and keeps every
    clamp (even forced on any device)."""
    with inductor_config.patch(post_grad_custom_post_pass=None):
        Float8Linear(32, 32, config=Float8LinearConfig(compiled_satfinite=False))
        installed = inductor_config.post_grad_custom_post_pass
        assert installed.integer_amax and not installed.satfinite
    graph = _one_cast_graph(-448.0, 448.0, E4M3)
    SatfinitePass(any_device=True, integer_amax=True, satfinite=False)(graph)
    assert _clamped_conversions(graph) == 1


def test_a_layer_asking_for_more_upgrades_the_installed_pass():
    """Layers only add to the process-wide pass: what one asks for stays for all."""
    with inductor_config.patch(post_grad_custom_post_pass=None):
        Float8Linear(32, 32, config=Float8LinearConfig(compiled_integer_amax=False))
        assert not inductor_config.post_grad_custom_post_pass.integer_amax
        Float8Linear(32, 32, config=Float8LinearConfig(compiled_satfinite=False))
        installed = inductor_config.post_grad_custom_post_pass
        assert installed.integer_amax and installed.satfinite
        Float8Linear(32, 32, config=Float8LinearConfig(compiled_integer_amax=False))
        assert inductor_config.post_grad_custom_post_pass is installed


def test_benchmarks_set_the_pass_exactly_as_each_config_asks():
    """benchmarks.utils.inductor_pass_as replaces what earlier runs installed, where layers
    only add to it."""
    from benchmarks.utils import inductor_pass_as

    with inductor_config.patch(post_grad_custom_post_pass=None):
        inductor_pass_as(Float8LinearConfig())
        installed = inductor_config.post_grad_custom_post_pass
        assert installed.integer_amax and installed.satfinite
        inductor_pass_as(Float8LinearConfig(compiled_integer_amax=False))
        installed = inductor_config.post_grad_custom_post_pass
        assert isinstance(installed, SatfinitePass) and not installed.integer_amax
        inductor_pass_as(Float8LinearConfig(compiled_satfinite=False))
        installed = inductor_config.post_grad_custom_post_pass
        assert installed.integer_amax and not installed.satfinite
        inductor_pass_as(Float8LinearConfig(compiled_satfinite=False, compiled_integer_amax=False))
        assert inductor_config.post_grad_custom_post_pass is None


def test_benchmarks_pass_variants_set_the_configs_options():
    from benchmarks.utils import with_pass_variant

    base = Float8LinearConfig()
    options = {
        variant: (config.compiled_satfinite, config.compiled_integer_amax)
        for variant in ("satfinite", "integer-amax", "float-amax", "clamp")
        for config in [with_pass_variant(base, variant)]
    }
    assert options == {
        "satfinite": (True, True),
        "integer-amax": (True, True),
        "float-amax": (True, False),
        "clamp": (False, False),
    }
    with pytest.raises(ValueError, match="unknown pass variant 'fast'"):
        with_pass_variant(base, "fast")


LAYOUTS_SHAPE = (8192, 14336)
"""SwiGLU's hidden activations in the end-to-end model (8192 tokens, FFN 14336)."""


@needs_float8_gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "mode", ["eager-kernel", "compiled", "compiled-given-scale", "compiled-tuned"]
)
def test_both_layouts_of_a_cast_hold_the_same_bytes_run_after_run_on_cuda(dtype, mode):
    """A cast that writes both float8 layouts in one kernel (fp8train's eager cast kernel;
    inductor's kernel fusing the cast with its producer, here SwiGLU's backward product, with
    a dynamic or a given scale, with inductor's default or tuned block sizes) must store the
    same bytes in each, every run. triton-lang/triton#11111 reports that ptxas 12.x on Hopper
    can write foreign bytes into the transposed copy of a value a kernel also stores
    contiguously, and a hand-written kernel of that shape showed it here
    (benchmarks/bench_swiglu_backward.py)."""
    from torch.nn import functional as F

    from fp8train.cast import cast_layouts
    from fp8train.config import ScalingGranularity

    torch.manual_seed(0)
    gate, grad = (torch.randn(LAYOUTS_SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    given = mode == "compiled-given-scale"
    amax = torch.zeros((), device="cuda")

    def cast(gate: torch.Tensor, grad: torch.Tensor) -> list:
        return cast_layouts(
            grad * F.silu(gate), dtype, ScalingGranularity.TENSORWISE, (False, True),
            scale=torch.full((), 64.0, device="cuda") if given else None,
            record_amax=amax if given else None,
        )  # fmt: skip

    torch._dynamo.reset()
    options = {"fx_graph_cache": False, "coordinate_descent_tuning": mode == "compiled-tuned"}
    with inductor_config.patch(options):
        run = cast if mode == "eager-kernel" else torch.compile(cast, fullgraph=True)
        for attempt in range(8):
            row, col = run(gate, grad)
            assert col._data.t().is_contiguous() and row._data.is_contiguous()
            differ = int((col._data.view(torch.uint8) != row._data.view(torch.uint8)).sum())
            assert differ == 0, f"run {attempt}: {differ} bytes of the column-major copy differ"
