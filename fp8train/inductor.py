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
the clamp's bounds are exactly the float8 type's range. In delayed scaling's casts it also
writes the `where` that turns an inf into NaN as an add of `hp * 0` (NaN for an inf, a zero
of hp's sign otherwise): the same values in two instructions instead of about nine.
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

from fp8train.config import FLOAT8_DTYPES

_PACKAGE = str(Path(__file__).parent)
_TAKES_A_SEQUENCE = hasattr(custom_graph_pass, "get_custom_graph_passes")
# Newer inductors run a list of post-grad passes, each on its own terms (inference-aware
# passes included); older ones run one, which ours then calls before its own work.
_aten = torch.ops.aten
_prims = torch.ops.prims


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
            wide = _inf_to_nan_of(condition, *kept)
            if wide is not None:
                # scaled + wide * 0: wide * 0 is NaN for an inf and a zero of wide's sign
                # otherwise, which adds nothing to scaled (of the same sign: the scale is
                # positive), -0.0 included. Two instructions instead of about nine.
                zero = graph.call_function(_aten.mul.Tensor, (wide, 0.0))
                out = graph.call_function(_aten.add.Tensor, (kept[1], zero))
                zero.meta = dict(node.meta)
            else:
                out = graph.call_function(_aten.where.self, (condition, *kept))
        out.meta = dict(node.meta)
        return out
    return None


def _inf_to_nan_of(condition: object, if_inf: object, otherwise: object) -> fx.Node | None:
    """`wide` if the where `(condition, if_inf, otherwise)` is delayed scaling's
    `where(isinf(hp), abs(wide - wide), wide * scale)` (fp8train.cast, `wide` hp or its fp32
    copy), else None."""
    if not (
        _is(condition, _aten.isinf.default)
        and _is(if_inf, _aten.abs.default)
        and _is(if_inf.args[0], _aten.sub.Tensor)
        and _is(otherwise, _aten.mul.Tensor)
    ):
        return None
    hp, (left, right) = condition.args[0], if_inf.args[0].args[:2]
    if left is not right or left not in otherwise.args[:2]:
        return None
    if left is not hp and not (
        _is(left, _prims.convert_element_type.default) and left.args[0] is hp
    ):
        return None
    return left


def drop_saturation_before_float8(graph: fx.Graph, *, any_device: bool = False) -> int:
    """Rewrite `graph` in place (see the module docstring) and return how many conversions
    changed. `any_device`: rewrite whatever the device (for instruction counts made on a
    CPU, benchmarks/kernel_instructions.py); the result is then right only for Triton."""
    changed = 0
    for node in list(graph.nodes):
        if not (
            _is(node, _prims.convert_element_type.default)
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


_MAGNITUDE_BITS = 0x7FFFFFFF
"""An fp32 value's bits without its sign."""


def amax_as_integer_max(graph: fx.Graph) -> int:
    """Rewrite each `amax(abs(x))` of fp8train's code in `graph` as the maximum of x's fp32
    bits with the sign bit cleared, compared as integers, and return how many changed.
    Without their sign, fp32 bits order as magnitudes do, +0 through inf, and every NaN
    above inf: the integer maximum is the float maximum, NaN propagating, in one compare
    and select instead of the float maximum's two compares, or and select (inductor's
    NaN-propagating maximum). Exact on any device."""
    changed = 0
    for node in list(graph.nodes):
        if not (_is(node, _aten.amax.default) and _is(node.args[0], _aten.abs.default)):
            continue
        absolute = node.args[0]
        x = absolute.args[0]
        value, result = x.meta.get("val"), node.meta.get("val")
        if not (
            _from_fp8train(absolute)
            and isinstance(value, torch.Tensor)
            and isinstance(result, torch.Tensor)
            and value.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ):
            continue
        wide_value, wide_result = value.to(torch.float32), result.to(torch.float32)
        with graph.inserting_before(node):
            wide = x
            if value.dtype != torch.float32:
                wide = graph.call_function(_prims.convert_element_type.default, (x, torch.float32))
                wide.meta["val"] = wide_value
            bits = graph.call_function(_aten.view.dtype, (wide, torch.int32))
            magnitude = graph.call_function(_aten.bitwise_and.Scalar, (bits, _MAGNITUDE_BITS))
            largest = graph.call_function(_aten.amax.default, (magnitude, *node.args[1:]))
            as_float = graph.call_function(_aten.view.dtype, (largest, torch.float32))
            out = as_float
            if result.dtype != torch.float32:
                out = graph.call_function(
                    _prims.convert_element_type.default, (as_float, result.dtype)
                )
                out.meta["val"] = result
        bits.meta["val"] = magnitude.meta["val"] = wide_value.view(torch.int32)
        largest.meta["val"] = wide_result.view(torch.int32)
        as_float.meta["val"] = wide_result
        for new in (bits, magnitude, largest, as_float, out, wide):
            new.meta.setdefault("stack_trace", absolute.meta.get("stack_trace", ""))
        node.replace_all_uses_with(out)
        changed += 1
    if changed:
        graph.eliminate_dead_code()
    return changed


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


class SatfinitePass(CustomGraphPass):
    """fp8train's post-grad pass: `drop_saturation_before_float8` (with `satfinite`) and
    `amax_as_integer_max` (with `integer_amax`), run after `then` (on a torch whose inductor
    takes one post-grad pass only: the pass installed before ours)."""

    def __init__(
        self,
        then: CustomGraphPass | None = None,
        *,
        any_device: bool = False,
        integer_amax: bool = False,
        satfinite: bool = True,
    ) -> None:
        self.then = then
        self.any_device = any_device
        self.integer_amax = integer_amax
        self.satfinite = satfinite

    def __call__(self, graph: fx.Graph) -> None:
        if self.then is not None:
            self.then(graph)
        if self.satfinite:
            drop_saturation_before_float8(graph, any_device=self.any_device)
        if self.integer_amax:
            amax_as_integer_max(graph)

    def covers(self, *, any_device: bool, integer_amax: bool, satfinite: bool) -> bool:
        return all(
            mine or not asked
            for mine, asked in (
                (self.any_device, any_device),
                (self.integer_amax, integer_amax),
                (self.satfinite, satfinite),
            )
        )

    def uuid(self) -> str:
        # Inductor's FX graph cache keys compiled code on this: our source, our options and
        # the pass we run after.
        then = self.then.uuid() if self.then is not None else None
        options = f"{self.any_device}-{self.integer_amax}-{self.satfinite}"
        return f"fp8train-satfinite-{_source_hash()}-{options}-{then}"


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


def install_satfinite_pass(
    *, any_device: bool = False, integer_amax: bool = False, satfinite: bool = True
) -> None:
    """Make `SatfinitePass` one of inductor's post-grad passes, process-wide, run after the
    passes installed before it. Once: a pass of ours already there stays, unless it lacks
    something this call asks for (`any_device`: the forced pass of
    benchmarks/kernel_instructions.py; `integer_amax`; `satfinite`), and then one that does
    what both ask replaces it. Where another pass cannot run before ours (an inductor that
    takes one pass, and that one a plain function), ours is not installed and a warning says
    why."""
    current = inductor_config.post_grad_custom_post_pass
    entries = current if isinstance(current, (list, tuple)) else [current]
    ours = [entry for entry in entries if isinstance(entry, SatfinitePass)]
    if ours and ours[0].covers(
        any_device=any_device, integer_amax=integer_amax, satfinite=satfinite
    ):
        return
    if ours:
        any_device = any_device or ours[0].any_device
        integer_amax = integer_amax or ours[0].integer_amax
        satfinite = satfinite or ours[0].satfinite
    others, sequence = _others()
    new = SatfinitePass(any_device=any_device, integer_amax=integer_amax, satfinite=satfinite)
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


def install_pass_for(config: object) -> None:
    """install_satfinite_pass with what a Float8LinearConfig asks of it (its
    compiled_satfinite and compiled_integer_amax); nothing if it asks for neither."""
    if config.compiled_satfinite or config.compiled_integer_amax:
        install_satfinite_pass(
            integer_amax=config.compiled_integer_amax, satfinite=config.compiled_satfinite
        )


def uninstall_satfinite_pass() -> None:
    """Undo install_satfinite_pass, leaving the other passes installed."""
    others, sequence = _others()
    if sequence is not None:
        inductor_config.post_grad_custom_post_pass = sequence(others) if others else None
    else:
        inductor_config.post_grad_custom_post_pass = others[0] if others else None
