"""examples/train_llama.py end to end on the CPU, at toy size: every run trains, the table and
the plot are written, gradient accumulation and activation checkpointing run; and its reports
(examples/e2e_report.py) over several seeds."""

import argparse
import copy
import dataclasses
import importlib.util
import json

import pytest
import torch

from examples import e2e_report, llama_configs, train_llama


def run(tmp_path, *argv: str) -> list[dict]:  # noqa: ANN001
    parser = argparse.ArgumentParser()
    train_llama.add_arguments(parser)
    args = parser.parse_args(
        ["--device", "cpu", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--ffn-dim",
         "176", "--seq-len", "64", "--batch-size", "4", "--steps", "8", "--eval-batches", "2",
         "--quiet", "--json", str(tmp_path / "runs.json"), *argv]
    )  # fmt: skip
    return train_llama.main(args)


def test_training_runs_compare_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "loss.png"
    configs = [
        "bf16",
        "tensorwise",
        "tensorwise-transpose",
        "tensorwise-delayed",
        "tensorwise-delayed-one-pass",
        "tensorwise-delayed-tied",
        "tensorwise-delayed-one-pass-tied-transpose",
        "tensorwise-cast-kernels",
        "tensorwise-cast-kernels-no-input",
        "tensorwise-keep-hp-input",
        "tensorwise-float8-swiglu",
        "tensorwise-float8-swiglu-exact",
        "tensorwise-delayed-one-pass-tied-float8-swiglu-exact",
    ]
    rows = run(tmp_path, "--configs", *configs, "--plot", str(plot))
    assert [r["config"] for r in rows] == configs
    for row in rows:
        assert len(row["losses"]) == 8 and all(0 < loss < 10 for loss in row["losses"])
        # float8 and fp32 start from the same weights and batches: the same first loss
        assert row["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.02)
    # Tied input scales change no number (eager mode shares the input's cast either way).
    by_name = {row["config"]: row for row in rows}
    assert by_name["tensorwise-delayed-tied"]["losses"] == by_name["tensorwise-delayed"]["losses"]
    # So do the transpose kernels, which only compiled code uses.
    transposed = by_name["tensorwise-delayed-one-pass-tied-transpose"]["losses"]
    assert transposed == by_name["tensorwise-delayed-one-pass"]["losses"]
    assert by_name["tensorwise-transpose"]["losses"] == by_name["tensorwise"]["losses"]
    assert plot.stat().st_size > 0
    assert json.loads((tmp_path / "runs.json").read_text())["runs"][1]["config"] == "tensorwise"
    table = capsys.readouterr().out
    assert "| fp32 |" in table and "val vs fp32 %" in table


def test_a_float8_swiglu_suffix_adds_float8_swiglu_to_the_config_before_it():
    from fp8train.config import ScalingType
    from fp8train.models import FeedForward, ModelArgs, Transformer

    def converted(name: str) -> Transformer:
        return llama_configs.convert(Transformer(ModelArgs(dim=64, n_layers=1, ffn_dim=176)), name)

    model = converted("tensorwise-delayed-one-pass-tied-float8-swiglu-exact")
    ffn = next(m for m in model.modules() if isinstance(m, FeedForward))
    assert ffn.float8_swiglu and ffn.float8_swiglu_exact_forward
    config = ffn.w1.config
    assert config.cast_config_input.scaling_type is ScalingType.DELAYED
    assert config.delayed_scaling_config.compiled_one_pass
    plain = next(m for m in converted("tensorwise").modules() if isinstance(m, FeedForward))
    assert not plain.float8_swiglu
    rounded = next(
        m for m in converted("tensorwise-float8-swiglu").modules() if isinstance(m, FeedForward)
    )
    assert rounded.float8_swiglu and not rounded.float8_swiglu_exact_forward
    assert rounded.w1.config.cast_config_input.scaling_type is ScalingType.DYNAMIC


def test_a_fast_accum_suffix_turns_on_fast_accumulation_in_the_backward_gemms_only():
    from fp8train import Float8Linear
    from fp8train.config import ScalingType
    from fp8train.models import FeedForward, ModelArgs, Transformer

    def linear_config(name: str):  # noqa: ANN202
        model = llama_configs.convert(Transformer(ModelArgs(dim=64, n_layers=1, ffn_dim=176)), name)
        return next(m for m in model.modules() if isinstance(m, Float8Linear)).config

    fast = linear_config("tensorwise-delayed-one-pass-tied-fast-accum")
    assert fast.gemm_config_output.use_fast_accum
    assert fast.gemm_config_grad_input.use_fast_accum
    assert fast.gemm_config_grad_weight.use_fast_accum
    # Everything else is the config before the suffix.
    base = linear_config("tensorwise-delayed-one-pass-tied")
    assert fast.cast_config_input.scaling_type is ScalingType.DELAYED
    assert (
        dataclasses.replace(
            fast,
            gemm_config_grad_input=base.gemm_config_grad_input,
            gemm_config_grad_weight=base.gemm_config_grad_weight,
        )
        == base
    )
    plain = linear_config("tensorwise")
    assert plain.gemm_config_output.use_fast_accum
    assert not plain.gemm_config_grad_input.use_fast_accum
    assert not plain.gemm_config_grad_weight.use_fast_accum
    assert linear_config("tensorwise-fast-accum").gemm_config_grad_weight.use_fast_accum
    both = "tensorwise-delayed-one-pass-tied-float8-swiglu-exact-fast-accum"
    assert both in llama_configs.CONFIGS
    assert linear_config(both) == fast
    model = llama_configs.convert(Transformer(ModelArgs(dim=64, n_layers=1, ffn_dim=176)), both)
    ffn = next(m for m in model.modules() if isinstance(m, FeedForward))
    assert ffn.float8_swiglu and ffn.float8_swiglu_exact_forward


def test_torchao_with_a_fast_accum_suffix_gets_fast_accumulation_alike():
    torchao_float8 = pytest.importorskip("torchao.float8")
    from fp8train.models import ModelArgs, Transformer

    def linear_config(name: str):  # noqa: ANN202
        model = llama_configs.convert(Transformer(ModelArgs(dim=64, n_layers=1, ffn_dim=176)), name)
        kind = torchao_float8.float8_linear.Float8Linear
        return next(m for m in model.modules() if isinstance(m, kind)).config

    fast = linear_config("torchao-tensorwise-fast-accum")
    assert fast.gemm_config_grad_input.use_fast_accum
    assert fast.gemm_config_grad_weight.use_fast_accum
    assert not linear_config("torchao-tensorwise").gemm_config_grad_weight.use_fast_accum


def test_several_seeds_compare_each_run_with_the_baseline_of_its_seed(tmp_path, capsys):
    from examples.e2e_report import summarize

    rows = run(tmp_path, "--configs", "bf16", "tensorwise", "--seeds", "0", "1")
    assert [(r["config"], r["seed"]) for r in rows] == [
        ("bf16", 0), ("tensorwise", 0), ("bf16", 1), ("tensorwise", 1),
    ]  # fmt: skip
    # Different seeds: different weights and batches, so different first losses.
    assert rows[0]["losses"][0] != rows[2]["losses"][0]
    assert "over 2 seeds (0, 1)" in capsys.readouterr().out
    (base, fp8) = summarize(rows, "fp32")
    per_seed = [100 * (rows[i + 1]["val_loss"] / rows[i]["val_loss"] - 1) for i in (0, 2)]
    assert fp8["val vs fp32 % mean"] == pytest.approx(sum(per_seed) / 2)
    assert fp8["val vs fp32 % range"] == f"{min(per_seed):+.2f} to {max(per_seed):+.2f}"
    # Two seeds: the standard error of the mean is half their distance.
    assert fp8["val vs fp32 % sem"] == pytest.approx(abs(per_seed[0] - per_seed[1]) / 2)
    assert base["val vs fp32 % mean"] == 0 and fp8["seeds"] == 2


def test_grad_accumulation_and_checkpointing(tmp_path):
    rows = run(tmp_path, "--configs", "bf16", "rowwise", "--grad-accum", "2", "--ac")
    assert rows[1]["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.02)


def test_the_gpu_preset_trains_on_the_larger_corpus_and_says_how_much_of_it(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    train_llama.add_arguments(parser)
    gpu = train_llama.resolve(parser.parse_args(["--preset", "h200", "--device", "cpu"]))
    assert gpu.corpus == "stdlib"
    assert train_llama.resolve(parser.parse_args(["--device", "cpu"])).corpus == "docs"
    run(tmp_path, "--configs", "bf16", "--steps", "2", "--corpus", "stdlib")
    out = capsys.readouterr().out
    # 2 steps x 4 sequences x 64 tokens over the stdlib corpus's training tokens.
    assert "corpus stdlib: " in out and "(0.00 passes over them)" in out


def _run_record(path, dtype: str, runs: list[tuple[str, int, float]], **args) -> str:  # noqa: ANN001, ANN003
    """A --json file holding runs of (config, seed, val loss), with `args` among its args."""
    rows = [
        {"config": config, "seed": seed, "losses": [2.0], "final_train_loss": 2.0,
         "val_loss": val, "step_ms": 10.0, "tokens_per_s": 100.0, "peak_memory_gib": None}
        for config, seed, val in runs
    ]  # fmt: skip
    record = {"args": {"dtype": dtype, **args}, "environment": {}, "runs": rows}
    path.write_text(json.dumps(record))
    return str(path)


def test_runs_of_several_json_files_are_summarized_over_all_their_seeds(tmp_path, capsys):
    first = _run_record(
        tmp_path / "a.json", "bfloat16",
        [("bf16", 0, 2.0), ("tensorwise", 0, 2.02), ("bf16", 1, 2.0), ("tensorwise", 1, 1.98)],
    )  # fmt: skip
    second = _run_record(
        tmp_path / "b.json", "bfloat16",
        [("bf16", 2, 2.0), ("bf16", 2, 2.1), ("tensorwise", 2, 2.04)],
    )  # fmt: skip
    rows, base = e2e_report.load_runs([second, first])
    assert base == "bf16" and [r["seed"] for r in rows] == [0, 0, 1, 1, 2, 2, 2]
    assert [r["val_loss"] for r in rows if r["seed"] == 2] == [2.0, 2.1, 2.04]
    summary = {entry["config"]: entry for entry in e2e_report.summarize(rows, base)}
    assert summary["tensorwise"]["seeds"] == 3
    assert summary["tensorwise"]["val vs bf16 % mean"] == pytest.approx((1 - 1 + 2) / 3)
    # The baseline run again in one process is its own row, not mixed into the baseline's.
    assert summary["bf16"]["val vs bf16 % mean"] == 0
    assert summary["bf16 again"]["seeds"] == 1
    assert summary["bf16 again"]["val vs bf16 % mean"] == pytest.approx(5)

    e2e_report.print_summary(rows, base)
    assert "over 3 seeds (0, 1, 2)" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib"):
        e2e_report.plot_differences(rows, base, str(tmp_path / "differences.png"), "a caption")
        assert (tmp_path / "differences.png").stat().st_size > 0


def test_runs_are_compared_with_another_config_of_their_seed(tmp_path, capsys):
    # One float8 config against another, paired by seed; a seed without that config is left
    # out of the comparison rather than compared with something else.
    rows, base = e2e_report.load_runs([_run_record(
        tmp_path / "a.json", "bfloat16",
        [("bf16", 0, 2.0), ("tensorwise", 0, 2.0), ("rowwise", 0, 2.02),
         ("rowwise", 1, 2.2), ("bf16", 1, 2.0), ("tensorwise", 1, 2.1),
         ("bf16", 2, 2.0), ("rowwise", 2, 2.0)],
    )])  # fmt: skip
    assert e2e_report.seeds_with(rows, "tensorwise") == [0, 1]
    summary = {e["config"]: e for e in e2e_report.summarize(rows, base, against="tensorwise")}
    assert summary["tensorwise"]["val vs tensorwise % mean"] == 0
    assert summary["rowwise"]["seeds"] == 2
    assert summary["rowwise"]["val vs tensorwise % mean"] == pytest.approx((1 + 100 / 21) / 2)
    assert summary["bf16"]["val vs tensorwise % range"] == f"{-100 / 21:+.2f} to +0.00"
    # The default is still the baseline, with every seed.
    assert e2e_report.summarize(rows, base)[0]["seeds"] == 3

    e2e_report.print_summary(rows, base, against="tensorwise")
    out = capsys.readouterr().out
    assert "over 2 seeds (0, 1), each against tensorwise of the same seed" in out
    assert "val vs tensorwise % mean" in out
    if importlib.util.find_spec("matplotlib"):
        path = tmp_path / "paired.png"
        e2e_report.plot_differences(rows, base, str(path), against="tensorwise")
        assert path.stat().st_size > 0


def test_timed_steps_run_back_to_back_without_waiting_for_the_device(tmp_path, monkeypatch):
    """After the warm-up steps, no step of the loop waits for the device (a sync, or a loss
    read to the host): the losses are read once at the end, so the host can queue the next
    step while the device runs this one, as training does. The loop's waits are the same for
    8 steps and for 12. (The CPU's AdamW reads its step counts, which the GPU's fused AdamW
    does not; only the example's own calls are counted.)"""
    import sys

    waits = []
    item, tolist = torch.Tensor.item, torch.Tensor.tolist

    def counted(method):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if sys._getframe(1).f_code.co_filename == train_llama.__file__:
                waits.append(method.__name__)
            return method(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "item", counted(item))
    monkeypatch.setattr(torch.Tensor, "tolist", counted(tolist))
    sync = train_llama.synchronize
    monkeypatch.setattr(train_llama, "synchronize", counted(sync))
    counts = []
    for steps in ("8", "12"):
        waits.clear()
        rows = run(tmp_path, "--configs", "bf16", "--steps", steps)
        assert len(rows[0]["losses"]) == int(steps)
        assert all(isinstance(loss, float) for loss in rows[0]["losses"])
        counts.append(len(waits))
    assert counts[0] == counts[1]


def test_full_precision_reductions_hold_for_the_runs_and_are_restored(tmp_path, monkeypatch):
    import torch

    matmul = torch.backends.cuda.matmul
    assert matmul.allow_bf16_reduced_precision_reduction
    seen = []
    train = train_llama.train

    def recording_train(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((matmul.allow_bf16_reduced_precision_reduction,
                     matmul.allow_fp16_reduced_precision_reduction))  # fmt: skip
        return train(*args, **kwargs)

    monkeypatch.setattr(train_llama, "train", recording_train)
    run(tmp_path, "--configs", "bf16", "--steps", "2", "--full-precision-reductions")
    assert seen == [(False, False)]
    assert matmul.allow_bf16_reduced_precision_reduction
    assert matmul.allow_fp16_reduced_precision_reduction


def test_inductor_options_hold_for_the_runs_and_are_restored(tmp_path, monkeypatch, capsys):
    from torch._inductor import config

    assert not config.coordinate_descent_tuning and not config.triton.tile_reductions
    seen = []
    train = train_llama.train

    def recording_train(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((config.coordinate_descent_tuning, config.triton.tile_reductions))
        return train(*args, **kwargs)

    monkeypatch.setattr(train_llama, "train", recording_train)
    run(tmp_path, "--configs", "bf16", "--steps", "2",
        "--inductor", "coordinate_descent_tuning=True", "triton.tile_reductions=True")  # fmt: skip
    assert seen == [(True, True)]
    assert not config.coordinate_descent_tuning and not config.triton.tile_reductions
    assert "inductor {'coordinate_descent_tuning': True" in capsys.readouterr().out
    args = json.loads((tmp_path / "runs.json").read_text())["args"]
    assert args["inductor"] == ["coordinate_descent_tuning=True", "triton.tile_reductions=True"]


def test_deterministic_runs_train_and_leave_the_setting_as_it_was(tmp_path):
    import torch

    assert not torch.are_deterministic_algorithms_enabled()
    rows = run(tmp_path, "--configs", "bf16", "tensorwise", "bf16", "--steps", "2",
               "--deterministic")  # fmt: skip
    # Every op of a run, float8's casts and gemms among them, has a deterministic path (an op
    # without one would have raised), and the repeat lands on the same losses.
    assert rows[2]["losses"] == rows[0]["losses"]
    assert not torch.are_deterministic_algorithms_enabled()
    args = json.loads((tmp_path / "runs.json").read_text())["args"]
    assert args["deterministic"] is True


def test_the_json_file_names_its_outputs_without_their_folders(tmp_path):
    run(tmp_path, "--configs", "bf16", "--steps", "1")
    args = json.loads((tmp_path / "runs.json").read_text())["args"]
    assert args["json"] == "runs.json" and args["plot"] is None


def test_summarizing_json_files_refuses_a_seed_twice_and_mixed_dtypes(tmp_path):
    first = _run_record(tmp_path / "a.json", "bfloat16", [("bf16", 0, 2.0)])
    again = _run_record(tmp_path / "b.json", "bfloat16", [("bf16", 0, 2.1)])
    with pytest.raises(SystemExit, match="seed 0 is in both .*a.json and .*b.json"):
        e2e_report.load_runs([first, again])
    fp32 = _run_record(tmp_path / "c.json", "float32", [("bf16", 1, 2.0)])
    with pytest.raises(SystemExit, match="different dtypes"):
        e2e_report.load_runs([first, fp32])
    no_base = _run_record(tmp_path / "d.json", "bfloat16", [("tensorwise", 3, 2.0)])
    with pytest.raises(SystemExit, match="d.json has no bf16 run of seed 3"):
        e2e_report.load_runs([first, no_base])


def test_configs_run_in_the_order_given_and_compare_with_the_first_baseline_run(tmp_path):
    # float8 before the baseline, then the baseline twice: a check that a run's place in the
    # process does not move its loss.
    rows = run(tmp_path, "--configs", "tensorwise", "bf16", "bf16", "--steps", "3")
    assert [r["config"] for r in rows] == ["tensorwise", "bf16", "bf16"]
    table = {entry["config"]: entry for entry in e2e_report.compare(rows, "fp32")}
    assert table["fp32"]["val vs fp32 %"] == 0
    # fp32 is deterministic on the CPU: the repeat lands on the same losses.
    assert table["fp32 again"]["val vs fp32 %"] == 0
    assert rows[2]["losses"] == rows[1]["losses"]
    assert table["tensorwise"]["val vs fp32 %"] == pytest.approx(
        100 * (rows[0]["val_loss"] / rows[1]["val_loss"] - 1)
    )
    # Any config named again is its own row, as is a third run.
    labels = [e["config"] for e in e2e_report.compare(rows + rows[:2], "fp32")]
    assert labels == ["tensorwise", "fp32", "fp32 again", "tensorwise again", "fp32 again (3)"]
    # Without the baseline named, it runs first.
    assert [r["config"] for r in run(tmp_path, "--configs", "rowwise", "--steps", "2")] == [
        "bf16", "rowwise",
    ]  # fmt: skip


def test_summarize_json_from_the_command_line(tmp_path):
    import subprocess
    import sys

    first = _run_record(tmp_path / "a.json", "bfloat16", [("bf16", 0, 2.0), ("tensorwise", 0, 2.1)])
    second = _run_record(tmp_path / "b.json", "bfloat16", [("bf16", 1, 2.0), ("tensorwise", 1, 2)])
    out = subprocess.run(
        [sys.executable, "-m", "examples.train_llama", "--summarize-json", first, second],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "seed 0:" in out and "seed 1:" in out and "over 2 seeds (0, 1)" in out
    assert "| tensorwise | 2 |" in out
    third = _run_record(tmp_path / "c.json", "bfloat16", [("bf16", 2, 2.0)])
    out = subprocess.run(
        [sys.executable, "-m", "examples.train_llama", "--summarize-json", first, second, third,
         "--against", "tensorwise"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "seed 2: no tensorwise run, left out" in out
    assert "over 2 seeds (0, 1), each against tensorwise of the same seed" in out
    assert "| bf16 | 2 |" in out


def test_a_plot_over_several_files_is_captioned_with_their_machines_and_its_command(
    tmp_path, monkeypatch
):
    paths = []
    for name, date in (("a.json", "2026-12-04"), ("b.json", "2026-12-05")):
        environment = {"device": "NVIDIA H100", "torch": "2.11.0", "date": date, "command": "x"}
        (tmp_path / name).write_text(json.dumps({"environment": environment}))
        paths.append(str(tmp_path / name))
    monkeypatch.setattr("sys.argv", ["train_llama.py", "--summarize-json", *paths])
    caption = e2e_report.caption_of_files(paths)
    # Each fact once, in the files' order, then the plotting command with the files by name.
    assert caption.startswith("NVIDIA H100 | torch 2.11.0 | 2026-12-04, 2026-12-05 | ")
    assert caption.endswith("--summarize-json a.json b.json")


@pytest.mark.parametrize("files", [1, 40])
def test_a_long_caption_stays_below_the_axes_and_their_labels(tmp_path, monkeypatch, files):
    # A --summarize-json over many files makes a caption of many lines: it must not run
    # into the tick labels (the configs' names) or the axes.
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    caption = "NVIDIA H100 | torch 2.11.0 | 2026-12-06 | python -m examples.train_llama "
    caption += " ".join(f"results/run_{i}/warm100_s{i}.json" for i in range(files))
    rows = [
        {"config": config, "seed": seed, "val_loss": 2.0 + 0.01 * seed * (config != "bf16"),
         "final_train_loss": 2.0, "tokens_per_s": 1.0, "peak_memory_gib": 1.0, "losses": [2.0] * 20}
        for seed in range(3) for config in ("bf16", "tensorwise")
    ]  # fmt: skip
    e2e_report.plot_differences(rows, "bf16", str(tmp_path / "d.png"), caption)
    e2e_report.plot(rows, str(tmp_path / "c.png"), caption)
    for figure in saved:
        renderer = figure.canvas.get_renderer()
        (axes,) = figure.axes
        (text,) = figure.texts
        assert text.get_window_extent(renderer).y1 < axes.get_tightbbox(renderer).y0
        assert text.get_window_extent(renderer).y0 >= 0
        assert text.get_text().replace("\n", " ") == caption


def test_the_nudged_baseline_moves_every_weight_by_a_bf16_ulp_and_is_labelled_by_dtype(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for dtype in (torch.float32, torch.bfloat16):
        before = [p.detach().to(dtype).clone() for p in model.parameters()]
        nudged = llama_configs.nudge(copy.deepcopy(model).to(dtype))
        for old, new in zip(before, nudged.parameters(), strict=True):
            relative = (new.detach().float() / old.float() - 1).abs()
            # 2**-7 of every value: exactly in fp32, one or two ulps of bf16 after its rounding
            if dtype == torch.float32:
                assert relative.sub(2**-7).abs().max() < 1e-6
            else:
                assert ((relative >= 2**-8) & (relative <= 2**-6)).all()
            up = new.detach().float() > old.float()
            assert 0.3 < up.float().mean() < 0.7  # up or down at random, not all one way
        # the same nudge each time, so that a seed's nudged run can be repeated
        again = llama_configs.nudge(copy.deepcopy(model).to(dtype))
        assert all(
            torch.equal(a, b) for a, b in zip(nudged.parameters(), again.parameters(), strict=True)
        )
    rows = run(tmp_path, "--configs", "bf16", "bf16-nudged", "--steps", "3")
    # Same batches, weights 2**-7 apart: the runs start close but not bitwise equal.
    assert rows[1]["losses"][0] != rows[0]["losses"][0]
    assert rows[1]["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=1e-2)
    labels = [entry["config"] for entry in e2e_report.compare(rows, "fp32")]
    assert labels == ["fp32", "fp32-nudged"]


def test_warmup_steps_set_the_learning_rate_ramp_and_refuse_a_ramp_outside_the_run(tmp_path):
    args = argparse.Namespace(lr=1.0, steps=100, warmup_steps=None)
    assert train_llama.lr_at(0, args) == pytest.approx(1 / 5)  # default: 5% of the steps
    assert train_llama.lr_at(4, args) == pytest.approx(1.0)
    args.warmup_steps = 40
    assert train_llama.lr_at(0, args) == pytest.approx(1 / 40)
    assert train_llama.lr_at(19, args) == pytest.approx(0.5)
    assert train_llama.lr_at(40, args) == pytest.approx(1.0)  # then the cosine, from the top
    assert train_llama.lr_at(99, args) == pytest.approx(0.1, abs=1e-3)
    rows = run(tmp_path, "--configs", "bf16", "--steps", "3", "--warmup-steps", "3")
    assert len(rows[0]["losses"]) == 3
    for bad in ("0", "4"):
        with pytest.raises(SystemExit, match=f"--warmup-steps {bad}: give 1 to --steps"):
            run(tmp_path, "--configs", "bf16", "--steps", "3", "--warmup-steps", bad)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--steps", "0"], "--steps 0: give 1 or more"),
        (["--grad-accum", "0"], "--grad-accum 0: give 1 or more"),
        (["--seq-len", "5"], "--batch-size 4 x --seq-len 5 = 20 tokens a micro-batch"),
        (["--device", "nodevice"], "train-llama: --device nodevice cannot be used here"),
    ],
)
def test_settings_the_run_cannot_take_exit_naming_the_option(tmp_path, argv, match):
    with pytest.raises(SystemExit, match=match):
        run(tmp_path, "--configs", "bf16", "tensorwise", *argv)


def test_a_bf16_only_run_takes_any_token_count(tmp_path):
    rows = run(tmp_path, "--configs", "bf16", "--seq-len", "5", "--steps", "2")
    assert len(rows) == 1 and len(rows[0]["losses"]) == 2


def test_loss_curves_name_the_baseline_by_its_dtype():
    rows = [{"config": c, "seed": 3} for c in ("bf16", "bf16-nudged", "tensorwise")]
    assert [e2e_report.curve_label(r, "fp32", False) for r in rows] == [
        "fp32", "fp32-nudged", "tensorwise",
    ]  # fmt: skip
    assert e2e_report.curve_label(rows[0], "bf16", True) == "bf16 seed 3"


def test_runs_against_the_nudged_baseline_are_labelled_as_its_row(tmp_path):
    rows = run(tmp_path, "--configs", "bf16", "bf16-nudged", "tensorwise", "--steps", "2")
    table = e2e_report.compare(rows, "fp32", against="bf16-nudged")
    reference = next(entry for entry in table if entry["config"] == "fp32-nudged")
    assert reference["val vs fp32-nudged %"] == 0
    by_config = e2e_report.entries_by_config(rows, "fp32", against="bf16-nudged")
    assert set(by_config) == {"fp32", "fp32-nudged", "tensorwise"}


def test_master_weights_keep_fp32_parameters_under_bf16_autocast(tmp_path, monkeypatch, capsys):
    seen = []

    def evaluate(model, batches):  # noqa: ANN001, ANN202
        seen.append(({p.dtype for p in model.parameters()}, torch.is_autocast_enabled("cpu"),
                     torch.get_autocast_dtype("cpu")))  # fmt: skip
        return 1.0

    monkeypatch.setattr(train_llama, "evaluate", evaluate)
    rows = run(tmp_path, "--dtype", "bfloat16", "--master-weights", "--configs", "bf16",
               "tensorwise", "--steps", "3")  # fmt: skip
    # fp32 parameters (so fp32 optimizer state and updates), forward in bf16 by autocast.
    assert seen == [({torch.float32}, True, torch.bfloat16)] * 2
    assert not torch.is_autocast_enabled("cpu")
    assert rows[1]["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.02)
    assert "fp32 parameters, bfloat16 autocast" in capsys.readouterr().out
    monkeypatch.undo()
    plain = run(tmp_path, "--dtype", "bfloat16", "--configs", "bf16", "--steps", "3")
    # The same first step (bf16 compute from the same weights); the later steps differ, as
    # bf16 parameters round the optimizer's updates.
    assert plain[0]["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=1e-2)
    assert plain[0]["losses"][1:] != rows[0]["losses"][1:]


def test_master_weights_are_refused_for_fp32_and_not_mixed_in_a_summary(tmp_path):
    with pytest.raises(SystemExit, match="--dtype float32 has fp32 parameters already"):
        run(tmp_path, "--dtype", "float32", "--master-weights", "--steps", "1")
    with pytest.raises(SystemExit, match="--dtype float16: AdamW cannot train float16"):
        run(tmp_path, "--dtype", "float16", "--steps", "1")
    plain = _run_record(tmp_path / "a.json", "bfloat16", [("bf16", 0, 2.0)])
    master = _run_record(tmp_path / "b.json", "bfloat16", [("bf16", 1, 2.0)],
                         master_weights=True)  # fmt: skip
    with pytest.raises(SystemExit, match="summarize the two kinds apart"):
        e2e_report.load_runs([plain, master])
    assert len(e2e_report.load_runs([master])[0]) == 1


def test_a_compiled_optimizer_step_updates_as_the_eager_one_and_compiles_once(tmp_path):
    import torch

    configs = ["--configs", "bf16", "tensorwise-delayed"]
    eager = run(tmp_path, *configs)
    # Each run compiles its clip and step once: a changed learning rate is a tensor's new
    # value, not a recompile.
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(tmp_path, *configs, "--compile-optimizer")
    for before, after in zip(eager, compiled, strict=True):
        assert after["losses"] == pytest.approx(before["losses"], rel=1e-5)
        assert after["val_loss"] == pytest.approx(before["val_loss"], rel=1e-5)
    assert json.loads((tmp_path / "runs.json").read_text())["args"]["compile_optimizer"] is True
