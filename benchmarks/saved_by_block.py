"""What the compiled backward of one LLaMA-style block receives from its forward, per config:
the tensors inductor's partitioner keeps (dtype, shape, MiB), parameters apart.

    python -m benchmarks.saved_by_block                     # CPU, a small block, inductor
    python -m benchmarks.saved_by_block --opaque-casts      # compiled_cast_kernels (and
                                                            # _transpose_kernels) as on a GPU
    python -m benchmarks.saved_by_block --float8-swiglu     # SwiGLU's inputs kept in float8
    python -m benchmarks.saved_by_block --dim 4096 --ffn-dim 14336 --heads 32 --tokens 8192

A float8 copy kept for backward shows as a float8 row; an input recast in backward leaves
none. On the CPU fp8train's triton ops trace into the torch path, which inductor may recompute
like any other op; on a GPU they are kernels that the partitioner cannot recompute (they are
not in its allowlist) nor fuse with the op that makes their input. `--opaque-casts` stands
such ops in on the CPU (custom ops running the torch path), so that the partition the GPU gets
can be read here. A diagnostic, not a benchmark table.
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

import fp8train.cast
from benchmarks.utils import delayed_config, markdown_table, print_environment
from fp8train import (
    DelayedScalingConfig,
    Float8LinearConfig,
    convert_to_float8_training,
)
from fp8train.config import ScalingGranularity
from fp8train.models import (
    ModelArgs,
    TransformerBlock,
    rotary_cos_sin,
    tie_shared_delayed_inputs,
)
from fp8train.tensor import Float8Tensor

CONFIGS = {
    "bf16": None,
    "tensorwise": Float8LinearConfig(),
    "tensorwise keep-hp-input": Float8LinearConfig(recompute_input_cast=True),
    "tensorwise cast-kernels": Float8LinearConfig(compiled_cast_kernels=True),
    "tensorwise cast-kernels keep-hp-input": Float8LinearConfig(
        compiled_cast_kernels=True, recompute_input_cast=True
    ),
    "tensorwise cast-kernels weight grad_output": Float8LinearConfig(
        compiled_cast_kernels=("weight", "grad_output")
    ),
    "tensorwise delayed": delayed_config(),
    "tensorwise delayed keep-hp-input": delayed_config(recompute_input_cast=True),
    "tensorwise delayed tied": delayed_config(),
    "tensorwise delayed one-pass": delayed_config(
        delayed_scaling_config=DelayedScalingConfig(compiled_one_pass=True)
    ),
    "tensorwise delayed one-pass tied": delayed_config(
        delayed_scaling_config=DelayedScalingConfig(compiled_one_pass=True)
    ),
    "rowwise": Float8LinearConfig.from_recipe_name("rowwise"),
    "rowwise_with_gw_hp": Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"),
}


# ------------------------------------------------ opaque stand-ins for the GPU's triton ops


@torch.library.custom_op("saved_by_block::amax", mutates_args=())
def _amax(hp: torch.Tensor) -> torch.Tensor:
    return fp8train.cast.amax(hp, ScalingGranularity.TENSORWISE, None)


@_amax.register_fake
def _(hp: torch.Tensor) -> torch.Tensor:
    return hp.new_empty((), dtype=torch.float32)


@torch.library.custom_op("saved_by_block::cast", mutates_args=())
def _cast(
    hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, row: bool, col: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8train.cast._layouts_of(fp8train.cast._saturated_cast(hp, scale, dtype), row, col)


@_cast.register_fake
def _(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, row: bool, col: bool):  # noqa: ANN202
    m, n = hp.shape
    empty = hp.new_empty((0,), dtype=dtype)
    return (
        hp.new_empty((m, n), dtype=dtype) if row else empty,
        hp.new_empty((n, m), dtype=dtype).t() if col else empty.clone(),
    )


@torch.library.custom_op("saved_by_block::column_major", mutates_args=())
def _column_major(data: torch.Tensor) -> torch.Tensor:
    return fp8train.cast.column_major_copy(data)


@_column_major.register_fake
def _(data: torch.Tensor) -> torch.Tensor:
    m, n = data.shape
    return data.new_empty((n, m)).t()


def _opaque_transpose_op(data: torch.Tensor) -> torch.Tensor:
    """fp8train.cast._transpose_op as an op that the partitioner and inductor treat as the
    GPU's triton op: a node of its own, neither fused nor recomputed."""
    return torch.ops.saved_by_block.column_major(data)


