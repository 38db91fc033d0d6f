"""Configuration of float8 training: frozen dataclasses and string enums.

A Float8Linear runs three gemms, and each gemm has two float8 operands:

    gemm          operands                      shapes (M = tokens, K = in, N = out)
    output        input       @ weight.T        (M, K) x (K, N)
    grad_input    grad_output @ weight          (M, N) x (N, K)
    grad_weight   grad_output.T @ input         (N, M) x (M, K)

Every operand is described by a `CastConfig`. A role (input, weight, grad_output) has one
cast config that both of its gemms use unless a per-gemm override is given.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Iterable
from typing import Literal

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FLOAT8_DTYPES = (E4M3, E5M2)
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ScalingType(str, enum.Enum):
    """How an operand's scale is chosen."""

    DYNAMIC = "dynamic"
    """The scale comes from the amax of the tensor being cast, computed just before the cast."""

    DELAYED = "delayed"
    """The scale comes from the amax history of earlier steps, kept in the layer's buffers and
    updated once per step by sync_float8_amax_and_scale_history(model). Tensorwise only."""

    STATIC = "static"
    """A fixed scale given in CastConfig.static_scale. Tensorwise only."""

    DISABLED = "disabled"
    """No float8 cast: the operand stays in high precision and its gemm runs in high precision."""


class ScalingGranularity(str, enum.Enum):
    """How many scales an operand carries."""

    TENSORWISE = "tensorwise"
    """One scale for the whole tensor."""

    ROWWISE = "rowwise"
    """One scale per row of the gemm operand, taken along the gemm's inner (reduction) dim."""

    AXISWISE = "rowwise"
    """torchao.float8's name for ROWWISE (an alias: the same member)."""

    BLOCKWISE = "blockwise"
    """One scale per block (DeepSeek-V3's recipe): activations and gradients 1 x 128 along the
    gemm's inner dim, the weight 128 x 128. Dims must be multiples of 128."""


BLOCK = 128
"""The block edge of blockwise scaling."""


class Role(str, enum.Enum):
    """Which tensor of the linear layer is being cast."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


class Gemm(str, enum.Enum):
    """The three matmuls of a linear layer's forward and backward."""

    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"


# The two roles each gemm multiplies, in (a, b) order.
GEMM_OPERANDS: dict[Gemm, tuple[Role, Role]] = {
    Gemm.OUTPUT: (Role.INPUT, Role.WEIGHT),
    Gemm.GRAD_INPUT: (Role.GRAD_OUTPUT, Role.WEIGHT),
    Gemm.GRAD_WEIGHT: (Role.GRAD_OUTPUT, Role.INPUT),
}

# The two gemms each role is an operand of.
ROLE_GEMMS: dict[Role, tuple[Gemm, Gemm]] = {
    Role.INPUT: (Gemm.OUTPUT, Gemm.GRAD_WEIGHT),
    Role.WEIGHT: (Gemm.OUTPUT, Gemm.GRAD_INPUT),
    Role.GRAD_OUTPUT: (Gemm.GRAD_INPUT, Gemm.GRAD_WEIGHT),
}

# e4m3 has more mantissa for values, e5m2 more range for gradients.
_DEFAULT_DTYPE: dict[Role, torch.dtype] = {
    Role.INPUT: E4M3,
    Role.WEIGHT: E4M3,
    Role.GRAD_OUTPUT: E5M2,
}


