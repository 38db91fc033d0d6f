"""Command line: `python -m fp8train <command> [options]`."""

from __future__ import annotations

import argparse
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
