"""The configs train-llama runs, by name: bf16, fp8train's recipes and variants of them, and
torchao.float8's, each applied to a model with `convert(model, name)`.

A name is a base recipe plus suffixes, read from the end: `-fast-accum` (fast accumulation in
the backward gemms too), `-float8-swiglu` / `-float8-swiglu-exact` (SwiGLU keeps its inputs
in float8), a pass variant (`-clamp`, `-float-amax`, `-integer-amax`), `-tied` (shared input
states of delayed scaling). The logits gemm stays in high precision in every config.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.utils import (
    FAST_ACCUM_SUFFIX,
    PASS_VARIANTS,
    inductor_pass_as,
    with_fast_backward,
    with_pass_variant,
)
from fp8train import (
    CastConfig,
    DelayedScalingConfig,
    Float8LinearConfig,
    convert_to_float8_training,
)
from fp8train.models import tie_shared_delayed_inputs, use_float8_swiglu

try:
    import torchao.float8 as torchao_float8
except ImportError:
    torchao_float8 = None

CONFIGS = (
    "bf16",  # the baseline: no float8 (in --dtype, bf16 on the GPU)
    "bf16-nudged",  # the baseline from weights nudged by 2**-7: the loss comparison's noise
    "tensorwise",
    # the default recipe with compiled_transpose_kernels=True; every other float8 config
    # leaves it "auto" (on only where ptxas miscompiles kernels storing both layouts)
    "tensorwise-transpose",
    "tensorwise-delayed",
    "tensorwise-delayed-one-pass",  # compiled: casts without waiting for this step's amax
    "tensorwise-delayed-tied",  # wq/wk/wv and w1/w3 share one input state (one cast)
    "tensorwise-delayed-one-pass-tied",
    # and grad_output's column-major copy made from its row-major bytes by fp8train's
    # transpose kernel (compiled_transpose_kernels), not in the cast's own kernel
    "tensorwise-delayed-one-pass-tied-transpose",
    # compiled casts as inductor writes them, without fp8train's post-grad pass: a clamp
    # before converting, float amaxes (compiled_satfinite and compiled_integer_amax off)
    "tensorwise-clamp",
    "tensorwise-delayed-one-pass-tied-clamp",
    # the pass without its integer amaxes (compiled_integer_amax off)
    "tensorwise-float-amax",
    "tensorwise-delayed-one-pass-tied-float-amax",
    # the defaults named (both parts of the pass on), as earlier results name them
    "tensorwise-integer-amax",
    "tensorwise-delayed-one-pass-tied-integer-amax",
    "tensorwise-cast-kernels",  # compiled: fp8train's cast kernels instead of inductor's
    "tensorwise-cast-kernels-no-input",  # the same for weights and gradients, not inputs
    "tensorwise-keep-hp-input",  # recompute_input_cast=True: backward recasts each input
    "tensorwise-float8-swiglu",  # and SwiGLU keeps its two inputs in float8 (float8_swiglu)
    "tensorwise-float8-swiglu-exact",  # the same, SwiGLU's output from its bf16 inputs
    # the fastest recipe with the exact float8 SwiGLU: the one config under the memory goal
    "tensorwise-delayed-one-pass-tied-float8-swiglu-exact",
    # fast accumulation in the backward gemms too (benchmarks.utils.FAST_ACCUM_SUFFIX)
    "tensorwise-fast-accum",
    "tensorwise-delayed-one-pass-tied-fast-accum",
    "tensorwise-delayed-one-pass-tied-float8-swiglu-exact-fast-accum",
    "rowwise",
    "rowwise_with_gw_hp",
    "blockwise",
    "torchao-tensorwise",
    "torchao-rowwise",
    "torchao-tensorwise-fast-accum",
)
SWIGLU_SUFFIXES = ("-float8-swiglu-exact", "-float8-swiglu")
"""A config ending in one of these is the config before it with float8_swiglu (exact_forward
for the first)."""


def keep_lm_head(module: nn.Module, fqn: str) -> bool:
    """The logits gemm stays in high precision: its errors reach the loss directly."""
    return fqn != "lm_head"


NUDGE = torch.finfo(torch.bfloat16).eps
"""bf16-nudged's relative change of every weight: 2**-7, one or two units in the last place
of a bf16 value (bf16's rounding of one optimizer step moves weights this much), and 2**-7 of
an fp32 value too, so that the CPU's fp32 runs measure the same nudge."""


def nudge(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter multiplied by 1 + NUDGE or 1 - NUDGE, the sign drawn at random with a
    fixed seed. Far below float8's rounding of the gemm operands (up to 2**-4 relative in
    e4m3), and it touches only the starting point: a loss difference that the nudge alone
    produces is the run's noise, not a cost of float8."""
    with torch.no_grad():
        for param in model.parameters():
            generator = torch.Generator(param.device).manual_seed(seed)
            sign = torch.empty_like(param).bernoulli_(0.5, generator=generator).mul_(2).sub_(1)
            param.mul_(sign.mul_(NUDGE).add_(1))
            seed += 1
    return model


def convert(model: nn.Module, name: str) -> nn.Module:
    """`model` as config `name` trains it: converted in place (nudged, for bf16-nudged)."""
    if name == "bf16":
        return model
    if name == "bf16-nudged":
        return nudge(model)
    fast_accum = name.endswith(FAST_ACCUM_SUFFIX)
    name = name.removesuffix(FAST_ACCUM_SUFFIX)
    if name.startswith("torchao-"):
        ao_config = torchao_float8.Float8LinearConfig.from_recipe_name(
            name.removeprefix("torchao-")
        )
        if fast_accum:
            ao_config = with_fast_backward(ao_config, torchao_float8.Float8GemmConfig)
        return torchao_float8.convert_to_float8_training(
            model, config=ao_config, module_filter_fn=keep_lm_head
        )
    swiglu = next((s for s in SWIGLU_SUFFIXES if name.endswith(s)), None)
    if swiglu is not None:  # SwiGLU's inputs in float8 on top of the config before the suffix
        use_float8_swiglu(model, exact_forward=swiglu.endswith("-exact"))
        name = name.removesuffix(swiglu)
    variant = next((v for v in PASS_VARIANTS if name.endswith(f"-{v}")), "satfinite")
    name = name.removesuffix(f"-{variant}")
    if name.startswith("tensorwise-delayed"):
        delayed = CastConfig(scaling_type="delayed")
        config = Float8LinearConfig(
            cast_config_input=delayed,
            cast_config_weight=delayed,
            cast_config_grad_output=delayed,
            delayed_scaling_config=DelayedScalingConfig(compiled_one_pass="-one-pass" in name),
            compiled_transpose_kernels=("grad_output",) if name.endswith("-transpose") else "auto",
        )
    elif name == "tensorwise-cast-kernels":
        config = Float8LinearConfig(compiled_cast_kernels=True)
    elif name == "tensorwise-cast-kernels-no-input":
        config = Float8LinearConfig(compiled_cast_kernels=("weight", "grad_output"))
    elif name == "tensorwise-transpose":
        config = Float8LinearConfig(compiled_transpose_kernels=True)
    elif name == "tensorwise-keep-hp-input":
        config = Float8LinearConfig(recompute_input_cast=True)
    else:
        config = Float8LinearConfig.from_recipe_name(name)
    config = with_pass_variant(config, variant)
    if fast_accum:
        config = with_fast_backward(config)
    inductor_pass_as(config)  # process-wide: an earlier run may have installed another
    model = convert_to_float8_training(model, config=config, module_filter_fn=keep_lm_head)
    return tie_shared_delayed_inputs(model) if "-tied" in name else model
