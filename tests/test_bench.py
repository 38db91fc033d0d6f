"""The benchmark commands' plumbing (the measurements themselves run on a GPU)."""

import contextlib
import re
from pathlib import Path

import pytest
import torch

from benchmarks.bench_memory import with_ratios
from fp8train.__main__ import main


def test_results_name_the_command_as_typed_from_the_repository_root(tmp_path):
    from benchmarks.utils import command_line

    argv = [str(tmp_path / "examples" / "train_llama.py"), "--json", "/elsewhere/out/e2e.json"]
    argv += ["--csv", str(tmp_path / "results" / "x.csv"), "--steps", "3"]
    words = command_line(argv, root=tmp_path).split()
    assert words[1:] == [
        "-m", "examples.train_llama", "--json", "e2e.json", "--csv", "results/x.csv",
        "--steps", "3",
    ]  # fmt: skip


def test_memory_table_shows_ratios_to_bf16():
    rows = [{"case": "c", "mode": "eager", "bf16": 2.0, "fp8 default": 1.5}]
    assert with_ratios(rows) == [
        {"case": "c", "mode": "eager", "bf16": "2.00", "fp8 default": "1.50 (0.75x)"}
    ]


def test_recompute_savings_against_the_float8_weights_bytes():
    from benchmarks.bench_memory import float8_weight_bytes, recompute_savings
    from fp8train import convert_to_float8_training

    model = convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64))
    )
    assert float8_weight_bytes(model) == 2 * 64 * 32
    held = {"fp8 default": 1.0, "fp8 keep-weight": 1.15}
    assert recompute_savings(held, 0.156) == "0.150 GiB of 0.156 (96%)"


def test_bench_memory_float8_swiglu_config_converts_the_linears_and_the_swiglus():
    from benchmarks.bench_memory import convert
    from fp8train import Float8Linear
    from fp8train.models import FeedForward, ModelArgs, Transformer

    for name, swiglu, exact in (
        ("fp8 default", False, False),
        ("fp8 float8-swiglu", True, False),
        ("fp8 float8-swiglu-exact", True, True),
    ):
        model = convert(Transformer(ModelArgs(n_layers=2)), name)
        ffns = [m for m in model.modules() if isinstance(m, FeedForward)]
        assert len(ffns) == 2 and all(ffn.float8_swiglu is swiglu for ffn in ffns)
        assert all(ffn.float8_swiglu_exact_forward is exact for ffn in ffns)
        assert isinstance(ffns[0].w2, Float8Linear)
        assert type(model.lm_head) is torch.nn.Linear


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the command runs the benchmark")
def test_bench_memory_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="run it on a GPU, or pass --device cpu"):
        main(["bench-memory", "--cases", "linear-4096"])


def test_bench_memory_runs_the_cases_scaled_down_on_the_cpu(capsys):
    configs = ["fp8 default", "fp8 keep-weight"]
    main(["bench-memory", "--device", "cpu", "--cases", "linear-4096", "--modes", "eager",
          "--configs", *configs, "--explain"])  # fmt: skip
    out = capsys.readouterr().out
    assert "every size of each case divided by 8" in out
    assert "Peak memory of one forward + backward, MiB" in out
    # What forward keeps is the save policy's, to the byte: ten float8 inputs of 512 x 512
    # (the benchmark's own output left out) against ten bf16 ones, and ten float8 weights more.
    assert "| linear-4096 | eager | 4.50 | 2.50 (0.56x) | 5.00 (1.11x) |" in out
    assert "saves 2.500 MiB of 2.500 (100%)" in out
    assert "##### peak linear-4096 eager fp8 default" in out and "aten::_scaled_mm" in out


def test_cpu_step_memory_replays_the_allocators_events():
    from benchmarks.memory_trace import BACKWARD_MARK, cpu_step_memory

    kept = []

    def step() -> None:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        kept.append(torch.empty(500, dtype=torch.uint8))
        del a, b
        with torch.profiler.record_function(BACKWARD_MARK):
            c = torch.empty(2000, dtype=torch.uint8)
            del c

    memory = cpu_step_memory(step)
    assert memory.peak == 4500  # a, b and the kept block at once
    assert memory.held == 500  # live when backward began
    assert sorted(size for size, _, _ in memory.at_peak) == [500, 1000, 3000]
    assert {phase for _, phase, _ in memory.at_peak} == {"forward"}


