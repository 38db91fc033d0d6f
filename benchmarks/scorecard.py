"""The goals table from fresh measurements: run the per-layer, memory and end-to-end
benchmarks, then score each goal of the speed, memory and end-to-end issues.

    python -m benchmarks.scorecard --out DIR [--parts linear memory e2e] [--quick] [--tuned]
                                   [--backward-accum fast]
    python -m benchmarks.scorecard --out DIR --score-only     # score what DIR already holds

Each part runs as its own process (its stdout in DIR/PART.txt, its figures in DIR/PART.csv
or DIR/e2e.json), so the parts can run in separate sessions into one folder and be scored
together with --score-only. The table goes to stdout and to DIR/scorecard.md, each row with
the file it was read from. torchao.float8 columns appear where it was importable in the
part's run.

A goal is "yes" or "no" from the figure as measured, one run, no margin for noise: the
figures beside it say how close. The end-to-end tokens/s row scores the fastest float8
config and the memory row the lightest, each with the other figure beside it: the lightest
is the opt-in exact float8 SwiGLU, which changes the model's feed-forward module. The
end-to-end loss row is one seed's, which tests nothing about a 0.5% parity (runs of that
model scatter by percents): it is shown, never scored. --quick runs every part small, on the
CPU when there is no GPU: a check that the commands and the scoring work, not a
measurement. --backward-accum fast runs every float8 config, torchao.float8's too, with fast
accumulation in the grad_input and grad_weight gemms (an opt-in of both libraries; the
default is exact): the per-layer rows as recipe "tensorwise+fast-accum", the end-to-end
configs with the suffix "-fast-accum"; the scores name it.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.utils import FAST_ACCUM_SUFFIX, environment, markdown_table

ROOT = Path(__file__).resolve().parent.parent  # the parts run as modules from here
PARTS = ("linear", "memory", "e2e")
E2E_CONFIGS = (
    "bf16",
    "tensorwise",
    "tensorwise-delayed-one-pass-tied",
    # the opt-in exact float8 SwiGLU on the fastest recipe: the lightest config
    "tensorwise-delayed-one-pass-tied-float8-swiglu-exact",
)


def _torchao_importable() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 (absent or broken: either way not comparable)
        return False
    return True


def commands(
    out: Path, quick: bool, device: str, tuned: bool = False, fast_backward: bool = False
) -> dict[str, list[str]]:
    """The command of each part, as it runs from the repository root."""
    py = [sys.executable, "-m"]
    linear = [*py, "benchmarks.bench_linear", "--device", device, "--csv", str(out / "linear.csv")]
    memory = [*py, "benchmarks.bench_memory", "--device", device, "--csv", str(out / "memory.csv")]
    e2e = [*py, "examples.train_llama", "--device", device, "--json", str(out / "e2e.json")]
    configs = list(E2E_CONFIGS) + ["torchao-tensorwise"] * _torchao_importable()
    if fast_backward:
        configs = [c if c == "bf16" else f"{c}{FAST_ACCUM_SUFFIX}" for c in configs]
    e2e += ["--quiet", "--configs", *configs]
    if quick:
        linear += ["--compile", "off", "--shape", "256", "256", "256"]
        memory += ["--cases", "linear-4096", "--modes", "eager"]
        e2e += ["--preset", "cpu", "--steps", "4", "--eval-batches", "1"]
    else:
        linear += ["--compile", "both"]
        e2e += ["--preset", "h200", "--compile", "--steps", "300"]
        e2e += ["--plot", str(out / "e2e.png")]
    if tuned:
        e2e += ["--inductor", "coordinate_descent_tuning=True"]
    if fast_backward:
        linear += ["--backward-accum", "fast"]
    return {"linear": linear, "memory": memory, "e2e": e2e}


@dataclass
class Score:
    what: str
    goal: str
    fp8train: str
    torchao: str
    met: bool | None  # None: shown, not scored
    record: str

    def row(self) -> dict[str, str]:
        met = "-" if self.met is None else ("yes" if self.met else "no")
        return {
            "what": self.what,
            "goal": self.goal,
            "fp8train": self.fp8train,
            "torchao.float8": self.torchao,
            "met": met,
            "record": self.record,
        }


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _number(value: str | None) -> float | None:
    return float(value) if value not in (None, "", "None") else None


def score_linear(rows: list[dict[str, str]], record: str = "linear.csv") -> list[Score]:
    """The per-layer goals from bench_linear's CSV: tensorwise rows against bf16 (the CPU's
    runs: fp32), default compile mode, the default save policy; the rows with fast backward
    accumulation (recipe "tensorwise+fast-accum") where the CSV has no default ones."""
    dtypes = {row["ref_dtype"] for row in rows}
    reference = "bfloat16" if "bfloat16" in dtypes or not dtypes else sorted(dtypes)[0]
    recipes = {row["recipe"] for row in rows}
    recipe = "tensorwise" if "tensorwise" in recipes or not recipes else "tensorwise+fast-accum"
    note = "" if recipe == "tensorwise" else " (fast backward accumulation, both libraries)"
    rows = [
        row
        for row in rows
        if row["recipe"] == recipe
        and row["ref_dtype"] == reference
        and row["recompute_weight_cast"] == "True"
        and row.get("compile_mode") in (None, "", "None", "default")
    ]
    scores = []
    for compiled, label, goal in (("True", "compiled", 1.5), ("False", "eager", 1.3)):
        mode = [row for row in rows if row["compiled"] == compiled]
        if not mode:
            continue
        fp8 = statistics.geometric_mean(float(row["fp8_speedup"]) for row in mode)
        theirs = [_number(row.get("torchao_speedup")) for row in mode]
        known = all(value is not None for value in theirs)
        ao_text = f"{statistics.geometric_mean(theirs):.3f}x" if known else "not run"
        scores.append(
            Score(
                f"per-layer fwd+bwd, {label}, geometric mean over {len(mode)} shapes{note}",
                f">= {goal}x bf16",
                f"{fp8:.3f}x",
                ao_text,
                fp8 >= goal,
                record,
            )
        )
        if compiled != "True":
            continue
        versus = {row["name"]: _number(row.get("vs_torchao")) for row in mode}
        if versus and all(v is not None for v in versus.values()):
            slowest = min(versus, key=versus.get)
            scores.append(
                Score(
                    f"per-layer, compiled, each shape against torchao.float8{note}",
                    ">= 1.15x on every shape",
                    f"{min(versus.values()):.3f}-{max(versus.values()):.3f}x (slowest {slowest})",
                    "-",
                    min(versus.values()) >= 1.15,
                    record,
                )
            )
        w13 = [row for row in mode if row["name"] == "ffn.w13"]
        if w13:
            speedup = float(w13[0]["fp8_speedup"])
            ao = _number(w13[0].get("torchao_speedup"))
            scores.append(
                Score(
                    f"per-layer, compiled, ffn.w13{note}",
                    ">= 1.7x bf16",
                    f"{speedup:.3f}x",
                    f"{ao:.3f}x" if ao is not None else "not run",
                    speedup >= 1.7,
                    record,
                )
            )
    if rows:
        slowest = min(rows, key=lambda row: float(row["auto_filter_speedup"]))
        value = float(slowest["auto_filter_speedup"])
        where = "compiled" if slowest["compiled"] == "True" else "eager"
        scores.append(
            Score(
                f"with the auto filter on, the slowest layer against bf16{note}",
                ">= 1x (no layer slower)",
                f"{value:.3f}x ({slowest['name']}, {where})",
                "-",
                value >= 1.0,
                record,
            )
        )
    return scores


def score_memory(rows: list[dict[str, str]], record: str = "memory.csv") -> list[Score]:
    """The memory goals from bench_memory's CSV (peak of one fwd+bwd per case and mode)."""

    def ratio(row: dict[str, str], column: str) -> float | None:
        value = _number(row.get(column))
        return None if value is None else value / float(row["bf16"])

    scores = []
    for row in rows:
        if row["case"] != "linear-16384":
            continue
        goal = 0.75 if row["mode"] == "eager" else 0.70
        fp8 = ratio(row, "fp8 default")
        ao = ratio(row, "torchao.float8")
        scores.append(
            Score(
                f"activation-heavy peak (linear-16384), {row['mode']}",
                f"<= {goal}x bf16",
                f"{fp8:.3f}x",
                f"{ao:.3f}x" if ao is not None else "not run",
                fp8 <= goal,
                record,
            )
        )
    eager = [(row["case"], ratio(row, "fp8 default")) for row in rows if row["mode"] == "eager"]
    if eager:
        case, worst = max(eager, key=lambda pair: pair[1])
        scores.append(
            Score(
                "eager peak against bf16, the highest case",
                "<= 1x on every case",
                f"{worst:.3f}x ({case})",
                "-",
                worst <= 1.0,
                record,
            )
        )
    return scores


