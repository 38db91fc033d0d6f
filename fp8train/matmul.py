"""The float8 matmul of a linear layer: three scaled gemms and the save policy.

    output      = input_fp8       @ weight_fp8.T    (M, K) x (K, N)  forward
    grad_input  = grad_output_fp8 @ weight_fp8      (M, N) x (N, K)  backward
    grad_weight = grad_output_fp8.T @ input_fp8     (N, M) x (M, K)  backward

M = tokens (all leading dims of the input flattened), K = in_features, N = out_features.

What is kept between forward and backward is the config's save policy, nothing else; see
fp8train/policy.py, which also makes torch.compile keep to it.
"""

from __future__ import annotations

import torch

from fp8train.cast import cast_for_gemm, cast_for_gemms, cast_key
from fp8train.config import (
    BLOCK,
    HP_DTYPES,
    Float8LinearConfig,
    Gemm,
    Role,
    ScalingGranularity,
    ScalingType,
    config_or_default,
)
from fp8train.delayed import DelayedState, stateful_scale
from fp8train.gemm import (
    ALIGNMENT,
    grad_weight_tokens_misaligned,
    misaligned_message,
    scaled_mm,
    weight_gradient_follows,
)
from fp8train.policy import (
    BACKWARD_GEMM,
    Observer,
    forward_operands,
    kept_for_backward,
    observe_cast,
    relaid_in_backward,
    shared_input_operands,
)
from fp8train.tensor import Float8Tensor


def uses_blockwise(config: Float8LinearConfig) -> bool:
    return any(
        cast.enabled and cast.scaling_granularity is ScalingGranularity.BLOCKWISE
        for cast in config._casts.values()
    )


def blockwise_tokens_misaligned(
    input: torch.Tensor, weight: torch.Tensor, config: Float8LinearConfig
) -> bool:
    """True if blockwise scaling of the grad_weight gemm (blocks of BLOCK tokens) cannot take
    this input's number of tokens. Without a weight gradient to come (no_grad, inference_mode,
    a frozen weight) nothing is cast along the tokens: any count runs."""
    cast = config.cast_config(Role.INPUT, Gemm.GRAD_WEIGHT)
    tokens = input.numel() // input.shape[-1] if input.shape[-1] else 0
    # The config first: under dynamic shapes `tokens % BLOCK` is a guard, which a layer
    # without blockwise scaling must not install (it would recompile at every multiple).
    return bool(
        cast.enabled
        and cast.scaling_granularity is ScalingGranularity.BLOCKWISE
        and weight_gradient_follows(weight)
        and tokens % BLOCK
    )


def tokens_misaligned(
    input: torch.Tensor, weight: torch.Tensor, config: Float8LinearConfig
) -> bool:
    """True if the number of tokens (the grad_weight gemm's inner dim) would make that gemm
    fail in backward: the caller raises in forward instead, naming the layer."""
    return bool(
        not (config.emulate or config.pad_inner_dim)
        and cast_key(config, Role.INPUT, Gemm.GRAD_WEIGHT) is not None
        and grad_weight_tokens_misaligned(input, weight)
    )


