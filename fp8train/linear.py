"""Float8Linear: an nn.Linear whose three matmuls run as float8 gemms."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from fp8train.config import (
    BLOCK,
    HP_DTYPES,
    Float8LinearConfig,
    Gemm,
    ScalingGranularity,
    config_or_default,
)
from fp8train.delayed import (
    buffer_names,
    delayed_roles,
    note_unsynced_call,
    register_delayed_buffers,
    role_state,
    state_source,
)
from fp8train.eager import eager_matmul, eager_plan, takes_eager_path
from fp8train.gemm import ALIGNMENT, misaligned_message
from fp8train.matmul import (
    blockwise_tokens_misaligned,
    check_operands,
    empty_product,
    linear_mm,
    tokens_misaligned,
    uses_blockwise,
)
from fp8train.tensor import Float8Tensor
from fp8train.toolchain import resolve_auto_transpose


class Float8Linear(nn.Linear):
    """A drop-in nn.Linear with float8 gemms.

    Its parameters are the plain high-precision `weight` and `bias` of nn.Linear (same names,
    dtypes and state_dict keys), so optimizers, checkpoints and FSDP see nothing new.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: Float8LinearConfig | None = None,
        fqn: str = "",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config_or_default(config)
        self.fqn = fqn
        """The layer's name in its model, for error messages."""
        self._observer = None
        # Set by fp8train.stats.record: called with every cast this layer makes.
        self._weight_casts = None
        self._weight_casts_version = None
        # Set inside fp8train.cast_weights_once: the weight cast for the output and the
        # grad_input gemms, and the weight's version counter then (eager checks it; compiled
        # code must not read it: an int attribute would be guarded on and recompile).

        # (config, its fp8train.eager plan or None), read again when the config changes.
        self._eager = (None, None)
        register_delayed_buffers(self, self.config, device=self.weight.device)
        check_float8_compatible(self, self.config, fqn)
        # Always: it points Triton at torch's own ptxas where that is the fix
        # (fp8train.toolchain.adopt_torch_ptxas), before any of the layer's kernels compiles.
        resolve_auto_transpose()
        if self.config.compiled_satfinite or self.config.compiled_integer_amax:
            # Imported here: torch._inductor takes half a second to import.
            from fp8train.inductor import install_pass_for

            install_pass_for(self.config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            check_operands(input, self.weight, self.fqn)  # raises, naming the type
        device_type = input.device.type
        # Autocast knows no meta device (shape-only runs of a model built on it): it raises.
        autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
        if autocast and not isinstance(input, Float8Tensor):
            # Autocast does not see inside the float8 matmul: apply its dtype here, as it
            # would for nn.Linear.
            input = input.to(torch.get_autocast_dtype(device_type))
        check_operands(input, self.weight, self.fqn)
        if input.numel() == 0:
            output = empty_product(input, self.weight)
        elif self._takes_eager_path(input):
            output = eager_matmul(input, self.weight, self._eager[1])
        else:
            output = self._float8_mm(input)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    def _takes_eager_path(self, input: torch.Tensor) -> bool:
        """True where fp8train.eager's fast path runs this call (eager mode only)."""
        if torch.compiler.is_compiling() or self._observer is not None:
            return False
        config, plan = self._eager
        if config is not self.config:  # the plan of the config the layer has now
            plan = eager_plan(self.config, self.in_features, self.out_features)
            self._eager = (self.config, plan)
        return (
            plan is not None and self._weight_casts is None and takes_eager_path(input, self.weight)
        )

    def _float8_mm(self, input: torch.Tensor) -> torch.Tensor:
        """`input @ weight.T` through fp8train.matmul, the path of every config, eager or
        compiled."""
        # self.fqn is read only to raise: torch.compile would otherwise guard on the string
        # and recompile forward once per layer.
        if blockwise_tokens_misaligned(input, self.weight, self.config):
            tokens = input.numel() // self.in_features
            name = f"Float8Linear '{self.fqn}'" if self.fqn else "Float8Linear"
            raise ValueError(
                f"{name}: the number of tokens (input.numel() // in_features)={tokens} is not a "
                f"multiple of {BLOCK}, which blockwise scaling of the grad_weight gemm needs: "
                f"make batch * sequence length a multiple of {BLOCK}, or use the rowwise recipe"
            )
        if tokens_misaligned(input, self.weight, self.config):
            tokens = input.numel() // self.in_features
            raise ValueError(
                misaligned_message(Gemm.GRAD_WEIGHT, tokens, self.in_features, self.fqn)
            )
        observer = None if torch.compiler.is_compiling() else self._observer
        # Compiled code reads the host-side flag only when asked to: dynamo guards on it, and
        # the graph recompiles once when the scales become ready.
        one_pass = self.config.delayed_scaling_config.compiled_one_pass
        state = {}
        for role in delayed_roles(self.config):
            # A tied role (tie_delayed_input_scales) uses another layer's state and readiness.
            source = state_source(self, role)
            ready = not (torch.compiler.is_compiling() and not one_pass) and (
                role in source._fp8_ready_roles
            )
            state[role] = role_state(source, role, ready)
        if state and not torch.compiler.is_compiling() and torch.is_grad_enabled():
            note_unsynced_call(self, self.fqn)
        weight_casts = self._weight_casts
        stale = (
            weight_casts is not None
            and not torch.compiler.is_compiling()
            and self.weight._version != self._weight_casts_version
        )
        if stale:
            name = f"Float8Linear '{self.fqn}'" if self.fqn else "Float8Linear"
            raise RuntimeError(
                f"{name}: the weight changed inside cast_weights_once, so its float8 cast is "
                "stale: step the optimizer after the block, not inside it"
            )
        return linear_mm(
            input, self.weight, self.config, observer, state, weight_casts=weight_casts
        )

    @classmethod
    def from_float(
        cls, module: nn.Linear, config: Float8LinearConfig | None = None, *, fqn: str = ""
    ) -> Float8Linear:
        """A Float8Linear that shares `module`'s weight and bias (the same Parameter objects)
        and takes over the rest of its state: its hooks, its training flag, and whatever a
        subclass of nn.Linear adds (attributes, submodules, parameters, buffers)."""
        config = config_or_default(config)
        check_float8_compatible(module, config, fqn)
        with torch.device("meta"):
            new = cls(module.in_features, module.out_features, bias=False, config=config, fqn=fqn)
        new.weight = module.weight
        new.bias = module.bias
        register_delayed_buffers(new, config, device=module.weight.device)
        _take_module_state(module, new)
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {describe_config(self.config)}"

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, *args
    ):  # noqa: ANN001, ANN202, D105
        # A checkpoint of the unconverted model has no delayed-scaling state: keep the initial
        # state (the first step scales from the data) instead of failing a strict load.
        absent = [
            prefix + name for name in buffer_names(self.config) if prefix + name not in state_dict
        ]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, *args
        )
        self._fp8_ready_roles.clear()  # the loaded scales are checked on the next step
        for key in absent:
            if key in missing_keys:
                missing_keys.remove(key)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202
        # .to(device) / .cuda() / .bfloat16() land here. The delayed-scaling state keeps its
        # dtype (fp32) while it moves: a bf16 amax history would round every amax and scale,
        # and the cast kernel records amaxes into it with fp32 atomics.
        state = {id(self._buffers[name]) for name in buffer_names(self.config)}

        def keep_dtype(tensor: torch.Tensor) -> torch.Tensor:
            moved = fn(tensor)
            if id(tensor) in state and moved.dtype != tensor.dtype:
                return tensor.to(device=moved.device)
            return moved

        module = super()._apply(keep_dtype, recurse)
        # Refuse a GPU without float8 gemms when moved to it.
        check_device(self.weight.device, self.config, self.fqn)
        return module