_FP32_TINY, _FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def parse_enum(enum_type: type[enum.Enum], value: object) -> enum.Enum:
    """`value` as a member of `enum_type` (the member or its value); a ValueError listing the
    choices otherwise."""
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(
            f"{value!r} is not a {enum_type.__name__}: choose one of {choices}"
        ) from None


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """How one operand is cast to float8."""

    scaling_type: ScalingType = ScalingType.DYNAMIC
    """dynamic (scale from this tensor's amax) or disabled (keep high precision)."""

    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    """tensorwise (one scale) or rowwise (one scale per row along the gemm's inner dim)."""

    target_dtype: torch.dtype | None = None
    """float8_e4m3fn or float8_e5m2; None picks the role's default (e4m3, grad_output e5m2)."""

    static_scale: float | None = None
    """The scale (hp -> float8) of scaling_type 'static'."""

    def __post_init__(self) -> None:
        # Accept the enums' string values, as a config read from YAML or a CLI would give them.
        object.__setattr__(self, "scaling_type", parse_enum(ScalingType, self.scaling_type))
        object.__setattr__(
            self, "scaling_granularity", parse_enum(ScalingGranularity, self.scaling_granularity)
        )
        stateful = self.scaling_type in (ScalingType.DELAYED, ScalingType.STATIC)
        if stateful and self.scaling_granularity is not ScalingGranularity.TENSORWISE:
            raise ValueError(
                f"scaling_type={self.scaling_type.value} keeps one scale per tensor: use "
                "scaling_granularity='tensorwise', or dynamic scaling for rowwise and blockwise"
            )
        if self.scaling_type is ScalingType.STATIC:
            scale = self.static_scale
            if scale is not None and (not isinstance(scale, numbers.Real) or scale is True):
                raise TypeError(
                    f"CastConfig.static_scale={scale!r}: give a number, such as float8's "
                    "largest value / the expected amax"
                )
            # The scale is an fp32 tensor: outside fp32's normal range it would round to 0 or
            # inf (a NaN output), or its inverse would.
            if scale is None or not _FP32_TINY <= scale <= _FP32_MAX:
                raise ValueError(
                    f"scaling_type='static' needs a finite, positive static_scale within "
                    f"float32's range ({_FP32_TINY:.3g} to {_FP32_MAX:.3g}), which the cast "
                    f"stores it in; got {scale!r}"
                )
        elif self.static_scale is not None:
            raise ValueError(
                f"static_scale={self.static_scale} is given but scaling_type is "
                f"{self.scaling_type.value}: set scaling_type='static', or drop static_scale"
            )
        if self.target_dtype is not None and self.target_dtype not in FLOAT8_DTYPES:
            raise ValueError(
                f"CastConfig.target_dtype={self.target_dtype} is not a float8 dtype: use "
                "torch.float8_e4m3fn, torch.float8_e5m2, or None for the role's default"
            )

    @property
    def enabled(self) -> bool:
        return self.scaling_type is not ScalingType.DISABLED

    def resolved(self, role: Role) -> CastConfig:
        """This config with the role's default dtype filled in."""
        if self.target_dtype is not None:
            return self
        return dataclasses.replace(self, target_dtype=_DEFAULT_DTYPE[role])


_SCALAR_FIELDS = {"bool": (bool, "True or False"), "int": (int, "an int")}


def _check_scalar_fields(config: object) -> None:
    """Raise a TypeError naming the field for a bool or int option given another type (a
    string, a float: an `if` would take "no" as True, a buffer of 2.5 steps would fail far
    from the config)."""
    for field in dataclasses.fields(config):
        kind, allowed = _SCALAR_FIELDS.get(field.type.removesuffix(" | None"), (None, ""))
        if kind is None:
            continue
        value = getattr(config, field.name)
        optional = field.type.endswith(" | None")
        # isinstance(True, int) holds: an int option refuses bools.
        if (value is None and optional) or (
            isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        ):
            continue
        raise TypeError(
            f"{type(config).__name__}.{field.name}={value!r}: give {allowed}"
            + (", or None" if optional else "")
        )


@dataclasses.dataclass(frozen=True)
class DelayedScalingConfig:
    """How delayed scaling turns its amax history into a scale."""

    history_len: int = 16
    """Steps of amax kept per tensor."""

    scale_fn: str = "max"
    """'max': the scale of the largest amax in the history; 'most_recent': of the last one."""

    compiled_one_pass: bool = False
    """Under torch.compile, once every layer's scales are an earlier step's, cast with them
    without waiting for this step's amax, so that the amax and the cast can read the tensor in
    one pass, as the eager CUDA kernel does. The compiled graph specializes on that: it
    recompiles once, after the first sync. Off: one graph for every step, which takes the
    amax before each cast (two passes)."""

    def __post_init__(self) -> None:
        _check_scalar_fields(self)
        if self.history_len < 1:
            raise ValueError(f"history_len={self.history_len}: keep at least 1 step of amax")
        if self.scale_fn not in ("max", "most_recent"):
            raise ValueError(f"scale_fn={self.scale_fn!r}: choose 'max' or 'most_recent'")


@dataclasses.dataclass(frozen=True)
class Float8GemmConfig:
    """Options of one scaled gemm."""

    use_fast_accum: bool = False
    """Hopper's fast float8 accumulation: faster, less exact. Usual for the forward only."""

    def __post_init__(self) -> None:
        _check_scalar_fields(self)


