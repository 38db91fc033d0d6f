"""The scorecard's scoring, on figures written by hand, and its commands, run small."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.scorecard import (
    ROOT,
    commands,
    score,
    score_e2e,
    score_linear,
    score_memory,
)


def linear_row(name, compiled, speedup, vs_torchao=None, **overrides):
    row = {
        "name": name,
        "ref_dtype": "bfloat16",
        "compiled": str(compiled),
        "compile_mode": "default" if compiled else "",
        "recompute_weight_cast": "True",
        "recipe": "tensorwise",
        "fp8_speedup": str(speedup),
        "auto_filter_speedup": str(speedup if speedup >= 1 else 1.0),
    }
    if vs_torchao is not None:
        row["vs_torchao"] = str(vs_torchao)
        row["torchao_speedup"] = str(speedup / vs_torchao)
    return row | overrides


def by_what(scores):
    return {s.what: s for s in scores}


def test_per_layer_goals_are_scored_from_the_default_rows_only():
    rows = [
        linear_row("attn.wqkv", True, 1.2, 1.05),
        linear_row("attn.w0", True, 1.1, 1.02),
        linear_row("ffn.w13", True, 1.8, 1.2),
        linear_row("ffn.w2", True, 1.6, 1.16),
        # rows the goals do not read: another recipe, CUDA graphs, fp16, keep-weight
        linear_row("ffn.w13", True, 9.0, 9.0, recipe="rowwise"),
        linear_row("ffn.w13", True, 9.0, 9.0, compile_mode="reduce-overhead"),
        linear_row("ffn.w13", True, 9.0, 9.0, ref_dtype="float16"),
        linear_row("ffn.w13", True, 9.0, 9.0, recompute_weight_cast="False"),
        linear_row("attn.w0", False, 0.9),
        linear_row("ffn.w13", False, 1.9),
    ]
    scores = by_what(score_linear(rows))
    compiled = scores["per-layer fwd+bwd, compiled, geometric mean over 4 shapes"]
    assert compiled.fp8train == f"{(1.2 * 1.1 * 1.8 * 1.6) ** 0.25:.3f}x"
    assert compiled.met is False  # 1.39x
    versus = scores["per-layer, compiled, each shape against torchao.float8"]
    assert versus.fp8train == "1.020-1.200x (slowest attn.w0)"
    assert versus.met is False
    assert scores["per-layer, compiled, ffn.w13"].met is True  # 1.8 >= 1.7
    eager = scores["per-layer fwd+bwd, eager, geometric mean over 2 shapes"]
    assert eager.fp8train == f"{(0.9 * 1.9) ** 0.5:.3f}x"
    assert eager.torchao == "not run"
    auto = scores["with the auto filter on, the slowest layer against bf16"]
    assert auto.met is True  # the slow layer was left out: 1.0x


def test_a_layer_the_auto_filter_keeps_and_loses_fails_its_goal():
    rows = [linear_row("attn.w0", True, 0.97, auto_filter_speedup="0.97")]
    auto = by_what(score_linear(rows))["with the auto filter on, the slowest layer against bf16"]
    assert auto.met is False
    assert auto.fp8train == "0.970x (attn.w0, compiled)"


def test_memory_goals():
    rows = [
        {"case": "linear-16384", "mode": "eager", "bf16": "2.0", "fp8 default": "1.4",
         "torchao.float8": "2.8"},
        {"case": "linear-16384", "mode": "compiled", "bf16": "2.0", "fp8 default": "1.5",
         "torchao.float8": ""},
        {"case": "linear-4096", "mode": "eager", "bf16": "1.0", "fp8 default": "1.04"},
    ]  # fmt: skip
    scores = by_what(score_memory(rows))
    eager = scores["activation-heavy peak (linear-16384), eager"]
    assert (eager.fp8train, eager.torchao, eager.met) == ("0.700x", "1.400x", True)
    compiled = scores["activation-heavy peak (linear-16384), compiled"]
    assert (compiled.fp8train, compiled.torchao, compiled.met) == ("0.750x", "not run", False)
    worst = scores["eager peak against bf16, the highest case"]
    assert (worst.fp8train, worst.met) == ("1.040x (linear-4096)", False)


def e2e_run(config, tokens, peak, val):
    return {"config": config, "tokens_per_s": tokens, "peak_memory_gib": peak, "val_loss": val}


def test_end_to_end_goals_take_the_fastest_float8_config_and_never_score_one_seeds_loss():
    data = {
        "runs": [
            e2e_run("bf16", 100.0, 16.0, 2.0),
            e2e_run("tensorwise", 135.0, 14.0, 2.02),
            e2e_run("tensorwise-delayed-one-pass-tied", 141.0, 13.5, 1.99),
            e2e_run("torchao-tensorwise", 150.0, 14.0, 2.1),  # theirs: never "ours"
        ]
    }
    speed, memory, loss = score_e2e(data)
    assert speed.fp8train == "1.410x (tensorwise-delayed-one-pass-tied, at 0.8438x peak memory)"
    assert (speed.torchao, speed.met) == ("1.500x", True)
    assert memory.fp8train == "0.8438x (tensorwise-delayed-one-pass-tied, at 1.410x tokens/s)"
    assert memory.met is True
    assert loss.met is None
    assert loss.fp8train == "-0.50% (tensorwise-delayed-one-pass-tied)"


def test_the_lightest_config_is_scored_for_memory_with_its_own_speed_beside_it():
    fastest = e2e_run("tensorwise-delayed-one-pass-tied", 138.0, 14.0, 2.0)
    lightest = e2e_run("tensorwise-delayed-one-pass-tied-float8-swiglu-exact", 136.0, 13.2, 2.0)
    speed, memory, _ = score_e2e({"runs": [e2e_run("bf16", 100.0, 16.0, 2.0), fastest, lightest]})
    assert speed.fp8train == "1.380x (tensorwise-delayed-one-pass-tied, at 0.8750x peak memory)"
    assert memory.fp8train == (
        "0.8250x (tensorwise-delayed-one-pass-tied-float8-swiglu-exact, at 1.360x tokens/s)"
    )
    assert (speed.met, memory.met) == (False, True)


def test_end_to_end_runs_without_a_peak_are_not_scored_for_memory():
    data = {"runs": [e2e_run("bf16", 10.0, None, 4.0), e2e_run("tensorwise", 6.0, None, 4.0)]}
    speed, memory, _ = score_e2e(data)
    assert speed.met is False
    assert (memory.fp8train, memory.met) == ("not measured", None)


def test_score_reads_what_the_folder_holds(tmp_path):
    assert score(tmp_path) == []
    data = {"runs": [e2e_run("bf16", 10.0, 2.0, 4.0), e2e_run("tensorwise", 14.5, 1.6, 4.0)]}
    (tmp_path / "e2e.json").write_text(json.dumps(data))
    assert [s.what for s in score(tmp_path)][0] == "end to end, tokens/s"


def run_scorecard(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -m benchmarks.scorecard ARGV` from the repository root, its output captured."""
    command = [sys.executable, "-m", "benchmarks.scorecard", *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_quick_scorecard_runs_every_part_and_writes_the_table(tmp_path):
    """Every part's command as the scorecard builds it runs (small), and the table scores it:
    the commands cannot drift from the benchmarks' options unseen."""
    out = tmp_path / "card"
    result = run_scorecard("--out", str(out), "--quick", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for part in ("linear.txt", "linear.csv", "memory.txt", "memory.csv", "e2e.txt", "e2e.json"):
        assert (out / part).exists(), part
    table = (out / "scorecard.md").read_text()
    for what in ("per-layer fwd+bwd, eager", "eager peak against bf16", "end to end, tokens/s"):
        assert what in table
    assert "not a measurement" in table


def test_score_only_names_the_records_machine_not_the_scoring_one(tmp_path):
    data = {
        "environment": {"device": "NVIDIA H100 80GB HBM3 (sm_90, 79 GiB)", "torch": "2.11.0"},
        "runs": [e2e_run("bf16", 10.0, 2.0, 4.0), e2e_run("tensorwise", 14.5, 1.6, 4.0)],
    }
    (tmp_path / "e2e.json").write_text(json.dumps(data))
    result = run_scorecard("--out", str(tmp_path), "--score-only")
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "scorecard.md").read_text()
    assert "- e2e device: NVIDIA H100 80GB HBM3 (sm_90, 79 GiB)" in table
    assert "scored from: the records in" in table
    assert "- device:" not in table  # the scoring machine's own header is left out


def test_scorecard_refuses_a_full_run_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the full run would start")
    result = run_scorecard("--out", str(tmp_path))
    assert result.returncode != 0
    assert "no GPU is visible" in result.stderr


def test_tuned_end_to_end_runs_pass_the_tuning_to_every_config(tmp_path):
    plain = commands(tmp_path, quick=False, device="cuda")
    tuned = commands(tmp_path, quick=False, device="cuda", tuned=True)
    assert "--inductor" not in plain["e2e"]
    assert tuned["e2e"][-2:] == ["--inductor", "coordinate_descent_tuning=True"]
    assert tuned["linear"] == plain["linear"] and tuned["memory"] == plain["memory"]
    assert {"--preset", "h200", "--compile"} <= set(plain["e2e"])


def test_fast_backward_accumulation_runs_every_float8_config_with_it_and_only_those(tmp_path):
    from examples.llama_configs import CONFIGS

    plain = commands(tmp_path, quick=False, device="cuda")
    fast = commands(tmp_path, quick=False, device="cuda", fast_backward=True)

    def configs(command: list[str]) -> list[str]:
        start = command.index("--configs") + 1
        stop = next(i for i in range(start, len(command)) if command[i].startswith("--"))
        return command[start:stop]

    assert [c.removesuffix("-fast-accum") for c in configs(fast["e2e"])] == configs(plain["e2e"])
    assert configs(fast["e2e"])[0] == "bf16"
    assert all(c.endswith("-fast-accum") for c in configs(fast["e2e"])[1:])
    assert set(configs(fast["e2e"])) <= set(CONFIGS)  # every name train-llama takes
    assert fast["linear"] == [*plain["linear"], "--backward-accum", "fast"]
    assert fast["memory"] == plain["memory"]


def test_per_layer_goals_read_the_fast_accumulation_rows_where_there_are_no_default_ones():
    fast = [
        linear_row(name, True, speedup, 1.1, recipe="tensorwise+fast-accum")
        for name, speedup in (("attn.wqkv", 1.3), ("attn.w0", 1.2), ("ffn.w13", 1.9))
    ]
    scores = by_what(score_linear(fast))
    note = " (fast backward accumulation, both libraries)"
    compiled = scores[f"per-layer fwd+bwd, compiled, geometric mean over 3 shapes{note}"]
    assert compiled.fp8train == f"{(1.3 * 1.2 * 1.9) ** (1 / 3):.3f}x"
    assert scores[f"per-layer, compiled, ffn.w13{note}"].met is True
    # Beside default rows the default rows are scored, under the plain names.
    both = by_what(score_linear([*fast, linear_row("ffn.w13", True, 1.6, 1.05)]))
    assert both["per-layer fwd+bwd, compiled, geometric mean over 1 shapes"].fp8train == "1.600x"