def check_device(device: torch.device, config: Float8LinearConfig, fqn: str = "") -> None:
    """Raise a ValueError naming the layer if `device` cannot run float8 gemms."""
    if device.type != "cuda" or config.emulate:
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        name = f"'{fqn}'" if fqn else "Float8Linear"
        gpu = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{name}: {gpu} (compute capability {capability[0]}.{capability[1]}) has no float8 "
            "gemms, which need compute capability 8.9 or newer (Ada, Hopper, Blackwell): set "
            "emulate=True in Float8LinearConfig to run float8 numerics in fp32 matmuls, or "
            "train without float8 on this GPU"
        )


MIN_CUDA_CAPABILITY = (8, 9)


def _take_module_state(old: nn.Module, new: nn.Module) -> None:
    """Give `new` what swapping `old` for it would otherwise drop. Hook dicts are shared, not
    copied, so the handles their registration returned still remove them; attributes,
    parameters, buffers and submodules that `new` lacks (a subclass's own) are added."""
    own = vars(new)
    for name, value in vars(old).items():
        if name in ("_parameters", "_buffers", "_modules"):
            for key, item in value.items():
                own[name].setdefault(key, item)
        elif name == "_non_persistent_buffers_set":
            own[name] |= value
        elif "_hook" in name or name == "training" or name not in own:
            own[name] = value


