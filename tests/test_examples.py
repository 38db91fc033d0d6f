"""examples/train_llama.py end to end on the CPU, at toy size: every run trains, the table and
the plot are written, gradient accumulation and activation checkpointing run."""

import argparse
import json

import pytest

from examples import train_llama


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
        "tensorwise-delayed",
        "tensorwise-delayed-one-pass",
        "tensorwise-cast-kernels",
        "tensorwise-keep-hp-input",
    ]
    rows = run(tmp_path, "--configs", *configs, "--plot", str(plot))
    assert [r["config"] for r in rows] == configs
    for row in rows:
        assert len(row["losses"]) == 8 and all(0 < loss < 10 for loss in row["losses"])
        # float8 and fp32 start from the same weights and batches: the same first loss
        assert row["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=0.02)
    assert plot.stat().st_size > 0
    assert json.loads((tmp_path / "runs.json").read_text())["runs"][1]["config"] == "tensorwise"
    table = capsys.readouterr().out
    assert "| fp32 |" in table and "val vs fp32 %" in table


def test_several_seeds_compare_each_run_with_the_baseline_of_its_seed(tmp_path, capsys):
    from examples.train_llama import summarize

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
