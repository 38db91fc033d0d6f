"""Numerics monitoring: what each float8 cast did, per layer, on the steps you choose.

    from fp8train import stats
    with stats.record(model) as recorder:     # wrap a sampled step, eager mode
        loss = loss_fn(model(batch)); loss.backward()
    print(recorder.table())

Off, it costs one `is None` test per layer and forward. On, each cast also computes its stats
(a few reductions over the tensor, synchronizing with the GPU): sample steps, do not record all.
Compiled modules are not recorded (the stats would break the graph): record a step of the
uncompiled module, which shares the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch import nn

from fp8train.config import Gemm, Role
from fp8train.numerics import compute_error
from fp8train.tensor import Float8Tensor


@dataclasses.dataclass(frozen=True)
class CastStats:
    """One cast of one layer."""

    layer: str
    role: str
    gemm: str
    float8_dtype: str
    amax: float
    """max |hp|."""
    scale: float
    """The scale (hp -> float8); rowwise: the smallest, that of the row with the largest amax."""
    saturated: float
    """Share of elements whose scaled value exceeded the float8 maximum and was clamped."""
    flushed: float
    """Share of non-zero elements that became zero in float8 (underflow)."""
    sqnr_db: float
    """SQNR of the dequantized float8 tensor against the hp tensor."""


class StatsRecorder:
    """Collects a CastStats for every cast of the recorded steps."""

    def __init__(self) -> None:
        self.records: list[CastStats] = []

    @torch.no_grad()
    def observe(
        self, layer: str, role: Role, gemm: Gemm, hp: torch.Tensor, fp8: Float8Tensor
    ) -> None:
        hp32 = hp.float()
        fp8_max = torch.finfo(fp8.fp8_dtype).max
        numel = max(hp.numel(), 1)
        self.records.append(
            CastStats(
                layer=layer,
                role=Role(role).value,
                gemm=Gemm(gemm).value,
                float8_dtype=str(fp8.fp8_dtype).removeprefix("torch.float8_"),
                amax=hp32.abs().max().item() if hp.numel() else 0.0,
                scale=fp8._scale.min().item(),
                saturated=((hp32 * fp8.broadcast_scale()).abs() > fp8_max).sum().item() / numel,
                flushed=((hp32 != 0) & (fp8._data.float() == 0)).sum().item() / numel,
                sqnr_db=compute_error(hp32, fp8.to_hp(torch.float32)).item(),
            )
        )

    def rows(self) -> list[dict]:
        return [dataclasses.asdict(record) for record in self.records]

    def table(self) -> str:
        """A markdown table, one row per cast."""
        if not self.records:
            return (
                "no float8 casts recorded: run a forward (and backward) of the uncompiled "
                "model inside stats.record(model)"
            )
        lines = [
            "| layer | role | gemm | dtype | amax | scale | saturated % | flushed % | SQNR dB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.records:
            lines.append(
                f"| {r.layer} | {r.role} | {r.gemm} | {r.float8_dtype} | {r.amax:.4g} | "
                f"{r.scale:.4g} | {100 * r.saturated:.3g} | {100 * r.flushed:.3g} | "
                f"{r.sqnr_db:.1f} |"
            )
        return "\n".join(lines)


@contextlib.contextmanager
def record(model: nn.Module) -> Iterator[StatsRecorder]:
    """Record the stats of every float8 cast of `model`'s Float8Linear layers while inside."""
    from fp8train.linear import Float8Linear

    layers = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
    if not layers:
        raise ValueError(
            "stats.record: the model has no Float8Linear layer: convert it with "
            "convert_to_float8_training first"
        )
    recorder = StatsRecorder()
    for fqn, layer in layers:
        layer._observer = functools.partial(recorder.observe, layer.fqn or fqn)
    try:
        yield recorder
    finally:
        for _, layer in layers:
            layer._observer = None