def test_cpu_step_memory_leaves_out_the_cpu_float8_gemms_scratch():
    from benchmarks.memory_trace import cpu_step_memory

    a = torch.randn(256, 128).to(torch.float8_e4m3fn)
    b = torch.randn(64, 128).to(torch.float8_e4m3fn).t()
    one = torch.ones(())
    out_bytes = 256 * 64 * 2
    # The CPU gemm makes fp32 copies of a, b and its output (about 270 KiB here), freed
    # before it returns; a GPU gemm makes none.
    memory = cpu_step_memory(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    assert memory.peak == out_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the command runs the benchmark")
def test_bench_cast_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="run it on a GPU"):
        main(["bench-cast", "--shape", "64", "64"])


def test_fastest_tile_skips_tiles_that_failed_the_byte_check():
    from benchmarks.bench_cast import fastest_tile

    rows = [
        {"tile": ("cast", (32, 128, 4)), "time_us": 10.0, "bitwise_ok": True},
        {"tile": ("cast", (64, 128, 4)), "time_us": 8.0, "bitwise_ok": True},
        {"tile": ("cast", (64, 128, 4)), "time_us": 3.0, "bitwise_ok": True},
        {"tile": ("cast", (128, 64, 4)), "time_us": 5.0, "bitwise_ok": False},
        {"tile": ("amax", (64, 128, 4, 8)), "time_us": 3.0, "bitwise_ok": True},
        {"tile": ("amax", (32, 256, 4, 8)), "time_us": 4.0, "bitwise_ok": True},
        {"tile": None, "time_us": 1.0, "bitwise_ok": True},  # a row of no single kernel
    ]
    assert fastest_tile(rows, "cast") == ((32, 128, 4), 10e-6)
    assert fastest_tile(rows, "amax") == ((64, 128, 4, 8), 3e-6)


