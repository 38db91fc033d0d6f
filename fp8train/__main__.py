"""Command line: `python -m fp8train <command> [options]`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fp8train.demo import add_demo_arguments, run_demo


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command. The benchmarks' and examples' modules (which import
    matplotlib, and torchao where it is installed) are imported for `command` alone: the
    others' options are not parsed, and their summaries are written here."""
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

    env = commands.add_parser(
        "env",
        help="versions, GPUs and the compiler Triton would use: what a bug report needs",
        description="Print fp8train's, torch's, Triton's and torchao's versions, the GPUs, the "
        "ptxas Triton assembles kernels with, any known problem with it (fp8train.toolchain) "
        'and what compiled_transpose_kernels="auto" resolves to.',
    )
    env.set_defaults(func=_print_env)

    for name, summary in BENCHMARKS.items():
        description = f"{summary} (benchmarks/bench_{name}.py)"
        _add_checkout_command(
            commands, f"bench-{name}", f"benchmarks.bench_{name}", summary, description, command
        )
    _add_checkout_command(
        commands,
        "train-llama",
        "examples.train_llama",
        "LLaMA-style training on real text: bf16 against float8 recipes and torchao.float8",
        "LLaMA-style training on real text (examples/train_llama.py)",
        command,
    )
    _add_checkout_command(
        commands,
        "scorecard",
        "benchmarks.scorecard",
        "run the per-layer, memory and end-to-end benchmarks and score the goals",
        "Run the per-layer, memory and end-to-end benchmarks and print the goals table from "
        "their figures (benchmarks/scorecard.py)",
        command,
    )
    return parser


BENCHMARKS = {
    "memory": "peak memory of fwd+bwd: bf16 against float8 under each save policy",
    "linear": "fwd+bwd time of one layer, nn.Linear against Float8Linear (and torchao.float8)",
    "cast": "the casts alone, eager and compiled, against a device copy's bandwidth",
}


def _add_checkout_command(
    commands: argparse._SubParsersAction,
    command: str,
    module_name: str,
    summary: str,
    description: str,
    selected: str | None,
) -> None:
    """A command whose module lives in the checkout (benchmarks/, examples/): its own
    add_arguments and main, or a clear error outside a checkout. The module is imported only
    where `command` is the `selected` one."""
    parser = commands.add_parser(command, help=summary, description=description)
    if command != selected:
        return
    module = _from_checkout(module_name)
    if module is None:  # its options are unknown here: --help and any option say why
        parser.description = f"{description}. {_NOT_INSTALLED}"
        parser.set_defaults(func=_no_benchmarks)
    else:
        module.add_arguments(parser)
        parser.set_defaults(func=module.main)


def _from_checkout(name: str):  # noqa: ANN202
    """A module of the repository's benchmarks/ or examples/, or None outside a checkout (they
    are not installed with the package)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name not in (name, name.split(".")[0]):
            raise
        return None


_NOT_INSTALLED = (
    "The benchmarks and examples live in the repository's benchmarks/ and examples/ folders, "
    "which are not installed with the package: run this from the root of a checkout"
)


def _no_benchmarks(args: argparse.Namespace) -> None:
    raise SystemExit(f"{args.command}: {_NOT_INSTALLED[0].lower()}{_NOT_INSTALLED[1:]}")


def _print_env(args: argparse.Namespace) -> None:
    from fp8train.toolchain import report

    for key, value in report():
        print(f"{key}: {value}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word that is not an option (the top level has only --help).
    command = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser(command)
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.func is not _no_benchmarks:  # outside a checkout: say that instead
        parser.parse_args(argv)  # argparse's own error for the unknown options
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