def _gemm(
    gemm: Gemm,
    a: torch.Tensor,
    b: torch.Tensor,
    config: Float8LinearConfig,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if isinstance(a, Float8Tensor):
        return scaled_mm(
            a,
            b,
            out_dtype=out_dtype,
            use_fast_accum=config.gemm_config(gemm).use_fast_accum,
            emulate=config.emulate,
            pad_inner_dim=config.pad_inner_dim,
            gemm=gemm,
        )
    # This gemm's casts are disabled: it runs in high precision.
    return torch.mm(a, b.to(a.dtype)).to(out_dtype)


def _t(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.t()`; for a Float8Tensor in eager mode without the aten dispatch."""
    if type(tensor) is Float8Tensor and not torch.compiler.is_compiling():
        return tensor.transposed()
    return tensor.t()


def _pack(tensor: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple | None]:
    """Split a Float8Tensor into plain tensors for save_for_backward (what saved-tensor hooks
    and the compile partitioner see: float8 bytes and an fp32 scale). The inverse scale of an
    eager cast (4 bytes) rides along in the metadata."""
    if isinstance(tensor, Float8Tensor):
        inverse = None if torch.compiler.is_compiling() else tensor._inv_scale
        return (tensor._data, tensor._scale), (tensor._orig_dtype, tensor._granularity, inverse)
    return (tensor,), None


def _unpack(tensors: tuple[torch.Tensor, ...], meta: tuple | None) -> torch.Tensor:
    if meta is None:
        return tensors[0]
    orig_dtype, granularity, inverse = meta
    fp8 = Float8Tensor(tensors[0], tensors[1], orig_dtype, granularity)
    fp8._inv_scale = inverse
    return fp8


class _Float8Matmul(torch.autograd.Function):
    """The three gemms. Forward gets its operands already cast by fp8train.policy, which decides
    (and under torch.compile enforces) what backward keeps; forward saves just that."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: torch.autograd.function.FunctionCtx,
        input_hp: torch.Tensor,
        weight_hp: torch.Tensor,
        input_for_output: Float8Tensor | None,
        weight_for_output: Float8Tensor | None,
        input_for_backward: Float8Tensor | None,
        weight_for_backward: Float8Tensor | None,
        config: Float8LinearConfig,
        observer: Observer | None = None,
        grad_output_state: DelayedState | None = None,
        keeps: tuple[bool, bool] = (True, True),
    ) -> torch.Tensor:
        a = input_hp if input_for_output is None else input_for_output
        b = weight_hp if weight_for_output is None else weight_for_output
        output = _gemm(Gemm.OUTPUT, a, _t(b), config, input_hp.dtype)
        # keeps: whether backward reads the input (for grad_weight) and the weight (grad_input).
        input_kept = weight_kept = None
        if keeps[0]:
            input_kept = kept_for_backward(
                input_hp, input_for_output, input_for_backward, Role.INPUT, config
            )
        if keeps[1]:
            weight_kept = kept_for_backward(
                weight_hp, weight_for_output, weight_for_backward, Role.WEIGHT, config
            )
        input_tensors, ctx.input_meta = _pack(input_kept)
        weight_tensors, ctx.weight_meta = _pack(weight_kept)
        ctx.num_input_tensors = len(input_tensors)
        ctx.num_weight_tensors = len(weight_tensors)
        # A cast recomputed in backward with forward's scale (see _recast_scale_of).
        recast_scales = [
            _recast_scale_of(kept, for_output, role, config)
            for kept, for_output, role in (
                (input_kept, input_for_output, Role.INPUT),
                (weight_kept, weight_for_output, Role.WEIGHT),
            )
        ]
        ctx.save_for_backward(*input_tensors, *weight_tensors, *recast_scales)
        ctx.config = config
        ctx.observer = observer
        # The buffers themselves, not saved tensors: backward updates the amax in place, which
        # a saved tensor's version check would refuse when the layer runs twice in one step.
        ctx.grad_output_state = grad_output_state
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight_hp.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # noqa: ANN001, ANN205, D102
        config = ctx.config
        saved = ctx.saved_tensors
        n_input, n_weight = ctx.num_input_tensors, ctx.num_weight_tensors
        input_saved = _unpack(saved[:n_input], ctx.input_meta)
        weight_saved = _unpack(saved[n_input : n_input + n_weight], ctx.weight_meta)
        input_recast_scale, weight_recast_scale = saved[n_input + n_weight :]
        grad_input = grad_weight = None
        # One scale for both of grad_output's casts (delayed or static; None: dynamic).
        go_scale, go_record_amax = stateful_scale(
            grad_output,
            config.cast_config(Role.GRAD_OUTPUT, Gemm.GRAD_INPUT),
            ctx.grad_output_state,
            config.round_scales_to_power_of_2,
        )
        need_grad_input, need_grad_weight = ctx.needs_input_grad[:2]
        same_cast = cast_key(config, Role.GRAD_OUTPUT, Gemm.GRAD_WEIGHT) == cast_key(
            config, Role.GRAD_OUTPUT, Gemm.GRAD_INPUT
        )
        grad_output_for_grad_input = grad_output_for_grad_weight = None
        if need_grad_input and need_grad_weight and same_cast:
            # One cast in both gemms' layouts: on CUDA one read of grad_output writes both.
            grad_output_for_grad_input, grad_output_for_grad_weight = _cast_grad_output(
                ctx, grad_output, (Gemm.GRAD_INPUT, Gemm.GRAD_WEIGHT), go_scale, go_record_amax
            )
        elif need_grad_input:
            (grad_output_for_grad_input,) = _cast_grad_output(
                ctx, grad_output, (Gemm.GRAD_INPUT,), go_scale, go_record_amax
            )

        if need_grad_input:
            weight_for_grad_input = _recast(
                weight_saved, Role.WEIGHT, Gemm.GRAD_INPUT, config, ctx.observer,
                weight_recast_scale,
            )  # fmt: skip
            grad_input = _gemm(
                Gemm.GRAD_INPUT,
                grad_output_for_grad_input,
                weight_for_grad_input,
                config,
                ctx.input_dtype,
            )
            # Free what the grad_weight gemm does not need before it allocates its output:
            # backward's peak memory is what float8 must keep below bf16's.
            del weight_for_grad_input, grad_output_for_grad_input

        if need_grad_weight:
            if grad_output_for_grad_weight is None:
                (grad_output_for_grad_weight,) = _cast_grad_output(
                    ctx, grad_output, (Gemm.GRAD_WEIGHT,), go_scale,
                    None if need_grad_input else go_record_amax,
                )  # fmt: skip
            input_for_grad_weight = _recast(
                input_saved, Role.INPUT, Gemm.GRAD_WEIGHT, config, ctx.observer,
                input_recast_scale,
            )  # fmt: skip
            grad_weight = _gemm(
                Gemm.GRAD_WEIGHT,
                _t(grad_output_for_grad_weight),
                input_for_grad_weight,
                config,
                ctx.weight_dtype,
            )
        return grad_input, grad_weight, None, None, None, None, None, None, None, None


def linear_mm(
    input: torch.Tensor,
    weight: torch.Tensor,
    config: Float8LinearConfig,
    observer: Observer | None = None,
    state: dict[Role, DelayedState] | None = None,
    weight_casts: tuple[Float8Tensor, Float8Tensor | None] | None = None,
) -> torch.Tensor:
    """`input @ weight.T` through the float8 gemms, any leading dims; no checks. `observer`
    (fp8train.stats) sees every cast that forward and backward make. `weight_casts`: the
    weight already cast for the output and grad_input gemms (fp8train.cast_weights_once),
    used instead of casting it here and kept for backward."""
    input_2d = input.reshape(-1, input.shape[-1])
    state = state or {}
    # Evaluation, no_grad, inference: no backward, so nothing is cast or kept for it. Backward
    # reads the input only for the weight's gradient and the weight only for the input's: a
    # frozen weight keeps no input, an input without a gradient no weight.
    keeps = (weight_gradient_follows(weight), torch.is_grad_enabled() and input.requires_grad)
    backward = any(keeps)
    input_for_output, input_for_backward = shared_input_operands(
        input, input_2d, config, observer, state.get(Role.INPUT), keeps[0]
    )
    if weight_casts is not None:
        weight_for_output, weight_for_backward = weight_casts
    else:
        weight_for_output, weight_for_backward = forward_operands(
            weight, Role.WEIGHT, config, observer, state.get(Role.WEIGHT), keeps[1]
        )
    if isinstance(weight, Float8Tensor) and keeps[1] and torch.compiler.is_compiling():
        weight_for_backward = relaid_in_backward(weight, Role.WEIGHT)
    if not backward:
        a = input_2d if input_for_output is None else input_for_output
        b = weight if weight_for_output is None else weight_for_output
        output = _gemm(Gemm.OUTPUT, a, _t(b), config, input_2d.dtype)
        return output.reshape(*input.shape[:-1], output.shape[-1])
    output = _Float8Matmul.apply(
        input_2d,
        weight,
        input_for_output,
        weight_for_output,
        input_for_backward,
        weight_for_backward,
        config,
        observer,
        state.get(Role.GRAD_OUTPUT),
        keeps,
    )
    return output.reshape(*input.shape[:-1], output.shape[-1])


def _cast_grad_output(
    ctx,  # noqa: ANN001
    grad_output: torch.Tensor,
    gemms: tuple[Gemm, ...],
    scale: torch.Tensor | None,
    record_amax: torch.Tensor | None,
) -> list[torch.Tensor]:
    """grad_output as each of `gemms` needs it (one cast: they share it), shown once to the
    stats observer (the other layouts hold the same bytes)."""
    casts = cast_for_gemms(grad_output, Role.GRAD_OUTPUT, gemms, ctx.config, scale, record_amax)
    observe_cast(ctx.observer, Role.GRAD_OUTPUT, gemms[0], grad_output, casts[0])
    return casts


def _recast_scale_of(
    kept: torch.Tensor | None,
    for_output: Float8Tensor | None,
    role: Role,
    config: Float8LinearConfig,
) -> torch.Tensor | None:
    """The scale that backward's recast of `role` takes from forward's cast (None: its own):
    a delayed or static cast's, whose state may have moved on by then; and in eager mode a
    dynamic tensorwise cast's, which spares the recast its amax pass (the tensor is the same,
    and so is its amax). Compiled code leaves that choice to the partitioner."""
    if kept is None or isinstance(kept, Float8Tensor) or not isinstance(for_output, Float8Tensor):
        return None
    cast = config.cast_config(role, Gemm.OUTPUT)
    if cast.scaling_type in (ScalingType.DELAYED, ScalingType.STATIC):
        return for_output._scale
    same_cast = cast_key(config, role, BACKWARD_GEMM[role]) == cast_key(config, role, Gemm.OUTPUT)
    if (
        same_cast
        and cast.scaling_granularity is ScalingGranularity.TENSORWISE
        and not torch.compiler.is_compiling()
    ):
        return for_output._scale
    return None


def _recast(
    saved: torch.Tensor,
    role: Role,
    gemm: Gemm,
    config: Float8LinearConfig,
    observer: Observer | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A saved operand as `gemm` needs it: kept float8 as is, kept hp cast now (with forward's
    `scale` for delayed and static casts). The observer sees the cast when it differs from
    forward's (a recast of the same bytes tells nothing)."""
    if isinstance(saved, Float8Tensor):
        return saved
    fp8 = cast_for_gemm(saved, role, gemm, config, scale)
    if cast_key(config, role, gemm) != cast_key(config, role, Gemm.OUTPUT):
        observe_cast(observer, role, gemm, saved, fp8)
    return fp8


def _operands_of(fqn: str) -> str:
    return f"Float8Linear '{fqn}'" if fqn else "float8 matmul"


def check_operands(input: torch.Tensor, weight: torch.Tensor, fqn: str = "") -> None:
    """Raise naming the layer if float8 training cannot cast `input` or `weight` (TypeError)
    or if they do not make `input @ weight.T` (ValueError), before any cast or gemm would fail
    inside torch. `fqn` is read only to raise: torch.compile would otherwise guard on the
    string, and every layer of a block compiled once would compile its own copy."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(
            f"{_operands_of(fqn)}: input is a {type(input).__name__}, not a torch.Tensor: "
            "convert it first (torch.as_tensor)"
        )
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack():
        # Its autograd.Functions keep float8 casts on ctx, which torch.func cannot transform.
        raise RuntimeError(
            f"{_operands_of(fqn)}: float8 training does not run under torch.func transforms "
            "(grad, vmap, jacrev, ...): take gradients with loss.backward() or "
            "torch.autograd.grad, or leave this layer out with module_filter_fn"
        )
    if weight.dtype not in HP_DTYPES:
        raise TypeError(
            f"{_operands_of(fqn)}: weight dtype {weight.dtype} is not float32, bfloat16 or "
            "float16, which float8 training casts from (was the model cast, e.g. with "
            ".double(), after convert_to_float8_training?): cast it to one of them"
        )
    if input.dtype not in HP_DTYPES:
        raise TypeError(
            f"{_operands_of(fqn)}: input dtype {input.dtype} is not float32, bfloat16 or "
            "float16, which float8 training casts from: cast the input to the model's dtype, "
            "or leave this layer out with module_filter_fn"
        )
    if weight.dim() != 2 or input.dim() == 0 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{_operands_of(fqn)}: input {tuple(input.shape)} and weight {tuple(weight.shape)} "
            "do not make input @ weight.T: give a weight (N, K) and an input (..., K), as "
            "nn.Linear takes them"
        )


def empty_product(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`input @ weight.T` for an input without tokens (an empty batch, an expert that got
    none): nothing to scale, and the high-precision product of nothing gives nn.Linear's empty
    output and zero weight gradient."""
    return input @ weight.to(input.dtype).t()


def float8_matmul(
    input: torch.Tensor,
    weight: torch.Tensor,
    config: Float8LinearConfig | None = None,
    *,
    fqn: str = "",
) -> torch.Tensor:
    """`input @ weight.T` with float8 gemms in forward and backward (no bias).

    input: (..., K) in fp32, bf16 or fp16; weight: (N, K), high precision. `fqn` names the
    layer in error messages.
    """
    config = config_or_default(config)
    check_operands(input, weight, fqn)
    if input.numel() == 0:
        return empty_product(input, weight)
    (n, k), exempt = weight.shape, config.emulate or config.pad_inner_dim
    bad = [f"{dim}={size}" for dim, size in (("K", k), ("N", n)) if size % ALIGNMENT]
    if bad and not exempt:
        raise ValueError(
            f"{_operands_of(fqn)}: weight {tuple(weight.shape)} has {' and '.join(bad)}, not a "
            f"multiple of {ALIGNMENT}, which float8 gemms need: set pad_inner_dim=True in "
            "Float8LinearConfig, or pad the operands"
        )
    if tokens_misaligned(input, weight, config):
        raise ValueError(
            misaligned_message(
                Gemm.GRAD_WEIGHT, input.numel() // input.shape[-1], input.shape[-1], fqn
            )
        )
    return linear_mm(input, weight, config)
