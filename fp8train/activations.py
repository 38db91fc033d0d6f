"""Activations kept for backward in float8: SwiGLU's two inputs.

A LLaMA-style feed-forward computes `w2(silu(w1(x)) * w3(x))`. Float8 linears keep their own
inputs in float8 (or recast them), but the SwiGLU between them keeps its two halves, `gate =
w1(x)` and `up = w3(x)`, in bf16 for its backward: 4 bytes per hidden element, the largest
activation of a block (eager PyTorch also keeps `silu(gate)`: 6 bytes). `float8_swiglu` keeps
e4m3 copies of the two halves instead, with one scale per row (token), and computes its output
from those same copies, so that backward's recomputation (of the output, for w2's grad_weight
gemm, and of SwiGLU's gradients) sees exactly what forward used: 2 bytes per hidden element.
Keeping the inputs of nonlinear ops in float8 is what DeepSeek-V3 (for SwiGLU) and COAT do.

Under torch.compile the copies are made in a selective activation-checkpoint region tagged
MUST_SAVE (as fp8train.policy does for linear inputs): the partitioner keeps the float8 copies
and their scales, and neither bf16 half. Because forward's output is computed from the copies,
the partitioner cannot keep the bf16 halves instead: backward needs the copies, which only the
halves could remake.

With `exact_forward=True` the output is SwiGLU of the high-precision halves instead, and only
backward works from the copies (close to DeepSeek-V3, which caches SwiGLU's inputs in float8
for backward only). Forward then carries no rounding beyond w2's own cast, but w2 can no longer
remake its float8 input from the copies: a float8 w2 keeps it, 3 bytes per hidden element
instead of 2. Under torch.compile the output is written as `q + (exact - q)`, with `q` SwiGLU
at the copies: the value of `exact` (the difference of two values within a factor of two of
each other is exact in fp32, so the sum gives `exact` back; otherwise it is off by at most one
fp32 rounding, below the output's own), while forward reads the copies, so the partitioner
keeps them rather than the halves.

Under tensor parallelism (w1 and w3 colwise, w2 rowwise) the scales follow the halves'
layout: with DTensor outputs (`use_local_output=False`) a token's amax reduces across the
ranks and the results are one process's; with local outputs (torch's default) each rank
scales its own slice of the hidden width, with no communication
(tests/test_tensor_parallel.py checks both).

Eager mode computes in fp32 a piece of the rows at a time (fp8train.cast.EAGER_PIECES), so
that its temporaries stay small beside what the float8 copies save; compiled code is one fused
kernel.

Numerics: the output carries e4m3 rounding (2**-4 relative at most for values within about
2**14 of their token's largest, more for smaller ones, which fall to subnormals), on top of the
float8 cast that w2's gemm makes of it anyway. The gradients are the exact SwiGLU gradients at
the quantized point; the quantization itself is passed straight through.

Measured (H100, the end-to-end model of examples/train_llama.py, 300 steps, seven seeds):
peak memory 0.80x bf16's against tensorwise's 0.88x, 3% fewer tokens/s than tensorwise, and
validation loss 2.6% above tensorwise's of the same seed on six of six seeds
(benchmarks/results/e2e_h100_2026-12-05.md). So it is off by default: a trade of loss for
memory, not a free saving. With exact_forward=True, on the same model: peak 0.834x bf16's,
2.3% fewer tokens/s than tensorwise, and validation loss against tensorwise of -1.00%, -0.29%
and +4.13% over three seeds. The +4.13% came from a run placed last in its process, and
deterministic mode gives -0.80% on that seed. Too few seeds to call it free; off by default
too. On delayed one-pass tied scaling (H100, one run): peak 0.8344x bf16's against 0.8806x
without it, 1.5% fewer tokens/s (benchmarks/results/e2e_swiglu_h100_2026-12-07.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from fp8train.cast import eager_rows_per_piece, to_float8
from fp8train.config import FLOAT8_DTYPES, HP_DTYPES, ScalingGranularity
from fp8train.policy import _SAVE_POLICIES


def float8_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    exact_forward: bool = False,
) -> torch.Tensor:
    """`silu(gate) * up`, keeping only float8 copies of `gate` and `up` for backward (and
    computing the output from them, unless `exact_forward`).

    gate, up: the same shape (..., F) and floating dtype; each row of F elements gets its own
    scale. exact_forward: the output from the high-precision halves (a float8 w2 then keeps
    its own float8 input). Returns a tensor of that shape and dtype.
    """
    if gate.shape != up.shape:
        raise ValueError(
            f"float8_swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one "
            "shape (the outputs of w1 and w3 for the same input)"
        )
    if gate.dtype != up.dtype or gate.dtype not in HP_DTYPES:
        raise ValueError(
            f"float8_swiglu: gate ({gate.dtype}) and up ({up.dtype}) must share one high-"
            "precision floating dtype (float32, bfloat16 or float16)"
        )
    if float8_dtype not in FLOAT8_DTYPES:
        raise ValueError(
            f"float8_swiglu: float8_dtype={float8_dtype} is not one of {FLOAT8_DTYPES}"
        )
    if gate.dim() == 0:
        raise ValueError("float8_swiglu: gate is a scalar; it needs a last dim to scale along")
    if gate.numel() == 0:
        return F.silu(gate) * up  # no tokens (an empty batch): nothing to scale
    if torch.compiler.is_compiling():
        keep = functools.partial(create_selective_checkpoint_contexts, _SAVE_POLICIES[True])
        copies = checkpoint(_copies, gate, up, float8_dtype, use_reentrant=False, context_fn=keep)
    else:
        copies = _copies(gate, up, float8_dtype)
    return _Float8SwiGLU.apply(gate, up, exact_forward, *copies)


def _copies(
    gate: torch.Tensor, up: torch.Tensor, float8_dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """(gate_fp8, gate_scale, up_fp8, up_scale): rowwise casts along the last dim, 2-D."""
    with torch.no_grad():  # the gradient passes straight through, in _Float8SwiGLU
        casts = [
            to_float8(
                hp.reshape(-1, hp.shape[-1]),
                float8_dtype,
                ScalingGranularity.ROWWISE,
                reduce_dim=-1,
            )
            for hp in (gate, up)
        ]
    return tuple(t for fp8 in casts for t in (fp8._data, fp8._scale))


def _swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def _swiglu_tied(
    g: torch.Tensor, u: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of (g, u), written so that it also reads (a, b), the halves at their float8
    copies' values (the module docstring says why)."""
    quantized = _swiglu(a, b)
    return quantized + (_swiglu(g, u) - quantized)