def test_bench_linear_runs_a_tiny_shape_on_the_cpu(capsys):
    main(["bench-linear", "--device", "cpu", "--shape", "32", "32", "32", "--compile", "off"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| name"))
    assert "fp8_speedup" in header and "ref_time_sec" in header
    assert "geometric mean fp8_speedup over 1 rows" in out


def test_bench_linear_times_the_general_path_beside_the_eager_fast_path(capsys, monkeypatch):
    """Eager rows on the fast path's devices (here the CPU, switched on for the test) time
    the layer held to the general path too; compiled rows and other recipes do not."""
    import fp8train.eager

    monkeypatch.setattr(fp8train.eager, "EAGER_DEVICES", frozenset({"cpu"}))
    argv = ["bench-linear", "--device", "cpu", "--shape", "32", "32", "32", "--compile", "both"]
    main([*argv, "--recipes", "tensorwise", "rowwise"])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| name")).split(" | ")
    rows = [line.split(" | ") for line in lines if line.startswith("| custom0")]
    gain = header.index("fast_path_gain")
    timed = {(row[3], row[6]): row[gain].strip(" |") for row in rows}
    assert timed[("False", "tensorwise")] and float(timed[("False", "tensorwise")]) > 0
    assert not timed[("True", "tensorwise")] and not timed[("False", "rowwise")]
    # eager rows there carry the host time the auto filter models (CostModel.measure_host)
    host = header.index("fp8_host_time_sec")
    measured = {(row[3], row[6]): row[host].strip(" |") for row in rows}
    assert (
        float(measured[("False", "tensorwise")]) > 0 and float(measured[("False", "rowwise")]) > 0
    )
    assert not measured[("True", "tensorwise")]


def test_bench_linear_times_every_recipe(capsys):
    from fp8train import Float8LinearRecipeName

    argv = ["bench-linear", "--device", "cpu", "--shape", "128", "128", "128", "--compile", "off"]
    main([*argv, "--recipes", "all"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| custom0")]
    assert len(rows) == len(Float8LinearRecipeName)
    for recipe in Float8LinearRecipeName:
        assert any(f"| {recipe.value} |" in row for row in rows), recipe


def test_bench_linear_times_fast_backward_accumulation_for_fp8train_and_torchao_alike(
    capsys, monkeypatch
):
    from benchmarks import bench_linear

    made = []
    real = bench_linear.with_fast_backward
    monkeypatch.setattr(
        bench_linear, "with_fast_backward", lambda *a: made.append(real(*a)) or made[-1]
    )
    argv = ["bench-linear", "--device", "cpu", "--shape", "32", "32", "32", "--compile", "off"]
    main([*argv, "--backward-accum", "exact", "fast"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| custom0")]
    assert [row.split(" | ")[6] for row in rows] == ["tensorwise", "tensorwise+fast-accum"]
    # Only the fast row changes configs: fp8train's, and torchao.float8's where importable.
    assert len(made) == (2 if bench_linear.torchao_float8 is not None else 1)
    for config in made:
        assert config.gemm_config_output.use_fast_accum
        assert config.gemm_config_grad_input.use_fast_accum
        assert config.gemm_config_grad_weight.use_fast_accum
    assert isinstance(made[0], bench_linear.Float8LinearConfig)


def test_bench_linear_times_compiled_cast_kernels_for_weight_and_grad_output(capsys):
    """A compiled row with the cast kernels for the weight and grad_output only (on the CPU
    the kernels' ops trace into the torch path)."""
    argv = ["bench-linear", "--device", "cpu", "--shape", "32", "32", "32", "--compile", "on"]
    main([*argv, "--compiled-casts", "kernels-no-input"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| custom0")]
    assert [row.split(" | ")[6] for row in rows] == ["tensorwise+cast-kernels-no-input"]


def test_bench_linear_times_each_compile_mode_asked_for(capsys):
    """One compiled row per --compile-mode, after the eager row (on the CPU reduce-overhead
    compiles without CUDA graphs, as torch.compile does there)."""
    argv = ["bench-linear", "--device", "cpu", "--shape", "32", "32", "32", "--compile", "both"]
    main([*argv, "--compile-mode", "default", "reduce-overhead"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| custom0")]
    assert [row.split(" | ")[3:5] for row in rows] == [
        ["False", "None"],
        ["True", "default"],
        ["True", "reduce-overhead"],
    ]


def _record_on_each_call(monkeypatch, module, name: str, probe) -> list:  # noqa: ANN001
    """Wrap module.name so that each call first appends probe() (a setting in force at the
    call) to the returned list."""
    seen = []
    function = getattr(module, name)

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(probe())
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return seen


def test_bench_linear_holds_inductor_options_for_its_rows_and_restores_them(capsys, monkeypatch):
    from torch._inductor import config

    from benchmarks import bench_linear

    seen = _record_on_each_call(
        monkeypatch, bench_linear, "bench_shape", lambda: config.coordinate_descent_tuning
    )
    argv = ["bench-linear", "--device", "cpu", "--shape", "32", "32", "32", "--compile", "both"]
    main([*argv, "--inductor", "coordinate_descent_tuning=True"])
    assert seen == [True, True]
    assert not config.coordinate_descent_tuning
    assert "options: {'coordinate_descent_tuning': True}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="takes a bool"):
        main([*argv, "--inductor", "coordinate_descent_tuning=1"])


def test_bench_linear_times_a_models_layers_with_the_auto_filters_choice(capsys, monkeypatch):
    from benchmarks import bench_linear
    from fp8train import auto_filter
    from fp8train.models import ModelArgs

    tiny = ModelArgs(dim=64, n_layers=1, n_heads=4, ffn_dim=176)
    monkeypatch.setattr(bench_linear, "MODELS", {"tiny": (tiny, 64)})
    rows = []
    monkeypatch.setattr(bench_linear, "write_csv", lambda found, path: rows.extend(found))
    main(["bench-linear", "--device", "cpu", "--model", "tiny", "--compile", "off", "--csv", "x"])
    assert [(r["name"], r["shape"]) for r in rows] == [
        ("wq/wk/wv/wo", "(64, 64, 64)"),
        ("w1/w3", "(64, 64, 176)"),
        ("w2", "(64, 176, 64)"),
        ("lm_head", "(64, 64, 256)"),
    ]
    for row in rows:
        # The filter's own choice for this layer, and the speedup that choice gives.
        k, n = (int(v) for v in row["shape"].strip("()").split(", ")[1:])
        converts = auto_filter(64, compiled=False)(torch.nn.Linear(k, n, device="meta"), "")
        assert row["auto_filter"] is converts
        assert row["auto_filter_speedup"] == (row["fp8_speedup"] if converts else 1.0)
        device = row["fp8_device_speedup"] if converts else 1.0
        assert row["auto_filter_device_speedup"] == device and row["fp8_device_speedup"] > 0
    out = capsys.readouterr().out
    assert "with auto_filter: " in out and "slowest by auto_filter_device_speedup" in out


def test_device_time_counts_the_operators_not_the_python_around_them():
    import time

    from benchmarks.utils import device_time_s

    a = torch.randn(64, 64)
    busy = device_time_s(lambda: a @ a, "cpu")
    idle = device_time_s(lambda: (a @ a, time.sleep(0.1)), "cpu")
    # The sleep is host time: it is in neither figure. (A bound far above a 64x64 matmul's
    # time and far below the sleep's, so that a loaded machine does not fail it.)
    assert 0 < busy < 0.05 and 0 < idle < 0.05


def test_bench_matmul_runs_a_tiny_shape_on_the_cpu(capsys, monkeypatch):
    from benchmarks import bench_matmul

    monkeypatch.setattr(
        "sys.argv", ["bench_matmul", "--device", "cpu", "--shape", "32", "32", "32"]
    )
    bench_matmul.main()
    out = capsys.readouterr().out
    assert "fp8_tflops" in out and "fast_accum_speedup" in out
    assert "with fast accumulation in all three gemms" in out


def test_csv_holds_the_columns_of_every_row(tmp_path):
    """Rows differ: torchao's columns exist only beside the recipes torchao has."""
    import csv

    from benchmarks.utils import write_csv

    rows = [{"recipe": "blockwise", "fp8_speedup": 1.3}, {"recipe": "rowwise", "vs_torchao": 1.1}]
    write_csv(rows, tmp_path / "rows.csv")
    with open(tmp_path / "rows.csv") as handle:
        read = list(csv.DictReader(handle))
    assert [row["recipe"] for row in read] == ["blockwise", "rowwise"]
    assert read[0]["vs_torchao"] == "" and read[1]["vs_torchao"] == "1.1"


def test_bench_matmul_times_blockwise_only_where_the_block_scaled_gemm_runs():
    """No blockwise column from emulated gemms (here: the CPU) or shapes not in whole blocks."""
    from benchmarks.bench_matmul import blockwise_gemms

    x, w, g = torch.randn(256, 256), torch.randn(128, 256), torch.randn(256, 128)
    assert blockwise_gemms(x, w, g) is None
    assert blockwise_gemms(torch.randn(100, 256), w, torch.randn(100, 128)) is None


def test_profile_host_prints_both_step_times_and_a_profile(capsys):
    from benchmarks.profile_host import main as profile_host

    profile_host(["--device", "cpu", "--dtype", "float32", "--shape", "16", "16", "16"]
                 + ["--steps", "2", "--top", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert "float32:" in out and "float8:" in out and "us per fwd+bwd" in out
    assert "float32 autograd.Function:" in out and "function calls" in out
    assert "float8 (general path):" in out


def test_profile_hosts_general_path_row_keeps_the_layer_off_the_eager_fast_path(monkeypatch):
    import fp8train.eager
    from benchmarks.profile_host import general_path
    from fp8train import Float8Linear

    monkeypatch.setattr(fp8train.eager, "EAGER_DEVICES", frozenset({"cpu"}))
    casts = []
    original = fp8train.eager._cast
    monkeypatch.setattr(
        fp8train.eager, "_cast", lambda *a, **k: casts.append(1) or original(*a, **k)
    )
    layer = Float8Linear(16, 16, bias=False)
    x = torch.randn(16, 16, requires_grad=True)
    general = general_path(layer)
    general(x).sum().backward()
    assert not casts and general.weight is layer.weight
    layer(x).sum().backward()
    assert casts  # the layer itself still takes it


def test_profile_hosts_python_function_layer_is_nn_linear_without_bias():
    from benchmarks.profile_host import PythonFunctionLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    grads = []
    for layer in (linear, PythonFunctionLinear(linear)):
        x.grad = linear.weight.grad = None
        out = layer(x)
        (out * torch.arange(8.0)).sum().backward()
        grads.append((out.detach(), x.grad, linear.weight.grad))
    for expected, actual in zip(*grads, strict=True):
        torch.testing.assert_close(actual, expected)


def test_profile_host_times_compiled_layers(capsys):
    from benchmarks.profile_host import main as profile_host

    profile_host(["--device", "cpu", "--dtype", "float32", "--shape", "16", "16", "16"]
                 + ["--steps", "2", "--top", "500", "--compile"]
                 + ["--compiled-cast-kernels", "weight", "grad_output"])  # fmt: skip
    out = capsys.readouterr().out
    assert "float32:" in out and "float8:" in out and "eval_frame.py" in out
    # Compiled, a step runs generated code: of fp8train's Python only the frame of
    # Float8Linear.forward, which the compiled code replaces, shows in the profile.
    ours = [line for line in out.splitlines() if "fp8train/" in line]
    assert ours and all(re.search(r"fp8train/linear\.py:\d+\(forward\)$", x) for x in ours), ours


def test_peak_report_names_the_phase_and_the_line_of_an_allocation():
    from benchmarks.memory_trace import _phase, _site

    def frame(name: str, filename: str, line: int = 1) -> dict:
        return {"name": name, "filename": filename, "line": line}

    assert _phase([frame("step", "/x/torch/optim/adamw.py")]) == "optimizer"
    assert _phase([frame("clip_grad_norm_", "/x/torch/nn/utils/clip_grad.py")]) == "clip"
    assert _phase([frame("call", "/tmp/c1.py"), frame("backward", "/x/function.py")]) == "backward"
    assert _phase([frame("_engine_run_backward", "/x/torch/autograd/graph.py")]) == "backward"
    assert _phase([frame("call", "/tmp/c1.py"), frame("forward", "/x/models.py")]) == "forward"
    # The innermost Python frame, with its line of code.
    first_line = Path(__file__).read_text().splitlines()[0]
    site = _site([frame("x", "<C++>"), frame("test", __file__, 1)])
    assert site == f"test_bench.py:1 test: {first_line}"
    assert _site([frame("x", "<C++>")]) == "(no Python frame)"


def test_peak_report_finds_what_is_live_at_the_peak():
    from benchmarks.memory_trace import live_at_peak

    def event(action: str, addr: int, size: int) -> dict:
        return {"action": action, "addr": addr, "size": size}

    trace = [
        event("alloc", 1, 10), event("alloc", 2, 30), event("free_requested", 1, 10),
        event("free_completed", 1, 10), event("alloc", 3, 5), event("free_requested", 2, 30),
        event("free_requested", 9, 99),  # allocated before the recording: not counted
    ]  # fmt: skip
    live, best = live_at_peak(trace)
    assert best == 40 and sorted(e["addr"] for e in live) == [1, 2]
    assert live_at_peak([]) == ([], 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU: the full-size model's CUDA peak")
def test_profile_steps_peak_compares_the_configs_on_the_cpu(capsys, monkeypatch):
    from benchmarks.profile_steps import peak_part

    monkeypatch.setenv("LAYERS", "1")
    monkeypatch.setenv("CONFIGS", "bf16,tensorwise")
    peak_part()
    out = capsys.readouterr().out
    assert "##### peak tensorwise (CPU)" in out and "forward left" in out
    assert "Peak of a training step on the CPU (sizes / 8), against bf16:" in out
    assert "- bf16: " in out and "1.000x" in out


def test_profile_steps_tells_the_kernels_of_a_training_step_apart():
    """The time part's kinds, on kernel names as CUDA and inductor give them on Hopper."""
    from benchmarks.profile_steps import kernel_kind

    names = {
        "sm90_xmma_gemm_e4m3e4m3_bf16_f32_tn_n_tilesize128x128x128": "float8 gemm",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN": "gemm",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd>": "attention",
        "triton_red_fused__to_copy_abs_amax_0": "inductor reduction",
        "triton_per_fused_add_mean_mul_pow_rsqrt_1": "inductor reduction",
        "triton_poi_fused__to_copy_clamp_mul_2": "inductor pointwise",
        "_cast_kernel": "fp8train cast kernels",
        "_transpose_kernel": "fp8train cast kernels",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>":
            "optimizer and grad clip",
        "void at::native::elementwise_kernel<128, 2>": "other",
    }  # fmt: skip
    assert {name: kernel_kind(name) for name in names} == names


def test_profile_steps_counts_each_kernel_once():
    """The host's events repeat their kernels' time (an op, or inductor's launch named as its
    kernel), and so do the device's user annotations (optimizer.step's range): only the CUDA
    kernels count, and aten::_scaled_mm gives the float8 gemms' total."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.profile_steps import time_by_kind

    def event(key, device, self_us, total_us=0.0, count=2, annotation=False):  # noqa: ANN001, ANN202
        return SimpleNamespace(
            key=key, device_type=device, self_device_time_total=self_us,
            device_time_total=total_us, count=count, is_user_annotation=annotation,
        )  # fmt: skip

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        event("aten::_scaled_mm", cpu, 0.0, total_us=6000.0),
        event("nvjet_sm90_qqtst_128x256_128x4_2x1_v_bz_coopA_TNN", cuda, 6000.0),
        event("triton_poi_fused__to_copy_clamp_mul_0", cpu, 800.0),  # the launch, again
        event("triton_poi_fused__to_copy_clamp_mul_0", cuda, 800.0),
        event("triton_red_fused_linalg_vector_norm_1", cuda, 400.0, count=4),
        # optimizer.step()'s record_function range, on the device: its kernels' time again
        event("Optimizer.step#AdamW.step", cuda, 2000.0, annotation=True),
        event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", cuda, 2000.0),
    ]
    row: dict[str, float] = {}
    kernels = time_by_kind(events, 2, row)
    assert row == {
        "aten::_scaled_mm (all its kernels)": 3.0,
        "gemm": 3.0,
        "inductor pointwise": 0.4,
        "inductor reduction": 0.2,
        "optimizer and grad clip": 1.0,
        "all kernels": 4.6,
    }
    assert [(k[1], k[2]) for k in sorted(kernels, reverse=True)] == [
        (1, "gemm"),
        (1, "optimizer and grad clip"),
        (1, "inductor pointwise"),
        (2, "inductor reduction"),
    ]


def test_profile_steps_compares_each_config_with_the_first():
    """The time table's last rows: each config's speed against the first (its wall time over
    theirs) and its cast time (inductor's kernels and fp8train's cast kernels beyond the
    first config's)."""
    from benchmarks.profile_steps import against_first

    table = {
        "bf16": {"wall": 140.0, "inductor pointwise": 5.0, "inductor reduction": 3.0},
        "tensorwise": {"wall": 100.0, "inductor pointwise": 12.0, "inductor reduction": 9.0},
        "cast-kernels": {"wall": 112.0, "inductor pointwise": 6.0, "fp8train cast kernels": 7.5},
    }
    assert against_first(table) == {
        "wall: speed vs bf16": ["1.000x", "1.400x", "1.250x"],
        "casts: inductor and cast kernels beyond bf16": ["0.00", "13.00", "5.50"],
    }


def test_offline_kernel_check_without_triton_says_what_to_install(monkeypatch):
    """Where Triton is missing (the CPU wheels of torch), the offline kernel check stops with
    the install command instead of an ImportError from deep inside."""
    import builtins

    from benchmarks.check_kernels_offline import main

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if name == "triton" or name.startswith("triton."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    with pytest.raises(SystemExit, match="pip install triton"):
        main()


GENERATED_REDUCTION = """
@triton_heuristics.reduction(
    size_hints={'x': 2048, 'r0_': 2048},
)
@triton.jit
def Placeholder.KERNEL_NAME(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 2048
    r0_numel = 1792
"""


def test_kernel_instructions_reads_a_generated_kernels_kind_and_size():
    from benchmarks.kernel_instructions import _kind, _numel

    assert _kind(GENERATED_REDUCTION) == "reduction"
    assert _numel(GENERATED_REDUCTION) == 2048 * 1792
    tiled = "@triton_heuristics.pointwise(\n    ynumel = 64\n    xnumel = 32\n  YBLOCK"
    assert _kind(tiled) == "tiled pointwise" and _numel(tiled) == 64 * 32


def test_kernel_instructions_counts_the_ptx_of_a_blocks_backward(capsys):
    # Needs Triton beside the CPU build of torch; CI installs none, so this runs where it is.
    pytest.importorskip("triton")
    import argparse

    from benchmarks.kernel_instructions import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--dim", "64", "--ffn-dim", "192", "--tokens", "64", "--configs",
                              "bf16", "tensorwise"])  # fmt: skip
    tables = main(args)
    # SwiGLU's backward: one kernel with exp in bf16; float8 adds its casts' kernels.
    assert any(row["exp"] for row in tables["bf16"])
    assert all(row["per element"] > 0 for rows in tables.values() for row in rows)
    total = {name: sum(r["M instructions"] for r in rows) for name, rows in tables.items()}
    assert total["tensorwise"] > total["bf16"]
    assert "##### tensorwise: backward's kernels" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_swiglu_backward_says_it_needs_a_gpu():
    import argparse

    from benchmarks import bench_swiglu_backward

    parser = argparse.ArgumentParser()
    bench_swiglu_backward.add_arguments(parser)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_swiglu_backward.main(parser.parse_args([]))


# SASS as cuobjdump prints it (encodings left out), from ptxas 12.8's sm_90 code of a Triton
# kernel that stores a float8 pair row-major whole and column-major byte by byte.
STALE_SASS = """
        /*00c0*/                   LOP3.LUT R10, R10, 0xffff, RZ, 0xc0, !PT ;
        /*02e0*/                   SHF.R.U32.HI R18, RZ, 0x8, R10 ;
        /*0380*/                   F2FP.SATFINITE.E5M2.F32.PACK_AB_MERGE_C R21, R7, R14, RZ ;
        /*03b0*/                   F2FP.SATFINITE.E5M2.F32.PACK_AB_MERGE_C R19, R6, R15, R21 ;
        /*03e0*/                   PRMT R10, R19, 0x7610, R10 ;
        /*0410*/                   STS.U8 [R11+UR4], R10 ;
        /*0460*/                   STS.U8 [R7+UR4+0x100], R18 ;
"""
# The same bytes split correctly: the shift reads the pair after it is in place, or shifts
# the register in place.
FRESH_SASS = """
        /*0c60*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R43, R43, R40, RZ ;
        /*0c90*/                   LOP3.LUT R6, R43, 0xffff, RZ, 0xc0, !PT ;
        /*0ce0*/                   SHF.R.U32.HI R6, RZ, 0x8, R6 ;
        /*0e00*/                   PRMT R6, R6, 0x7610, R6 ;
        /*1c90*/                   PRMT R4, R34, 0x7610, R4 ;
        /*1cc0*/                   STS.U8 [R7+UR5], R4 ;
        /*1ce0*/                   SHF.R.U32.HI R39, RZ, 0x8, R4.reuse ;
        /*1cf0*/                   STS.U8 [R10+UR5+0x80], R39 ;
"""


def test_sass_scan_flags_a_shift_that_reads_a_register_before_its_pair_is_merged_in():
    from benchmarks.sass_hazards import stale_byte_reads

    assert stale_byte_reads(STALE_SASS) == [(0x2E0, 0x3E0, "R10")]
    assert stale_byte_reads(FRESH_SASS) == []
    # A write of the register between the shift and the merge: the merge fills a new value.
    rewritten = STALE_SASS.replace(
        "/*0380*/", "/*0370*/                   MOV R10, R21 ;\n        /*0380*/"
    )
    assert stale_byte_reads(rewritten) == []
    # A branch ends the straight line the scan follows.
    branched = STALE_SASS.replace("/*03b0*/", "/*03a0*/   @!P0 BRA 0x310 ;\n        /*03b0*/")
    assert stale_byte_reads(branched) == []


def test_sass_scan_flags_a_stale_copy_of_the_low_half_shifted_later():
    """The second form (ptxas 12.8, rows kernel at 1024 x 8 warps): the low half is copied
    before the new pair is merged in, and the copy is shifted."""
    from benchmarks.sass_hazards import stale_byte_reads

    sass = """
        /*0ee0*/              @!P0 STG.E desc[UR8][R4.64], R53 ;
        /*0f10*/                   LOP3.LUT R6, R29, 0xffff, RZ, 0xc0, !PT ;
        /*0f30*/                   LOP3.LUT R7, R56, 0xffff, RZ, 0xc0, !PT ;
        /*0f40*/                   PRMT R29, R53.reuse, 0x7610, R29 ;
        /*0f50*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0f60*/                   SHF.R.U32.HI R51, RZ, 0x8, R6 ;
        /*0f70*/                   PRMT R56, R53, 0x7632, R56 ;
        /*0f80*/                   SHF.R.U32.HI R7, RZ, 0x8, R7 ;
        /*0f90*/                   STS.U8 [R16+UR5], R29 ;
        /*0fa0*/                   STS.U8 [R26+UR5+0x100], R51 ;
"""
    assert stale_byte_reads(sass) == [(0xF10, 0xF40, "R29")]
    # A copy that is never shifted is no byte extraction.
    assert stale_byte_reads(sass.replace("SHF.R.U32.HI R51, RZ, 0x8, R6", "MOV R51, R6")) == []
    # A copy of a pair just converted into the register reads that pair (CUDA 13.0's code):
    # the register may then take the next one.
    fresh = sass.replace(
        "/*0f10*/", "/*0f00*/   F2FP.SATFINITE.E5M2.F32.PACK_AB_MERGE_C R29, R1, R2, RZ ;\n/*0f10*/"
    )
    assert stale_byte_reads(fresh) == []


def test_check_layouts_counts_elements_whose_bits_differ():
    from benchmarks.check_layouts import differing

    a = torch.tensor([1.0, -0.0, float("nan"), 3.0], dtype=torch.bfloat16)
    b = a.clone()
    assert differing(a, b) == 0  # NaN equals itself bit for bit
    b[1] = 0.0  # -0.0 and 0.0 compare equal as numbers, not as bits
    b[3] = torch.nextafter(b[3:4], torch.tensor([4.0], dtype=torch.bfloat16))[0]
    assert differing(a, b) == 2
    assert differing(a.float(), b.float()) == 2


def test_check_layouts_compares_digests_of_another_run():
    from benchmarks.check_layouts import compare_digests, digest

    a = torch.arange(6, dtype=torch.float32)
    ours = {"tensorwise/transpose/0/output": digest(a), "tensorwise/transpose/0/w1 grad": "x"}
    theirs = {
        "tensorwise/transpose/0/output": digest(a.clone()),
        "tensorwise/transpose/0/w1 grad": "y",
    }
    assert "| tensorwise, transpose | 1 of 2 |" in compare_digests(ours, theirs)
    assert digest(a) != digest(a.to(torch.bfloat16))
    assert compare_digests(ours, {}) == "no tensor in common with the other run"


def test_result_headers_name_the_ptxas_after_its_adoption(monkeypatch):
    """The run's first Float8Linear points Triton at torch's ptxas; the header, printed before
    any layer exists, must name that ptxas, not the one Triton had at the start."""
    from types import SimpleNamespace

    import benchmarks.utils as utils

    adopted = []
    monkeypatch.setattr(utils.torch.cuda, "is_available", lambda: True)
    props = SimpleNamespace(name="GPU", major=9, minor=0, total_memory=80 * 2**30)
    monkeypatch.setattr(utils.torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(utils, "adopt_torch_ptxas", lambda: adopted.append(True))
    monkeypatch.setattr(
        utils,
        "ptxas_in_use",
        lambda: "13.0 (torch/bin/ptxas)" if adopted else "12.8 (Triton's own)",
    )
    assert utils.environment()["ptxas"] == "13.0 (torch/bin/ptxas)"


@pytest.mark.parametrize("command", ["bench-memory", "train-llama", "scorecard"])
def test_checkout_commands_outside_a_checkout_say_where_they_live(command, monkeypatch, capsys):
    import fp8train.__main__ as cli

    monkeypatch.setattr(cli, "_from_checkout", lambda name: None)
    with pytest.raises(SystemExit, match="run this from the root of a checkout"):
        cli.main([command])
    # With options, which only the checkout's module knows: the same message, not argparse's.
    with pytest.raises(SystemExit, match="run this from the root of a checkout"):
        cli.main([command, "--device", "cpu", "--steps", "3"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert "run this from the root of a checkout" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("argv", "imported"),
    [
        (["demo", "--help"], []),
        (["--help"], []),
        (["bench-linear", "--device", "cpu"], ["benchmarks.bench_linear"]),
        (["train-llama"], ["examples.train_llama"]),
    ],
)
def test_the_cli_imports_the_module_of_the_command_given_only(argv, imported, monkeypatch):
    """A command's run imports no other command's module (they import matplotlib, and
    torchao where it is installed, which warns on a machine without CUDA)."""
    import fp8train.__main__ as cli

    seen = []
    monkeypatch.setattr(cli, "_from_checkout", lambda name: seen.append(name))
    monkeypatch.setattr(cli, "run_demo", lambda args: None)
    with contextlib.suppress(SystemExit):  # --help, or the stand-in's missing module
        cli.main(argv)
    assert seen == imported


def test_bench_linear_runs_backward_on_the_thread_asked_for_and_restores_it(capsys, monkeypatch):
    """--autograd-threads off holds torch's multithreaded backward off for every row, and
    on afterwards (torch's default)."""
    from benchmarks import bench_linear

    seen = _record_on_each_call(
        monkeypatch, bench_linear, "bench_shape", torch._C._is_multithreading_enabled
    )
    argv = ["bench-linear", "--device", "cpu", "--shape", "32", "32", "32", "--compile", "off"]
    main([*argv, "--autograd-threads", "off"])
    main(argv)
    assert seen == [False, True]
    assert torch._C._is_multithreading_enabled()
    assert "autograd multithreading (backward on the engine's device thread): off" in (
        capsys.readouterr().out
    )


def test_profile_host_times_each_autograd_thread_setting_and_restores_the_default(
    capsys, monkeypatch
):
    from benchmarks import profile_host

    seen = _record_on_each_call(
        monkeypatch, profile_host, "host_us_per_step", torch._C._is_multithreading_enabled
    )
    argv = ["--device", "cpu", "--dtype", "float32", "--shape", "16", "16", "16", "--steps", "2"]
    profile_host.main([*argv, "--top", "3", "--autograd-threads", "off", "on"])
    assert seen == [False] * 4 + [True] * 4  # four layers per setting (eager)
    assert torch._C._is_multithreading_enabled()
    out = capsys.readouterr().out
    assert out.index("autograd threads off:") < out.index("autograd threads on:")
    assert "steps under cProfile, autograd threads off:" in out


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("coordinate_descent_tuning", "give KEY=VALUE"),
        ("triton.tile_reduction=True", "no such option; give its dotted name"),
        ("coordinate_descent_tuning=1", "takes a bool"),
        ("triton.tile_reductions=yes", "takes a bool"),
    ],
)
def test_inductor_options_refuse_what_inductor_would_not_take(pair, message):
    from benchmarks.utils import inductor_options

    with pytest.raises(SystemExit, match=message):
        inductor_options([pair])


def test_inductor_option_values_are_python_literals():
    from benchmarks.utils import inductor_options

    assert inductor_options(["triton.max_tiles=2", "coordinate_descent_tuning=False"]) == {
        "triton.max_tiles": 2,
        "coordinate_descent_tuning": False,
    }
    assert inductor_options(None) == {}