def check_float8_compatible(module: nn.Linear, config: Float8LinearConfig, fqn: str) -> None:
    """Raise naming the layer if it is not an nn.Linear float8 can take over (TypeError) or its
    float8 gemms cannot run (ValueError)."""
    name = f"'{fqn}'" if fqn else type(module).__name__
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"{name}: Float8Linear.from_float takes an nn.Linear, got a "
            f"{type(module).__name__}: only nn.Linear layers train in float8"
        )
    if parametrize.is_parametrized(module):
        raise ValueError(
            f"{name} is parametrized (weight_norm, spectral_norm, ...): its weight is "
            "recomputed on every call, which a Float8Linear's plain weight parameter cannot do. "
            "Leave this layer out with module_filter_fn, or remove the parametrization first "
            "(torch.nn.utils.parametrize.remove_parametrizations)"
        )
    check_device(module.weight.device, config, fqn)
    dtype = module.weight.dtype
    if dtype not in HP_DTYPES:
        raise ValueError(
            f"{name}: weight dtype {dtype} is not float32, bfloat16 or float16, which float8 "
            "training casts from: convert the model to one of them first, or leave this layer "
            "out with module_filter_fn"
        )
    if uses_blockwise(config):
        bad = _dims_not_multiple_of(module, BLOCK)
        if bad:
            raise ValueError(
                f"{name}: {bad} not a multiple of {BLOCK}, which blockwise scaling "
                f"needs ({BLOCK} x {BLOCK} weight blocks): leave this layer out with "
                "module_filter_fn, or use the rowwise recipe"
            )
    if config.emulate or config.pad_inner_dim:
        return
    bad = _dims_not_multiple_of(module, ALIGNMENT)
    if bad:
        raise ValueError(
            f"{name}: {bad} not a multiple of {ALIGNMENT}, which float8 gemms "
            "need: set pad_inner_dim=True in Float8LinearConfig, or leave this layer out with "
            "module_filter_fn"
        )


def _dims_not_multiple_of(module: nn.Linear, multiple: int) -> str:
    """'in_features=100 and out_features=30' for the dims of `module` that `multiple` does not
    divide; '' when it divides both."""
    dims = (("in_features", module.in_features), ("out_features", module.out_features))
    return " and ".join(f"{dim}={size}" for dim, size in dims if size % multiple)


def describe_config(config: Float8LinearConfig) -> str:
    """A one-line summary of what differs from the default config (for repr and logs)."""
    casts = []
    for role in ("input", "weight", "grad_output"):
        cast = getattr(config, f"cast_config_{role}")
        if cast.enabled:
            granularity = (
                ""
                if cast.scaling_granularity is ScalingGranularity.TENSORWISE
                else (f" {cast.scaling_granularity.value}")
            )
            casts.append(f"{role}:{cast.scaling_type.value}{granularity}")
        else:
            casts.append(f"{role}:hp")
    flags = [
        f"recompute_weight_cast={config.recompute_weight_cast}",
        f"recompute_input_cast={config.recompute_input_cast}",
    ]
    flags += [
        name
        for name in ("emulate", "pad_inner_dim", "round_scales_to_power_of_2")
        if getattr(config, name)
    ]
    overrides = [
        name
        for name in (
            "cast_config_input_for_grad_weight",
            "cast_config_weight_for_grad_input",
            "cast_config_grad_output_for_grad_weight",
        )
        if getattr(config, name) is not None
    ]
    return ", ".join([f"cast=({', '.join(casts)})", *flags, *overrides])
