"""What is allocated at the peak of a step on the GPU: the CUDA caching allocator's memory
history over one call, replayed up to its highest point, grouped by the Python line that made
each live allocation and the step phase it was made in (forward, backward, optimizer).

Used by `benchmarks.profile_steps peak` (the end-to-end model's training step) and
`benchmarks.bench_memory --explain` (each cell of the memory table).
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Callable

import torch

MIB = 2**20
GIB = 2**30


def _phase(frames: list[dict]) -> str:
    """The part of a training step that made an allocation, from its Python frames: the
    autograd engine's entry (torch/autograd/graph.py) or a compiled backward means backward."""
    if any(f["name"] == "step" and "optim" in f["filename"] for f in frames):
        return "optimizer"
    if any("clip_grad" in f["filename"] for f in frames):
        return "clip"
    if any("backward" in f["name"] or f["filename"].endswith("graph.py") for f in frames):
        return "backward"
    return "forward"


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: its innermost Python frame, with that line's code (the
    compiled graphs' buffers show as the line of inductor's output code that makes them)."""
    for f in frames:
        if f["filename"].endswith(".py") and "/torch/cuda/" not in f["filename"]:
            code = linecache.getline(f["filename"], f["line"]).strip()[:90]
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}: {code}"
    return "(no Python frame)"


def live_at_peak(trace: list[dict]) -> tuple[list[dict], int]:
    """The allocations live when the bytes allocated over a memory-history `trace` (its
    alloc and free events) were highest, and that many bytes."""

    def replay(events: list[dict]) -> tuple[dict[int, dict], list[int]]:
        live: dict[int, dict] = {}
        totals, total = [], 0
        for event in events:
            if event["action"] == "alloc":
                live[event["addr"]] = event
                total += event["size"]
            elif event["action"] in ("free_requested", "free_completed"):
                gone = live.pop(event["addr"], None)
                total -= gone["size"] if gone else 0
            totals.append(total)
        return live, totals

    _, totals = replay(trace)
    best = max(totals, default=0)
    live, _ = replay(trace[: totals.index(best) + 1] if best else [])
    return list(live.values()), best


def print_peak(step: Callable[[], object], title: str, top: int = 30) -> None:
    """Run `step` once under CUDA memory history and print its peak: what was allocated
    before it, what it allocated up to its peak, and the allocations live there by phase
    and source line, largest first."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    at_peak, best = live_at_peak(trace)
    sites: dict[tuple[str, str], list[int]] = {}
    for event in at_peak:
        key = (_phase(event["frames"]), _site(event["frames"]))
        sites.setdefault(key, []).append(event["size"])
    print(
        f"\n##### peak {title}: {torch.cuda.max_memory_allocated() / GIB:.2f} GiB = "
        f"{before / GIB:.2f} GiB allocated before the step + "
        f"{best / GIB:.2f} GiB allocated in it; live at the peak, largest first:"
    )
    ranked = sorted(sites.items(), key=lambda item: -sum(item[1]))
    for (phase, site), sizes in ranked[:top]:
        print(f"{sum(sizes) / MIB:9.1f} MiB {len(sizes):4d}x {phase:9s} {site}")
