"""The tables and plots of examples/train_llama.py's runs: each run against a reference run
of its seed (bf16 by default), the summary over seeds with its standard error, loss curves,
and the per-seed loss differences. Reads `train_llama.main`'s rows or its --json files.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap

import torch

from benchmarks.utils import command_line, markdown_table

BASE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
"""The name of the run without float8 in the tables, by --dtype."""


def base_label(config: str, base_name: str) -> str:
    """A config's name in the tables: the baseline's ("bf16", "bf16-nudged") named by --dtype."""
    return base_name + config.removeprefix("bf16") if config.startswith("bf16") else config


def reference_label(base_name: str, against: str = "bf16") -> str:
    """The name in the tables of the config that runs are compared with (--against, by
    default the baseline), as `compare` labels its row."""
    return base_label(against, base_name)


def compare(rows: list[dict], base_name: str, against: str = "bf16") -> list[dict]:
    """Each run against the first run of config `against` (by default "bf16", the run without
    float8, in --dtype): tokens/s and memory ratios, loss differences in %."""
    base = next(row for row in rows if row["config"] == against)
    ref = reference_label(base_name, against)
    table = []
    runs_of: dict[str, int] = {}
    for row in rows:
        # A config run again in the process is its own row (for the baseline: its own spread).
        label = base_label(row["config"], base_name)
        runs_of[label] = runs_of.get(label, 0) + 1
        if runs_of[label] == 2:
            label = f"{label} again"
        elif runs_of[label] > 2:
            label = f"{label} again ({runs_of[label]})"
        entry = {
            "config": label,
            "tokens/s": round(row["tokens_per_s"]),
            f"vs {ref}": row["tokens_per_s"] / base["tokens_per_s"],
            "peak GiB": row["peak_memory_gib"],
            f"memory vs {ref}": None
            if row["peak_memory_gib"] is None
            else row["peak_memory_gib"] / base["peak_memory_gib"],
            "final train loss": row["final_train_loss"],
            f"train vs {ref} %": 100 * (row["final_train_loss"] / base["final_train_loss"] - 1),
            "val loss": row["val_loss"],
            f"val vs {ref} %": 100 * (row["val_loss"] / base["val_loss"] - 1),
        }
        table.append(entry)
    return table


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of `values` (None for a single value)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def seeds_with(rows: list[dict], against: str = "bf16") -> list[int]:
    """The seeds of `rows` that have a run of config `against`, in their order."""
    return [s for s in dict.fromkeys(r["seed"] for r in rows)
            if any(r["seed"] == s and r["config"] == against for r in rows)]  # fmt: skip


def entries_by_config(
    rows: list[dict], base_name: str, against: str = "bf16"
) -> dict[str, list[dict]]:
    """`compare`'s entries of every seed that has a run of `against`, grouped by config (by
    row label: a repeat is its own config)."""
    by_config: dict[str, list[dict]] = {}
    for seed in seeds_with(rows, against):
        for entry in compare([row for row in rows if row["seed"] == seed], base_name, against):
            by_config.setdefault(entry["config"], []).append(entry)
    return by_config


def summarize(rows: list[dict], base_name: str, against: str = "bf16") -> list[dict]:
    """Over several seeds: each config against the run of `against` (the baseline unless
    named) of the same seed, as the mean, its standard error and the range of the per-seed
    figures. One seed's loss difference is not a measure of float8's: runs of the same
    program can land further apart than the goal (benchmarks/results/e2e_h100_2026-12-05.md).
    Against another float8 config, the pairs share a process and a seed, which takes out
    each seed's own spread but not the run-to-run one."""
    ref = reference_label(base_name, against)
    table = []
    for config, entries in entries_by_config(rows, base_name, against).items():
        summary = {"config": config, "seeds": len(entries)}
        for key in (f"vs {ref}", f"memory vs {ref}"):
            values = [e[key] for e in entries if e[key] is not None]
            summary[key] = statistics.mean(values) if values else None
        for key in (f"train vs {ref} %", f"val vs {ref} %"):
            values = [e[key] for e in entries]
            summary[f"{key} mean"] = statistics.mean(values)
            # The standard error of that mean: a parity goal is resolved only once the mean
            # lies within it by more than about two of these.
            summary[f"{key} sem"] = standard_error(values)
            summary[f"{key} range"] = f"{min(values):+.2f} to {max(values):+.2f}"
        table.append(summary)
    return table


def print_seed(rows: list[dict], seed: int, base_name: str, against: str = "bf16") -> None:
    """The table of one seed's runs."""
    runs = [row for row in rows if row["seed"] == seed]
    table = compare(runs, base_name, against)
    # A cell left empty where a figure does not exist (peak memory on the CPU).
    table = [{k: v for k, v in r.items() if v is not None} for r in table]
    print(markdown_table(table, list(table[0])))


def print_summary(rows: list[dict], base_name: str, against: str = "bf16") -> None:
    """The summary over the seeds of `rows` that have a run of `against`, when there are
    several."""
    seeds = seeds_with(rows, against)
    if len(seeds) > 1:
        summary = summarize(rows, base_name, against)
        summary = [{k: v for k, v in r.items() if v is not None} for r in summary]
        print(f"\nover {len(seeds)} seeds ({', '.join(map(str, seeds))}), each against "
              f"{reference_label(base_name, against)} of the same seed:")  # fmt: skip
        print(markdown_table(summary, list(summary[0])))


