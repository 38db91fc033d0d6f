"""What is allocated at the peak of a step on the GPU: the CUDA caching allocator's memory
history over one call, replayed up to its highest point, grouped by the Python line that made
each live allocation and the step phase it was made in (forward, backward, optimizer). On the
CPU, the same from the profiler's record of the CPU allocator (`cpu_step_memory`).

Used by `benchmarks.profile_steps peak` (the end-to-end model's training step) and
`benchmarks.bench_memory --explain` (each cell of the memory table).
"""

from __future__ import annotations

import itertools
import linecache
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._C import _profiler
from torch.profiler import ProfilerActivity, profile

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


BACKWARD_MARK = "memory_trace.backward"
"""Wrap a step's backward in `torch.profiler.record_function(BACKWARD_MARK)` for
`cpu_step_memory` to tell what forward left for it."""


@dataclass
class CpuStep:
    """What one step allocated on the CPU, from the CPU allocator's events."""

    peak: int
    """The highest the step's live bytes rose above where they started."""
    held: int
    """The step's live bytes when backward began (BACKWARD_MARK): what forward left."""
    at_peak: list[tuple[int, str, str]]
    """(bytes, phase, the operator that allocated them) of each block live at the peak."""


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the storages behind `tensors`, each counted once (views share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


CPU_SCRATCH_OPS = ("aten::_scaled_mm",)
"""Operators whose CPU kernels allocate scratch that their GPU kernels do not: the CPU's
float8 gemm upcasts both operands and its output to fp32 (cuBLAS needs none of that)."""


def cpu_step_memory(step: Callable[[], object]) -> CpuStep:
    """Run `step` once under the profiler's memory tracking and replay the CPU allocator's
    events: the CPU's counterpart of `torch.cuda.max_memory_allocated` for one step, less
    the scratch of CPU_SCRATCH_OPS (a block allocated and freed inside one call of them).
    Blocks allocated before the step and freed in it are not seen (the allocator reports
    frees only of blocks it saw allocated), so the step should free none it needs counted."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # (time, bytes, address, operator, the CPU_SCRATCH_OPS call it is inside, if any)
    events: list[tuple[int, int, int, str, int | None]] = []
    backward_start: list[int] = []

    def walk(nodes: list, op: str, scratch_call: int | None) -> None:
        for node in nodes:
            if isinstance(node.extra_fields, _profiler._ExtraFields_Allocation):
                fields = node.extra_fields
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr, op, scratch_call))
                continue
            if node.name == BACKWARD_MARK:
                backward_start.append(node.start_time_ns)
            inner = id(node) if node.name in CPU_SCRATCH_OPS else scratch_call
            walk(node.children, node.name, inner)

    walk(prof.profiler.kineto_results.experimental_event_tree(), "(no operator)", None)
    events.sort(key=lambda event: event[0])
    scratch: set[int] = set()
    allocated_in: dict[int, tuple[int, int | None]] = {}
    for i, (_, size, address, _, call) in enumerate(events):
        if size > 0:
            allocated_in[address] = (i, call)
        elif address in allocated_in:
            j, alloc_call = allocated_in.pop(address)
            if call is not None and alloc_call == call:
                scratch.update((i, j))
    events = [e for i, e in enumerate(events) if i not in scratch]
    mark = min(backward_start, default=None)
    totals = [0, *itertools.accumulate(e[1] for e in events)]
    peak = max(totals)
    # Live bytes just before backward's first allocation (all of them without the mark).
    held = totals[next((i for i, e in enumerate(events) if mark is not None and e[0] >= mark), -1)]
    live: dict[int, tuple[int, int, str]] = {}
    for time, size, address, op, _ in events[: totals.index(peak)]:
        if size > 0:
            live[address] = (time, size, op)
        else:
            live.pop(address, None)
    at_peak = [
        (size, "backward" if mark is not None and time >= mark else "forward", op)
        for time, size, op in live.values()
    ]
    return CpuStep(peak, held, at_peak)