_SUB_CONFIGS = {
    "cast": (CastConfig, "scaling_type='dynamic'"),
    "gemm": (Float8GemmConfig, "use_fast_accum=True"),
    "delayed": (DelayedScalingConfig, "history_len=16"),
}
"""Float8LinearConfig's sub-config fields by the first word of their names, with an example."""


class Float8LinearRecipeName(str, enum.Enum):
    """Named configurations; `Float8LinearConfig.from_recipe_name` builds them."""

    TENSORWISE = "tensorwise"
    """One scale per tensor, e4m3 forward and e5m2 gradients: the fastest casts, and the
    default. Outliers in a tensor cost every other value its precision."""

    ROWWISE = "rowwise"
    """One scale per row along each gemm's inner dim, e4m3 everywhere (the scales take the
    range), scales rounded to powers of 2. More accurate with outliers, a few % slower: each
    operand needs its own cast for each of its gemms."""

    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    """ROWWISE for the output and grad_input gemms; the grad_weight gemm in high precision,
    for weight gradients as exact as bf16's at the cost of that gemm's float8 speed-up."""

    BLOCKWISE = "blockwise"
    """DeepSeek-V3-style 1 x 128 blocks for activations and gradients and 128 x 128 for the
    weight, e4m3 everywhere, power-of-2 scales: the most robust to outliers. Dims must be
    multiples of 128. The gemms run block-scaled on sm90 with CUDA >= 12.9 and are emulated in
    fp32 elsewhere (see the README)."""


def _kernel_roles(field: str, value: object, example: str, auto: bool = False) -> object:
    """A Float8LinearConfig field that takes True, False or roles (compiled_cast_kernels,
    compiled_transpose_kernels) as the set of roles it names; with `auto`, "auto" as itself."""
    if auto and value == "auto":
        return value
    if isinstance(value, bool):
        return frozenset(Role) if value else frozenset()
    if isinstance(value, (str, Role)) or not isinstance(value, Iterable):
        choices = '"auto", True, False' if auto else "True, False"
        raise ValueError(
            f"{field}={value!r}: give {choices} or a collection of roles, for example {example}"
        )
    return frozenset(parse_enum(Role, role) for role in value)