def score_e2e(data: dict, record: str = "e2e.json") -> list[Score]:
    """The end-to-end goals from train_llama's JSON: the fastest float8 config of the run
    against bf16, its peak memory, and its loss (shown only)."""
    runs = data["runs"]
    bf16 = next(run for run in runs if run["config"] == "bf16")
    ours = [run for run in runs if run["config"] not in ("bf16", "bf16-nudged")]
    ours = [run for run in ours if not run["config"].startswith("torchao")]
    theirs = [run for run in runs if run["config"].startswith("torchao")]
    if not ours:
        return []
    best = max(ours, key=lambda run: run["tokens_per_s"])

    def speed(run: dict) -> float:
        return run["tokens_per_s"] / bf16["tokens_per_s"]

    def memory(run: dict) -> float | None:
        if run["peak_memory_gib"] is None or bf16["peak_memory_gib"] is None:
            return None  # the CPU's runs measure no peak
        return run["peak_memory_gib"] / bf16["peak_memory_gib"]

    def loss(run: dict) -> float:
        return 100 * (run["val_loss"] / bf16["val_loss"] - 1)

    ao = theirs[0] if theirs else None
    best_memory = memory(best)
    at_memory = "" if best_memory is None else f", at {best_memory:.4f}x peak memory"
    measured = [run for run in ours if memory(run) is not None]
    if measured:
        lightest = min(measured, key=memory)
        ratio = memory(lightest)
        peak = Score(
            "end to end, peak memory",
            "<= 0.85x bf16",
            f"{ratio:.4f}x ({lightest['config']}, at {speed(lightest):.3f}x tokens/s)",
            f"{memory(ao):.4f}x" if ao else "not run",
            ratio <= 0.85,
            record,
        )
    else:
        peak = Score("end to end, peak memory", "<= 0.85x bf16", "not measured", "-", None, record)
    return [
        Score(
            "end to end, tokens/s",
            ">= 1.4x bf16",
            f"{speed(best):.3f}x ({best['config']}{at_memory})",
            f"{speed(ao):.3f}x" if ao else "not run",
            speed(best) >= 1.4,
            record,
        ),
        peak,
        Score(
            "end to end, validation loss (one seed: not a parity test)",
            "within 0.5% of bf16",
            f"{loss(best):+.2f}% ({best['config']})",
            f"{loss(ao):+.2f}%" if ao else "not run",
            None,
            record,
        ),
    ]


