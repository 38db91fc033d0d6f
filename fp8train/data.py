"""Byte-level text that ships with every Python install, so the demo and the examples need no
download.

Two corpora:
    docs    the Python reference documentation in `pydoc_data.topics` (~465 KB), which some
            distributions strip out; then the source of a few stdlib modules stands in for it.
            Enough for the demo's small model; a billion-parameter model trained on it for a
            few hundred steps sees it several times over and memorizes it.
    stdlib  the docs, then every Python source file of the standard library (tests and
            site-packages left out), in path order: ~12 MB on CPython 3.11, so that a few
            hundred steps of 8k tokens stay within one pass over the training text.
"""

from __future__ import annotations

import inspect
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB_SIZE = 256  # one token per byte value
CORPORA = ("docs", "stdlib")
_NOT_STDLIB = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def load_text() -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        import argparse
        import collections
        import dataclasses
        import typing

        modules = (argparse, collections, dataclasses, inspect, typing)
        return "\n".join(inspect.getsource(m) for m in modules)
    # Sorted so the text, and therefore the split, does not depend on dict order.
    return "\n\n".join(topics[name] for name in sorted(topics))


def stdlib_sources() -> list[Path]:
    """The standard library's Python files, in path order (tests, site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if not _NOT_STDLIB & set(p.relative_to(root).parts))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_text_tokens(corpus: str = "docs") -> torch.Tensor:
    """The whole corpus (see the module's docstring) as a 1-D long tensor of UTF-8 byte values
    in [0, 256)."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus={corpus!r} is not one of {CORPORA}")
    data = bytearray(load_text().encode("utf-8"))
    if corpus == "stdlib":
        sources = stdlib_sources()
        if not sources:
            raise RuntimeError(
                f"this Python ships no standard-library sources under "
                f"{sysconfig.get_paths()['stdlib']} (only compiled files): use corpus='docs'"
            )
        for path in sources:
            data += b"\n\n" + path.read_bytes()
    # Embedding lookups need int64 indices; the corpus is small enough to widen up front.
    return torch.frombuffer(data, dtype=torch.uint8).long()


def train_val_split(
    tokens: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous split, last `val_fraction` for validation: a random split of overlapping
    windows would leak validation text into training."""
    n_train = int(len(tokens) * (1 - val_fraction))
    return tokens[:n_train], tokens[n_train:]


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (B, T) and targets (B, T), the same windows shifted by one."""
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless training batches. Two generators seeded alike give identical streams, which is how
    two models trained one after the other see the same data."""
    while True:
        yield sample_batch(tokens, batch_size, seq_len, generator)


def eval_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: non-overlapping windows evenly spread over `tokens`, so every
    run is scored on exactly the same text without needing a generator."""
    n_windows = batch_size * n_batches
    if len(tokens) < n_windows * (seq_len + 1):
        raise ValueError(f"{len(tokens)} tokens cannot hold {n_windows} windows of {seq_len + 1}")
    starts = torch.linspace(0, len(tokens) - seq_len - 1, n_windows).long().tolist()
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts])
    # Cloned so that each batch owns its storage, laid out like a training batch.
    return [(w[:, :-1], w[:, 1:]) for w in (c.clone() for c in windows.split(batch_size))]
