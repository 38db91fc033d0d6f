"""Command line: `python -m fp8train <command> [options]`."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from fp8train.demo import add_demo_arguments, run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fp8train",
        description="fp8train: float8 training for PyTorch. Run a command with --help for its "
        "options.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    demo = commands.add_parser(
        "demo",
        help="train a small language model in high precision and in float8, and compare",
        description="Train a small LLaMA-style byte-level language model twice from the same "
        "weights on the same batches, once in high precision and once with float8 linear "
        "layers, then print losses, step time, throughput and memory side by side.",
    )
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo)

    for name, summary in BENCHMARKS.items():
        bench = commands.add_parser(
            f"bench-{name}", help=summary, description=f"{summary} (benchmarks/bench_{name}.py)"
        )
        module = _benchmark(name)
        if module is None:
            bench.set_defaults(func=_no_benchmarks)
        else:
            module.add_arguments(bench)
            bench.set_defaults(func=module.main)
    return parser


BENCHMARKS = {
    "memory": "peak memory of fwd+bwd: bf16 against float8 under each save policy",
    "linear": "fwd+bwd time of one layer, nn.Linear against Float8Linear (and torchao.float8)",
}


def _benchmark(name: str):  # noqa: ANN202
    """benchmarks/bench_<name>.py, or None outside a checkout of the repository (the
    benchmarks are not installed with the package)."""
    try:
        return importlib.import_module(f"benchmarks.bench_{name}")
    except ModuleNotFoundError as error:
        if error.name != "benchmarks" and error.name != f"benchmarks.bench_{name}":
            raise
        return None


def _no_benchmarks(args: argparse.Namespace) -> None:
    raise SystemExit(
        f"{args.command}: the benchmarks live in the repository's benchmarks/ folder, which is "
        "not installed with the package: run this from the root of a checkout"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