@dataclasses.dataclass(frozen=True)
class Float8LinearConfig:
    """Everything a Float8Linear needs to know. The defaults are tensorwise dynamic scaling."""

    cast_config_input: CastConfig = CastConfig()
    """The input's cast, used by the output gemm and, unless overridden, the grad_weight gemm."""

    cast_config_weight: CastConfig = CastConfig()
    """The weight's cast, used by the output gemm and, unless overridden, the grad_input gemm."""

    cast_config_grad_output: CastConfig = CastConfig()
    """grad_output's cast, used by the grad_input gemm and, unless overridden, grad_weight."""

    cast_config_input_for_grad_weight: CastConfig | None = None
    """Override of the input's cast for the grad_weight gemm (None: cast_config_input)."""

    cast_config_weight_for_grad_input: CastConfig | None = None
    """Override of the weight's cast for the grad_input gemm (None: cast_config_weight)."""

    cast_config_grad_output_for_grad_weight: CastConfig | None = None
    """Override of grad_output's cast for the grad_weight gemm (None: cast_config_grad_output)."""

    gemm_config_output: Float8GemmConfig = Float8GemmConfig(use_fast_accum=True)
    """The forward gemm: fast accumulation on, as is usual."""

    gemm_config_grad_input: Float8GemmConfig = Float8GemmConfig()
    """The grad_input gemm: exact accumulation, gradients are more sensitive."""

    gemm_config_grad_weight: Float8GemmConfig = Float8GemmConfig()
    """The grad_weight gemm: exact accumulation, its inner dim (tokens) is the longest."""

    emulate: bool = False
    """Dequantize and multiply in fp32 instead of calling the scaled gemm: any device, any
    shape; for testing and for GPUs without float8 units."""

    pad_inner_dim: bool = False
    """Pad gemm dims that are not multiples of 16 with zeros (the scaled gemm on CUDA needs
    them aligned). Off by default: misaligned layers raise an error that names them."""

    round_scales_to_power_of_2: bool = False
    """Round every scale down to a power of two, so that scaling is exact in any precision."""

    recompute_weight_cast: bool = True
    """Backward recasts the weight from the high-precision parameter (free to keep) instead of
    keeping the float8 weight from forward: under FSDP that copy would be unsharded."""

    recompute_input_cast: bool | None = None
    """What backward keeps of the input. False: the input in float8 (1 byte per element, half of
    bf16), cast as the grad_weight gemm needs it. True: the high-precision input, recast in
    backward. None (default): float8 in eager mode; under torch.compile the partitioner
    chooses, and it keeps float8 unless the high-precision input is kept anyway (by the op that
    produced it, say), where a float8 copy would only add memory."""

    delayed_scaling_config: DelayedScalingConfig = DelayedScalingConfig()
    """History length and scale function of the roles with scaling_type 'delayed'."""

    compiled_cast_kernels: bool | frozenset[Role] = False
    """Experimental. Under torch.compile, run tensorwise casts as fp8train's own Triton kernels
    (triton ops that inductor launches itself: an amax into per-program partial maxima, then
    one pass that reduces them, computes the scale and writes every layout the gemms need)
    instead of leaving them to inductor. True: every role's casts; a collection of roles
    ("input", "weight", "grad_output"): those roles' casts only (stored as a frozenset of
    Role; False as an empty one). Off: inductor generates the casts and may fuse them with the
    ops around them (a norm, an activation). A float8 weight kept for backward
    (recompute_weight_cast=False) is cast on the torch path either way. Eager mode always
    uses the kernels on CUDA; on the CPU the ops trace into the torch path. See
    benchmarks/results/kernels_h100_2026-12-06.md: faster than inductor's casts and than
    torchao.float8 on GPU-bound layers; slower on thin ones (attn.w0), where the compiled
    step's host work keeps the GPU waiting. With the input among the roles, a whole compiled
    LLaMA-style model is slower and heavier (e2e_h100_2026-12-05.md): the compile
    partitioner cannot recompute the kernels, so it keeps the float8 inputs where it would
    recast inductor's casts from tensors kept anyway (benchmarks/saved_by_block.py).
    ("weight", "grad_output") leaves the inputs' casts to inductor: no cast the partitioner
    would keep is a kernel, so the block keeps what it keeps without the kernels."""

    compiled_transpose_kernels: bool | frozenset[Role] | Literal["auto"] = "auto"
    """Under torch.compile, where one cast of a role writes both layouts (grad_output's:
    row-major for grad_input, column-major for grad_weight), inductor's kernel writes the
    row-major float8 bytes only and fp8train's transpose kernel (a triton op,
    fp8train.kernels.transpose) copies them column-major, in tiles that load and store
    contiguous runs. Inductor otherwise writes both layouts from the kernel that makes the
    values. No number changes: the copy holds the same bytes. True: every role; a collection
    of roles: those only; False: none. Ignored for a role whose casts are
    compiled_cast_kernels (they write both layouts themselves) and in eager mode (the eager
    kernels write both layouts from tiles already). Off CUDA the op copies with torch.

    "auto" (default): True where fp8train.toolchain_problem() finds that Triton would
    assemble the kernels with a ptxas that miscompiles a kernel storing float8 bytes in both
    layouts (sm_90 with ptxas 12.x, which torch 2.11's Triton ships), so that no compiled
    kernel stores both; False elsewhere. Decided once per process, when the first
    Float8Linear is built (fp8train.toolchain.auto_transpose_roles).

    For speed alone it does not pay: the copy costs one more read and write of the float8
    bytes, and inductor's own kernels get only a little faster without their strided store
    (H100, delayed one-pass config: the casts took 0.21 ms more a step, the model 1.345x
    bf16's tokens/s against 1.358x without it,
    benchmarks/results/e2e_transpose_h100_2026-12-06.md)."""

    compiled_satfinite: bool = True
    """Under torch.compile on CUDA (compute capability 8.9 and later), leave the saturation of
    fp8train's casts to Triton's float8 conversion, which saturates by itself, instead of
    clamping first: the same bytes from fewer instructions, in kernels that fused casts make
    bound by instructions (benchmarks/kernel_instructions.py); on the H100 a training step's
    casts took 14% less time (benchmarks/results/satfinite_h100_2026-12-06.md). It is an
    inductor post-grad pass (fp8train.inductor), which runs after the partitioner has chosen
    what backward keeps. Building a Float8Linear with this on installs it process-wide in
    torch._inductor.config.post_grad_custom_post_pass, beside any pass already there; it
    touches only fp8train's own casts. Off: the layer asks nothing of the pass (it installs
    it only for compiled_integer_amax; a pass installed by another layer stays;
    fp8train.inductor.uninstall_satfinite_pass removes it)."""

    compiled_integer_amax: bool = True
    """Under torch.compile, take each of fp8train's amaxes as the integer maximum of the
    fp32 bits without their sign: the same value, NaN propagating, in one compare and select
    per element instead of inductor's four-instruction NaN-propagating float maximum
    (fp8train.inductor.amax_as_integer_max, exact on every device). By the CPU's count for
    sm_90, 8-10% fewer instructions in a block's backward kernels; on the H100, 1-5% off
    each LLaMA-70B layer's device time and 0.2-0.5% more end-to-end tokens/s
    (benchmarks/results/inf_to_nan_2026-12-06.md). Installed process-wide with the same
    post-grad pass as compiled_satfinite, either of the two on; each works without the
    other."""

    enable_fsdp_float8_all_gather: bool = False
    """Under FSDP2, cast each weight shard to float8 before the all-gather: 1 byte per weight
    element on the wire instead of 2 or 4. Tensorwise e4m3 weight casts (dynamic, delayed or
    static scaling)."""

    _casts: dict = dataclasses.field(init=False, repr=False, compare=False)
    _gemms: dict = dataclasses.field(init=False, repr=False, compare=False)
    # Every (role, gemm) cast and every gemm config resolved once, here: forward and backward
    # only look them up, which keeps enum construction and dataclasses.replace out of the code
    # that torch.compile traces (torch 2.11's dynamo cannot trace them inside autograd.Function).

    def __post_init__(self) -> None:
        for field, example, auto in (
            ("compiled_cast_kernels", "('weight', 'grad_output')", False),
            ("compiled_transpose_kernels", "('grad_output',)", True),
        ):
            roles = _kernel_roles(field, getattr(self, field), example, auto)
            object.__setattr__(self, field, roles)
        _check_scalar_fields(self)
        for field in dataclasses.fields(self):
            kind, example = _SUB_CONFIGS.get(field.name.split("_")[0], (None, ""))
            if not kind:
                continue
            value = getattr(self, field.name)
            optional = "_for_" in field.name  # an override: None takes the role's config
            if not isinstance(value, kind) and not (optional and value is None):
                raise TypeError(
                    f"Float8LinearConfig.{field.name}={value!r} is not a {kind.__name__}: give "
                    f"{kind.__name__}(...), for example {kind.__name__}({example})"
                )
        base = {
            Role.INPUT: self.cast_config_input,
            Role.WEIGHT: self.cast_config_weight,
            Role.GRAD_OUTPUT: self.cast_config_grad_output,
        }
        overrides = {
            (Role.INPUT, Gemm.GRAD_WEIGHT): self.cast_config_input_for_grad_weight,
            (Role.WEIGHT, Gemm.GRAD_INPUT): self.cast_config_weight_for_grad_input,
            (Role.GRAD_OUTPUT, Gemm.GRAD_WEIGHT): self.cast_config_grad_output_for_grad_weight,
        }
        casts = {
            (role, gemm): (overrides.get((role, gemm)) or base[role]).resolved(role)
            for gemm, roles in GEMM_OPERANDS.items()
            for role in roles
        }
        object.__setattr__(self, "_casts", casts)
        gemms = {
            Gemm.OUTPUT: self.gemm_config_output,
            Gemm.GRAD_INPUT: self.gemm_config_grad_input,
            Gemm.GRAD_WEIGHT: self.gemm_config_grad_weight,
        }
        object.__setattr__(self, "_gemms", gemms)
        for role, gemms in ROLE_GEMMS.items():
            first, second = (self.cast_config(role, gemm) for gemm in gemms)
            stateful = {ScalingType.DELAYED, ScalingType.STATIC}
            if {first.scaling_type, second.scaling_type} & stateful and first != second:
                raise ValueError(
                    f"{role.value} has a {first.scaling_type.value} cast for the {gemms[0].value} "
                    f"gemm but {second} for the {gemms[1].value} gemm: delayed and static "
                    "scaling keep one scale per tensor, so give both gemms the same cast"
                )
        if self.enable_fsdp_float8_all_gather:
            for gemm in (Gemm.OUTPUT, Gemm.GRAD_INPUT):
                cast = self.cast_config(Role.WEIGHT, gemm)
                if not (
                    cast.enabled
                    and cast.scaling_granularity is ScalingGranularity.TENSORWISE
                    and cast.target_dtype == E4M3
                ):
                    raise ValueError(
                        "enable_fsdp_float8_all_gather=True all-gathers one float8 copy of the "
                        "weight for both its gemms, which needs a tensorwise e4m3 weight cast; "
                        f"the weight's cast for the {gemm.value} gemm is {cast}: use tensorwise "
                        "weight scaling, or turn float8 all-gather off"
                    )
        for gemm, (role_a, role_b) in GEMM_OPERANDS.items():
            cast_a, cast_b = self.cast_config(role_a, gemm), self.cast_config(role_b, gemm)
            if cast_a.enabled != cast_b.enabled:
                raise ValueError(
                    f"the {gemm.value} gemm casts {role_a.value} with scaling_type="
                    f"{cast_a.scaling_type.value} but {role_b.value} with "
                    f"{cast_b.scaling_type.value}: a gemm runs either in float8 or in high "
                    "precision, so set both operands' scaling_type to 'disabled' or neither"
                )
            if not cast_a.enabled:
                continue
            if cast_a.scaling_granularity is not cast_b.scaling_granularity:
                raise ValueError(
                    f"the {gemm.value} gemm casts {role_a.value} "
                    f"{cast_a.scaling_granularity.value} but {role_b.value} "
                    f"{cast_b.scaling_granularity.value}: scaled gemms need both operands at "
                    "the same granularity; give both the same scaling_granularity"
                )
            if cast_a.target_dtype == cast_b.target_dtype == E5M2:
                raise ValueError(
                    f"the {gemm.value} gemm would multiply two float8_e5m2 operands "
                    f"({role_a.value}, {role_b.value}), which no float8 gemm supports: cast one "
                    "of them to torch.float8_e4m3fn"
                )

    @classmethod
    def from_recipe_name(
        cls, name: Float8LinearRecipeName | str, **overrides
    ) -> Float8LinearConfig:  # noqa: ANN003
        """The config of a named recipe; keyword `overrides` replace fields of it (for example
        recompute_weight_cast=False)."""
        recipe = parse_enum(Float8LinearRecipeName, name)
        if recipe is Float8LinearRecipeName.TENSORWISE:
            return cls(**overrides)
        granularity = (
            ScalingGranularity.BLOCKWISE
            if recipe is Float8LinearRecipeName.BLOCKWISE
            else ScalingGranularity.ROWWISE
        )
        cast = CastConfig(scaling_granularity=granularity)
        fields = {
            "cast_config_input": cast,
            "cast_config_weight": cast,
            "cast_config_grad_output": CastConfig(
                scaling_granularity=granularity, target_dtype=E4M3
            ),
            "round_scales_to_power_of_2": True,
        }
        if recipe is Float8LinearRecipeName.ROWWISE_WITH_GW_HP:
            disabled = CastConfig(scaling_type=ScalingType.DISABLED)
            fields["cast_config_input_for_grad_weight"] = disabled
            fields["cast_config_grad_output_for_grad_weight"] = disabled
        return cls(**{**fields, **overrides})

    def cast_config(self, role: Role, gemm: Gemm) -> CastConfig:
        """The cast of `role` as an operand of `gemm`, overrides applied, dtype resolved.
        `role` and `gemm` may be the enums or their string values."""
        try:
            return self._casts[(role, gemm)]
        except KeyError:
            role, gemm = parse_enum(Role, role).value, parse_enum(Gemm, gemm).value
            raise ValueError(f"{role} is not an operand of the {gemm} gemm") from None

    def gemm_config(self, gemm: Gemm) -> Float8GemmConfig:
        try:
            return self._gemms[gemm]
        except KeyError:
            parse_enum(Gemm, gemm)  # raises, listing the gemms
            raise


def config_or_default(config: object) -> Float8LinearConfig:
    """`config`, or the default Float8LinearConfig for None; a TypeError for anything else
    (a dict of options, a recipe's name), which would otherwise fail far from the call."""
    if config is None:
        return Float8LinearConfig()
    if not isinstance(config, Float8LinearConfig):
        shown = repr(config) if len(repr(config)) <= 80 else f"a {type(config).__name__}"
        raise TypeError(
            f"config={shown} is not a Float8LinearConfig: give Float8LinearConfig(...) "
            "(Float8LinearConfig(**options) for a dict of options), or "
            "Float8LinearConfig.from_recipe_name(name) for a recipe"
        )
    return config
