"""An inductor graph pass that leaves the saturation of fp8train's compiled casts to Triton.

A cast computes `clamp(hp * scale, -max, max).to(float8)`: the clamp is there because
torch's conversion turns an overflow into NaN (float8_e4m3fn has no inf). Triton's
conversion on CUDA saturates by itself (`cvt.rn.satfinite`: a finite value or an inf beyond
the range becomes the largest finite value of its sign, NaN stays NaN), so in the Triton code
inductor generates, the clamp only costs instructions: about nine PTX instructions per
element and cast (each NaN-propagating bound is two compares, an or and a select), in
kernels that fused casts make bound by instructions (benchmarks/kernel_instructions.py
counts them). This pass runs after the partitioner has chosen what backward keeps, so what
it keeps does not change; it drops the clamp in front of the conversion and nothing else, so
every float8 byte stays the same (tested bit for bit on the GPU).

It touches only the casts of fp8train's own code (told by their stack trace), on CUDA devices
where Triton converts to float8 with `satfinite` (sm_89 and later, not ROCm), and only where
the clamp's bounds are exactly the float8 type's range.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path

import torch
from torch import fx
from torch._inductor import config as inductor_config
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_PACKAGE = str(Path(__file__).parent)
_TAKES_A_SEQUENCE = hasattr(custom_graph_pass, "get_custom_graph_passes")
# Newer inductors run a list of post-grad passes, each on its own terms (inference-aware
# passes included); older ones run one, which ours then calls before its own work.
_aten = torch.ops.aten


def _is(node: object, *targets: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _bound(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _clamped(node: object, fp8_max: float) -> fx.Node | None:
    """The tensor that `node` clamps to [-fp8_max, fp8_max] (as clamp, or as clamp_min and
    clamp_max in either order), else None."""
    if _is(node, _aten.clamp.default) and len(node.args) == 3:
        low, high = _bound(node.args[1]), _bound(node.args[2])
        return node.args[0] if (low, high) == (-fp8_max, fp8_max) else None
    for outer, inner, outer_bound, inner_bound in (
        (_aten.clamp_max.default, _aten.clamp_min.default, fp8_max, -fp8_max),
        (_aten.clamp_min.default, _aten.clamp_max.default, -fp8_max, fp8_max),
    ):
        if (
            _is(node, outer)
            and _bound(node.args[1]) == outer_bound
            and _is(node.args[0], inner)
            and _bound(node.args[0].args[1]) == inner_bound
        ):
            return node.args[0].args[0]
    return None


def _from_fp8train(node: fx.Node) -> bool:
    return _PACKAGE in node.meta.get("stack_trace", "")


def _satfinite_device(node: fx.Node, any_device: bool) -> bool:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return False
    if any_device:
        return True
    device = value.device
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def _unclamped(graph: fx.Graph, node: fx.Node, before: fx.Node, fp8_max: float) -> fx.Node | None:
    """What to convert instead of `node`: its input without the saturating clamp, looking
    through a `where` (delayed scaling turns an inf into NaN with one); None if no clamp."""
    inner = _clamped(node, fp8_max)
    if inner is not None:
        return inner if _from_fp8train(node) else None
    if _is(node, _aten.where.self):
        condition, *branches = node.args
        new = [
            _unclamped(graph, b, before, fp8_max) if isinstance(b, fx.Node) else None
            for b in branches
        ]
        if all(n is None for n in new):
            return None
        kept = [n if n is not None else b for n, b in zip(new, branches, strict=True)]
        with graph.inserting_before(before):
            where = graph.call_function(_aten.where.self, (condition, *kept))
        where.meta = dict(node.meta)
        return where
    return None


def drop_saturation_before_float8(graph: fx.Graph, *, any_device: bool = False) -> int:
    """Rewrite `graph` in place (see the module docstring) and return how many conversions
    changed. `any_device`: rewrite whatever the device (for instruction counts made on a
    CPU, benchmarks/kernel_instructions.py); the result is then right only for Triton."""
    changed = 0
    for node in list(graph.nodes):
        if not (
            _is(node, torch.ops.prims.convert_element_type.default)
            and node.args[1] in FLOAT8_DTYPES
            and isinstance(node.args[0], fx.Node)
        ):
            continue
        source = node.args[0]
        if not _satfinite_device(source, any_device):
            continue
        new = _unclamped(graph, source, node, torch.finfo(node.args[1]).max)
        if new is not None:
            node.replace_input_with(source, new)
            changed += 1
    if changed:
        graph.eliminate_dead_code()
    return changed


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


class SatfinitePass(CustomGraphPass):
    """`drop_saturation_before_float8` as inductor's post-grad pass, run after `then` (on a
    torch whose inductor takes one post-grad pass only: the pass installed before ours)."""

    def __init__(self, then: CustomGraphPass | None = None, *, any_device: bool = False) -> None:
        self.then = then
        self.any_device = any_device

    def __call__(self, graph: fx.Graph) -> None:
        if self.then is not None:
            self.then(graph)
        drop_saturation_before_float8(graph, any_device=self.any_device)

    def uuid(self) -> str:
        # Inductor's FX graph cache keys compiled code on this: our source, and the pass
        # we run after.
        then = self.then.uuid() if self.then is not None else None
        return f"fp8train-satfinite-{_source_hash()}-{self.any_device}-{then}"


def _others() -> tuple[list, type | None]:
    """The post-grad passes installed now other than ours (a pass ours wraps included), and
    the type of sequence they are held in (None: a single pass)."""
    current = inductor_config.post_grad_custom_post_pass
    sequence = type(current) if isinstance(current, (list, tuple)) else None
    others = []
    for entry in current if sequence else [current]:
        while isinstance(entry, SatfinitePass):
            entry = entry.then
        if entry is not None:
            others.append(entry)
    return others, sequence


def install_satfinite_pass(*, any_device: bool = False) -> None:
    """Make `SatfinitePass` one of inductor's post-grad passes, process-wide, run after the
    passes installed before it. Once: a pass of ours already there stays, unless
    `any_device` asks for the forced one (benchmarks/kernel_instructions.py), which then
    stays in its turn. Where another pass cannot run before ours (an inductor that takes one
    pass, and that one a plain function), ours is not installed and a warning says why."""
    current = inductor_config.post_grad_custom_post_pass
    entries = current if isinstance(current, (list, tuple)) else [current]
    ours = [entry for entry in entries if isinstance(entry, SatfinitePass)]
    if ours and (ours[0].any_device or not any_device):
        return
    others, sequence = _others()
    new = SatfinitePass(any_device=any_device)
    if not others:
        inductor_config.post_grad_custom_post_pass = new
    elif _TAKES_A_SEQUENCE:
        inductor_config.post_grad_custom_post_pass = (sequence or list)([*others, new])
    elif len(others) == 1 and isinstance(others[0], CustomGraphPass):
        new.then = others[0]
        inductor_config.post_grad_custom_post_pass = new
    else:
        warnings.warn(
            "fp8train: torch._inductor.config.post_grad_custom_post_pass holds a pass that is "
            "not a CustomGraphPass, and this torch's inductor runs one pass only, so fp8train "
            "cannot run its own after it: compiled casts keep their clamp (same numbers, a "
            "little slower). Make that pass a torch._inductor.custom_graph_pass."
            "CustomGraphPass to have both.",
            stacklevel=2,
        )


def uninstall_satfinite_pass() -> None:
    """Undo install_satfinite_pass, leaving the other passes installed."""
    others, sequence = _others()
    if sequence is not None:
        inductor_config.post_grad_custom_post_pass = sequence(others) if others else None
    else:
        inductor_config.post_grad_custom_post_pass = others[0] if others else None