def _opaque_cast_ops(hp, float8_dtype, layouts, round_to_power_of_2, scale, record_amax):  # noqa: ANN001, ANN202, PLR0913
    """fp8train.cast._cast_ops with custom ops that the partitioner treats as the GPU's."""
    if record_amax is not None:
        raise ValueError("--opaque-casts stands in for dynamic casts only")
    if scale is None:
        scale = fp8train.cast.amax_to_scale(
            torch.ops.saved_by_block.amax(hp), float8_dtype, round_to_power_of_2=round_to_power_of_2
        )
    data = torch.ops.saved_by_block.cast(hp, scale, float8_dtype, False in layouts, True in layouts)
    return [
        Float8Tensor(data[int(cm)], scale, hp.dtype, ScalingGranularity.TENSORWISE)
        for cm in layouts
    ]


# -------------------------------------------------------------------------------- the probe


def saved_by_backward(block: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """The fake tensors that inductor's backward graph of `block` takes from its forward."""
    found: list[list[torch.Tensor]] = []

    def inner(gm, example_inputs, **kwargs):  # noqa: ANN001, ANN202
        if kwargs.get("is_backward"):
            found.append(
                [
                    node.meta["val"]
                    for node in gm.graph.nodes
                    if node.op == "placeholder" and not node.name.startswith("tangents")
                ]
            )
        return compile_fx_inner(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    backend = functools.partial(compile_fx, inner_compile=inner)
    # A graph served from a cache is not compiled again, and `inner` would not see it.
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        torch.compile(block, backend=backend, fullgraph=True)(*inputs).float().sum().backward()
    (saved,) = found
    return saved


def _is_float8(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype.itemsize == 1


def describe(saved: list[torch.Tensor], block: torch.nn.Module) -> dict:
    """MiB kept, float8 and in total, parameters apart (they are kept anyway; told apart by
    shape, so keep the token count unlike any weight dim)."""
    shapes = {tuple(p.shape) for p in block.parameters()}
    kept = [t for t in saved if tuple(t.shape) not in shapes]
    float8 = [t for t in kept if _is_float8(t)]
    return {
        "kept MiB": round(sum(t.numel() * t.element_size() for t in kept) / 2**20, 3),
        "float8 MiB": round(sum(t.numel() for t in float8) / 2**20, 3),
        "float8 tensors": sorted(
            (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in float8
        ),
    }


def block_and_inputs(
    block_args: ModelArgs, tokens: int, device: str = "cpu"
) -> tuple[TransformerBlock, tuple[torch.Tensor, ...]]:
    """A bf16 block (seeded) and its inputs (x, cos, sin) for `tokens` tokens."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    base = TransformerBlock(block_args).to(device, dtype)
    x = torch.randn(1, tokens, block_args.dim, device=device, dtype=dtype, requires_grad=True)
    head_dim = block_args.dim // block_args.n_heads
    cos, sin = rotary_cos_sin(tokens, head_dim, 10000.0, x.device)
    return base, (x, cos, sin)


def configured(
    base: TransformerBlock, name: str, config: Float8LinearConfig | None = None
) -> TransformerBlock:
    """A copy of `base` converted as CONFIGS[name] says (or as `config` says, tied as `name`
    says)."""
    block = copy.deepcopy(base)
    config = config or CONFIGS[name]
    if config is not None:
        convert_to_float8_training(block, config=config)
    if name.endswith(" tied"):  # wq/wk/wv and w1/w3 share one delayed input state
        tie_shared_delayed_inputs(block)
    return block


def main(args: argparse.Namespace) -> list[dict]:
    if args.opaque_casts:
        fp8train.cast._cast_ops = _opaque_cast_ops
        fp8train.cast._transpose_op = _opaque_transpose_op
    print_environment()
    block_args = ModelArgs(
        dim=args.dim,
        n_heads=args.heads,
        ffn_dim=args.ffn_dim,
        max_seq_len=args.tokens,
        float8_swiglu=args.float8_swiglu or args.float8_swiglu_exact,
        float8_swiglu_exact_forward=args.float8_swiglu_exact,
    )
    base, inputs = block_and_inputs(block_args, args.tokens, args.device)
    rows = []
    for name in args.configs:
        block = configured(base, name)
        rows.append({"config": name, **describe(saved_by_backward(block, *inputs), block)})
    print(markdown_table(rows))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--ffn-dim", type=int, default=896)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--float8-swiglu",
        action="store_true",
        help="the block's SwiGLU keeps its two inputs in float8 (fp8train.float8_swiglu)",
    )
    parser.add_argument(
        "--float8-swiglu-exact",
        action="store_true",
        help="the same, with SwiGLU's output computed from its high-precision inputs "
        "(float8_swiglu's exact_forward)",
    )
    parser.add_argument(
        "--opaque-casts",
        action="store_true",
        help="stand custom ops in for fp8train's triton ops, as the partitioner sees them on a GPU",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
