"""Byte-level English text that ships with every Python install, so the demo needs no download.

The main source is the Python reference documentation in `pydoc_data.topics` (~465 KB), which
some distributions strip out; then the source of a few stdlib modules stands in for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch

VOCAB_SIZE = 256  # one token per byte value


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


def load_text_tokens() -> torch.Tensor:
    """The whole corpus as a 1-D long tensor of UTF-8 byte values in [0, 256)."""
    data = bytearray(load_text().encode("utf-8"))
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
