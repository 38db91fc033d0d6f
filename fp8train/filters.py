"""A ready `module_filter_fn` that leaves out the layers too small for float8 to pay.

    from fp8train.filters import auto_filter
    convert_to_float8_training(model, module_filter_fn=auto_filter(tokens=batch * seq_len))

It models the fwd+bwd time of each nn.Linear (M tokens, K in, N out) in high precision and in
float8 and converts the layer where float8 is modelled faster by `margin`:

    high precision  3 gemms of 2*M*K*N FLOPs at HP_FLOPS; eager mode, at least
                    EAGER_HP_CPU_S of host time per layer
    float8          the gemms whose operands are cast at FP8_FLOPS (the others at HP_FLOPS),
                    plus the bytes the casts move at CAST_BYTES_PER_S: per cast, the amax
                    read, the cast read and one float8 write per layout; eager mode also pays
                    EAGER_CPU_S of host time per layer, and the step takes the longer of the
                    host's and the GPU's time

The constants are fitted to the H200 measurements of benchmarks/results/
(linear_h200_2026-12-03.md, torch 2.11, bf16): the three bf16 gemms of the LLaMA-70B shapes
run at 630-680 TFLOP/s, the float8 gemms at ~1500, the casts' traffic at ~1.6 TB/s, and an eager
Float8Linear costs ~1.9 ms of host time per fwd+bwd (which is why eager float8 loses on thin
layers and on small models: the demo's 56 layers take ~110 ms a step). That host time was
measured before the eager fast path (fp8train.eager), which takes a quarter to a third of it
away on an H100 (benchmarks/results/eager_path_h100_2026-12-07.md), and the host's share
depends on the host more than on the GPU. For eager models, measure it on the machine that
trains:

    costs = CostModel.measure_host()       # ~1 s: a small layer's fwd+bwd, both precisions
    keep = auto_filter(batch * seq_len, compiled=False, model=costs)
    convert_to_float8_training(model, module_filter_fn=keep)

On other GPUs the other constants are a guess: pass your own, or measure with
`python -m fp8train bench-linear`.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from fp8train.cast import cast_key
from fp8train.config import (
    GEMM_OPERANDS,
    ROLE_GEMMS,
    Float8LinearConfig,
    Gemm,
    Role,
    config_or_default,
)
from fp8train.linear import Float8Linear

HP_BYTES = 2  # bf16 activations and weights


@dataclass(frozen=True)
class CostModel:
    hp_flops: float = 670e12
    """The high-precision gemms' rate, FLOP/s."""
    fp8_flops: float = 1500e12
    """The float8 gemms' rate, FLOP/s."""
    cast_bytes_per_s: float = 1.6e12
    """The casts' memory traffic (amax reads, cast reads, float8 writes), bytes/s."""
    eager_cpu_s: float = 1.9e-3
    """Host time of an eager Float8Linear's fwd+bwd, seconds: an H200 host's before the eager
    fast path. `measure_host` measures this host's."""
    eager_hp_cpu_s: float = 0.2e-3
    """Host time of an eager nn.Linear's fwd+bwd, seconds (an H100 host's)."""
    compiled_overhead_s: float = 20e-6
    """What a compiled float8 layer adds to its GPU time, seconds."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            rate = field.name.endswith(("_flops", "_per_s"))  # divided by: must not be 0
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < 0
                or (rate and value == 0)
            ):
                raise ValueError(
                    f"CostModel.{field.name}={value!r}: give a finite number, "
                    + ("above 0 (a rate)" if rate else "0 or more (seconds)")
                )

    @classmethod
    def measure_host(
        cls,
        device: torch.device | str | None = None,
        *,
        config: Float8LinearConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
        steps: int = 200,
        **constants: float,
    ) -> CostModel:
        """A CostModel whose eager host times are measured here: the wall-clock time of a
        256 x 256 x 256 layer's fwd+bwd (Float8Linear with `config`, and nn.Linear), where the
        GPU work is too small to matter, so the step takes what the host needs to issue it.
        `device`: the current CUDA device by default. `constants`: the other fields."""
        if device is None:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "CostModel.measure_host() measures the host time of eager layers on a GPU "
                    "and none is available: pass device= to measure elsewhere, or use "
                    "CostModel(eager_cpu_s=..., eager_hp_cpu_s=...)"
                )
            device = torch.device("cuda", torch.cuda.current_device())
        base = nn.Linear(256, 256, bias=False, device=device, dtype=dtype)
        float8 = Float8Linear.from_float(copy.deepcopy(base), config_or_default(config))
        x = torch.randn(256, 256, device=device, dtype=dtype, requires_grad=True)
        return replace(
            cls(**constants),
            eager_cpu_s=host_seconds_per_step(float8, x, steps),
            eager_hp_cpu_s=host_seconds_per_step(base, x, steps),
        )

    def hp_time(self, m: int, k: int, n: int) -> float:
        return 3 * 2 * m * k * n / self.hp_flops

    def high_precision_time(self, m: int, k: int, n: int, compiled: bool) -> float:
        gpu = self.hp_time(m, k, n)
        return gpu if compiled else max(gpu, self.eager_hp_cpu_s)

    def float8_time(
        self, m: int, k: int, n: int, config: Float8LinearConfig, compiled: bool
    ) -> float:
        gemm_time = 0.0
        for gemm in Gemm:
            cast = all(cast_key(config, role, gemm) is not None for role in GEMM_OPERANDS[gemm])
            gemm_time += 2 * m * k * n / (self.fp8_flops if cast else self.hp_flops)
        gpu = gemm_time + _cast_bytes(m, k, n, config) / self.cast_bytes_per_s
        if compiled:
            return gpu + self.compiled_overhead_s
        return max(gpu, self.eager_cpu_s)


def host_seconds_per_step(layer: nn.Module, x: torch.Tensor, steps: int) -> float:
    """Wall-clock seconds per fwd+bwd of `layer` on `x`: the median of five blocks of
    steps // 5, after a warm-up. On a GPU, for a layer this small, the host's time."""

    def block(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            layer(x).sum().backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        return (time.perf_counter() - start) / n

    block(20)
    return statistics.median(block(max(1, steps // 5)) for _ in range(5))


def _cast_bytes(m: int, k: int, n: int, config: Float8LinearConfig) -> float:
    sizes = {Role.INPUT: m * k, Role.WEIGHT: n * k, Role.GRAD_OUTPUT: m * n}
    total = 0.0
    for role, gemms in ROLE_GEMMS.items():
        keys = [cast_key(config, role, gemm) for gemm in gemms]
        casts = [key for key in keys if key is not None]
        if not casts:
            continue
        # One shared cast: amax + read + a float8 write per layout; else a full cast each.
        distinct = 1 if len(casts) == 2 and casts[0] == casts[1] else len(casts)
        per_cast = 2 * HP_BYTES + (len(casts) if distinct == 1 else 1)
        passes = distinct
        shared_by_two = len(casts) == 2 and distinct == 1
        if role is Role.WEIGHT and config.recompute_weight_cast and shared_by_two:
            passes, per_cast = 2, 2 * HP_BYTES + 1  # recast in backward
        total += passes * per_cast * sizes[role]
    return total


def auto_filter(
    tokens: int,
    *,
    config: Float8LinearConfig | None = None,
    compiled: bool = True,
    margin: float = 1.05,
    model: CostModel | None = None,
    also: Callable[[nn.Module, str], bool] | None = None,
) -> Callable[[nn.Module, str], bool]:
    """A `module_filter_fn` for `convert_to_float8_training`: True (convert) for the linear
    layers whose modelled float8 fwd+bwd is at least `margin` times faster than high
    precision at `tokens` tokens per step (batch * sequence length per micro-batch).
    `compiled`: whether the model runs under torch.compile (eager float8 layers carry a host
    cost of their own). `also`: a second filter that must agree (say, to leave out lm_head)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise ValueError(
            f"auto_filter(tokens={tokens!r}): give the tokens per step, a positive int "
            "(batch size * sequence length of one micro-batch)"
        )
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or margin <= 0:
        raise ValueError(f"auto_filter(margin={margin!r}): give a positive number, such as 1.05")
    if model is not None and not isinstance(model, CostModel):
        raise TypeError(f"auto_filter(model=...) takes a CostModel, got a {type(model).__name__}")
    config = config_or_default(config)
    model = model or CostModel()

    def keep(module: nn.Module, fqn: str) -> bool:
        if also is not None and not also(module, fqn):
            return False
        k, n = module.in_features, module.out_features
        hp = model.high_precision_time(tokens, k, n, compiled)
        return hp >= margin * model.float8_time(tokens, k, n, config, compiled)

    return keep