def score(out: Path) -> list[Score]:
    """Every goal whose part's output is in `out`."""
    scores = []
    if (out / "linear.csv").exists():
        scores += score_linear(read_csv(out / "linear.csv"))
    if (out / "memory.csv").exists():
        scores += score_memory(read_csv(out / "memory.csv"))
    if (out / "e2e.json").exists():
        scores += score_e2e(json.loads((out / "e2e.json").read_text()))
    return scores


def records_header(out: Path) -> dict[str, str]:
    """What --score-only says of the figures: measured where each part's record says (its
    PART.txt, and e2e.json's environment, copied here), not on the machine that scores."""
    header = {
        "scored from": f"the records in {out.name}/, measured where each record says (its "
        "PART.txt starts with its machine, versions and command)"
    }
    if (out / "e2e.json").exists():
        environment_of_e2e = json.loads((out / "e2e.json").read_text()).get("environment", {})
        header.update({f"e2e {key}": value for key, value in environment_of_e2e.items()})
    return header


def run_part(name: str, command: list[str], out: Path) -> int:
    """Run one part, its output to the terminal and to out/NAME.txt; its exit status."""
    print(f"## {name}: {' '.join(command)}", flush=True)
    with open(out / f"{name}.txt", "w") as log:
        log.write(f"command: {' '.join(command)}\n\n")
        log.flush()
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        return process.wait()


def main(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick and not args.score_only:
        raise SystemExit(
            "scorecard: the goals are GPU figures and no GPU is visible: run it on an H100 or "
            "H200, or pass --quick to check the commands small on the CPU"
        )
    failed = []
    if not args.score_only:
        fast_backward = args.backward_accum == "fast"
        for name, command in commands(out, args.quick, device, args.tuned, fast_backward).items():
            if name in args.parts and run_part(name, command, out) != 0:
                failed.append(name)
    scores = score(out)
    if not scores:
        raise SystemExit(
            f"scorecard: nothing to score in {out} (no linear.csv, memory.csv, e2e.json)"
        )
    header = records_header(out) if args.score_only else environment()
    lines = [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", markdown_table([s.row() for s in scores])]
    if args.quick:
        lines += ["", "(--quick: small shapes and few steps; not a measurement)"]
    (out / "scorecard.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if failed:
        raise SystemExit(f"scorecard: these parts failed: {', '.join(failed)} (see their .txt)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for every part's output")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument(
        "--quick", action="store_true", help="small and short: checks the plumbing, on any device"
    )
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="the end-to-end runs with inductor's coordinate descent tuning (every config, bf16 "
        "too; from a cold cache it takes several times longer to compile)",
    )
    parser.add_argument(
        "--backward-accum",
        choices=["exact", "fast"],
        default="exact",
        help="fast: every float8 config (torchao.float8's too) with fast accumulation in the "
        "grad_input and grad_weight gemms, an opt-in of both libraries (default: exact)",
    )
    parser.add_argument(
        "--score-only", action="store_true", help="run nothing; score what --out holds"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