def load_runs(paths: list[str]) -> tuple[list[dict], str]:
    """The runs of several --json files in the order of their seeds, for one summary over all
    of them, and the name of their baseline."""
    rows, source, base_names, master = [], {}, set(), set()
    for path in paths:
        with open(path) as handle:
            record = json.load(handle)
        runs = record["runs"]
        base_names.add(BASE_NAMES[record["args"]["dtype"]])
        master.add(bool(record["args"].get("master_weights")))
        for seed in dict.fromkeys(run["seed"] for run in runs):
            if seed in source:
                raise SystemExit(
                    f"seed {seed} is in both {source[seed]} and {path}: each seed's runs must "
                    "come from one process (they are compared with that process's baseline); "
                    "leave one of the files out"
                )
            if not any(run["config"] == "bf16" and run["seed"] == seed for run in runs):
                raise SystemExit(f"{path} has no bf16 run of seed {seed} to compare with")
            source[seed] = path
        rows += runs
    if len(base_names) > 1:
        raise SystemExit(f"the files train in different dtypes ({sorted(base_names)}): "
                         "summarize runs of one dtype at a time")  # fmt: skip
    if len(master) > 1:
        raise SystemExit("some files train with --master-weights (fp32 parameters) and some "
                         "without: summarize the two kinds apart")  # fmt: skip
    rows.sort(key=lambda run: run["seed"])  # stable: each seed's runs keep their order
    return rows, base_names.pop()


def _figure():  # noqa: ANN202
    """A new figure and its axes, drawn off screen (matplotlib is imported only to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4))


CAPTION_POINTS = 6
CAPTION_CHARACTERS_PER_LINE = 150  # at 6 points, about what a 7-inch figure holds


def _save(figure, path: str, caption: str) -> None:  # noqa: ANN001
    """Write `figure` to `path`, with `caption` (GPU, torch, date, command) under the axes
    and as the PNG's own text, readable without looking at the picture. The figure grows by
    the caption's lines, so that a long command (many files) stays clear of the axes."""
    bottom = 0.0
    if caption:
        lines = textwrap.wrap(caption, CAPTION_CHARACTERS_PER_LINE, break_on_hyphens=False)
        room = (len(lines) + 1) * CAPTION_POINTS * 1.3 / 72  # inches, a blank line above
        height = figure.get_figheight()
        figure.set_figheight(height + room)
        bottom = room / (height + room)
        figure.text(0.01, 0.01, "\n".join(lines), fontsize=CAPTION_POINTS, va="bottom")
    figure.tight_layout(rect=(0, bottom, 1, 1))
    figure.savefig(path, dpi=150, metadata={"Description": caption} if caption else None)


def curve_label(row: dict, base_name: str, several_seeds: bool) -> str:
    """A run's name in the loss-curve legend, the baseline named by its dtype."""
    label = base_label(row["config"], base_name)
    return f"{label} seed {row['seed']}" if several_seeds else label


def plot(
    rows: list[dict], path: str, caption: str = "", smooth: int = 10, base_name: str = "bf16"
) -> None:
    """Loss curves of every run, from `main`'s rows or a --json file's "runs"; `caption`
    (the GPU, torch, date and command) under the axes; `base_name` names the baseline (the
    --dtype's: "bf16", "fp32")."""
    figure, axes = _figure()
    several = len({r.get("seed", 0) for r in rows}) > 1
    for row in rows:
        losses = torch.tensor(row["losses"])
        window = min(smooth, len(losses))
        smoothed = losses.unfold(0, window, 1).mean(1)
        label = curve_label(row, base_name, several)
        axes.plot(range(window - 1, len(losses)), smoothed, label=label, linewidth=1)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(f"train loss (mean of {smooth} steps)")
    axes.legend()
    _save(figure, path, caption)


def plot_differences(
    rows: list[dict],
    base_name: str,
    path: str,
    caption: str = "",
    goal: float = 0.5,
    against: str = "bf16",
) -> None:
    """Each run's final validation loss against the first run of `against` (the baseline
    unless named) of its seed, one point per seed and config, with each config's mean and
    its standard error, beside the +-`goal` % band of the loss-parity goal."""
    ref = reference_label(base_name, against)
    by_config = {
        config: [entry[f"val vs {ref} %"] for entry in entries]
        for config, entries in entries_by_config(rows, base_name, against).items()
        if config != ref
    }
    figure, axes = _figure()
    axes.axhspan(-goal, goal, color="0.9", label=f"within {goal}% of {ref}")
    axes.axhline(0, color="0.5", linewidth=0.8)
    for x, values in enumerate(by_config.values()):
        axes.scatter([x] * len(values), values, s=14, alpha=0.6)
        label = "mean and its standard error" if x == 0 else None
        axes.errorbar(x + 0.15, statistics.mean(values), yerr=standard_error(values) or 0.0,
                      fmt="o", color="black", capsize=4, label=label)  # fmt: skip
    ticks = [f"{c}\n({len(v)} seed{'s' * (len(v) > 1)})" for c, v in by_config.items()]
    axes.set_xticks(range(len(by_config)), ticks)
    axes.set_xlim(-0.5, len(by_config) - 0.5)
    axes.set_ylabel(f"val loss vs {ref} of its seed, %")
    # Above the axes: inside them it can hide a point.
    axes.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    _save(figure, path, caption)


def caption_of(environment: dict[str, str]) -> str:
    keys = ("device", "torch", "date", "command")
    return " | ".join(environment[key] for key in keys if key in environment)


def caption_of_files(paths: list[str]) -> str:
    """A plot's caption for the runs of several --json files: their devices, torch versions
    and dates, and the command that plots them (the runs' own commands are in the files)."""
    environments = []
    for path in paths:
        with open(path) as handle:
            environments.append(json.load(handle).get("environment", {}))
    parts = [
        prefix + ", ".join(dict.fromkeys(e[key] for e in environments if key in e))
        for key, prefix in (("device", ""), ("torch", "torch "), ("date", ""))
        if any(key in e for e in environments)
    ]
    return " | ".join([*parts, command_line()])