def _swiglu_grads(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    sigmoid = torch.sigmoid(a)
    return g * b * sigmoid * (1 + a * (1 - sigmoid)), g * a * sigmoid


def _by_rows(fn, dtype: torch.dtype, hp: tuple[torch.Tensor, ...], saved: tuple[torch.Tensor, ...]):  # noqa: ANN001, ANN202
    """`fn` of fp32 values: the 2-D tensors `hp`, then the two halves dequantized from
    `saved` (gate_fp8, gate_scale, up_fp8, up_scale; or none), row for row; its outputs in
    `dtype`. In eager mode a piece of the rows at a time (all at once, the fp32 temporaries
    of a (8192, 14336) SwiGLU would hold more than the float8 copies save), into
    preallocated outputs."""
    rows, width = (hp or saved)[0].shape

    def run(part: slice) -> tuple[torch.Tensor, ...]:
        values = [t[part].to(torch.float32) for t in hp]
        if saved:
            gate_fp8, gate_scale, up_fp8, up_scale = saved
            values += [
                gate_fp8[part].to(torch.float32) / gate_scale[part],
                up_fp8[part].to(torch.float32) / up_scale[part],
            ]
        result = fn(*values)
        return tuple(r.to(dtype) for r in (result if isinstance(result, tuple) else (result,)))

    if torch.compiler.is_compiling():  # whole, with no size test on symbolic sizes
        return run(slice(None))
    step = eager_rows_per_piece(rows, rows * width, (hp or saved)[0].device)
    if rows <= step:
        return run(slice(None))
    outputs = None
    for start in range(0, rows, step):
        part = slice(start, start + step)
        results = run(part)
        if outputs is None:
            outputs = tuple(
                torch.empty((rows, width), dtype=dtype, device=r.device) for r in results
            )
        for output, result in zip(outputs, results, strict=True):
            output[part] = result
    return outputs


class _Float8SwiGLU(torch.autograd.Function):
    """silu(gate) * up at the float8 copies' values (or, exact_forward, of gate and up);
    backward from the copies alone."""

    @staticmethod
    def forward(  # noqa: D102
        ctx: torch.autograd.function.FunctionCtx,
        gate: torch.Tensor,
        up: torch.Tensor,
        exact_forward: bool,
        gate_fp8: torch.Tensor,
        gate_scale: torch.Tensor,
        up_fp8: torch.Tensor,
        up_scale: torch.Tensor,
    ) -> torch.Tensor:
        saved = (gate_fp8, gate_scale, up_fp8, up_scale)
        ctx.save_for_backward(*saved)
        ctx.shape, ctx.dtype = gate.shape, gate.dtype
        if not exact_forward:
            (out,) = _by_rows(_swiglu, gate.dtype, (), saved)
        else:
            halves = tuple(t.reshape(-1, t.shape[-1]) for t in (gate, up))
            if torch.compiler.is_compiling():
                (out,) = _by_rows(_swiglu_tied, gate.dtype, halves, saved)
            else:
                (out,) = _by_rows(_swiglu, gate.dtype, halves, ())
        return out.reshape(gate.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205, D102
        grad_2d = grad.reshape(-1, ctx.shape[-1])
        grad_gate, grad_up = _by_rows(_swiglu_grads, ctx.dtype, (grad_2d,), ctx.saved_tensors)
        return grad_gate.reshape(ctx.shape), grad_up.reshape(ctx.shape), None, *(None,) * 4
