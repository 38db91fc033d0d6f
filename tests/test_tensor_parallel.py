"""Tensor and sequence parallelism over DTensor on 2 CPU ranks: torch's own ColwiseParallel and
RowwiseParallel compose with Float8Linear, with the same float8 scales as one process (amaxes
of DTensors are global), so results match single-process float8 to fp32 rounding. The float8
styles (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput) give the same
results and all-gather float8 bytes instead of high precision (counted)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train import Float8Linear, Float8LinearConfig, compute_error, convert_to_float8_training
from fp8train.distributed import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)
from tests.distributed import WORLD_SIZE, spawn


def _mlp_and_styles(float8_styles: bool) -> tuple[nn.Module, nn.Module, type, type]:
    """A float8 MLP, an unparallelized copy of it, and the (colwise, rowwise) styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64, bias=False))
    convert_to_float8_training(model)
    if float8_styles:
        return model, copy.deepcopy(model), Float8ColwiseParallel, Float8RowwiseParallel
    return model, copy.deepcopy(model), ColwiseParallel, RowwiseParallel


def _worker(rank: int, out_dir: str, sequence_parallel: bool, float8_styles: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model, single, col, row = _mlp_and_styles(float8_styles)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    if sequence_parallel:
        # Tokens sharded outside the MLP: all-gathered before the first layer,
        # reduce-scattered after the second.
        plan = {"0": col(input_layouts=Shard(0)), "2": row(output_layouts=Shard(0))}
    else:
        plan = {"0": col(), "2": row(output_layouts=Replicate())}
    parallelize_module(model, mesh, plan)
    torch.manual_seed(1)
    x, grad = torch.randn(32, 64), torch.randn(32, 64)
    if sequence_parallel:
        shard = slice(rank * 16, (rank + 1) * 16)
        local = model(x[shard])
        local.backward(grad[shard])
        out = torch.empty(32, 64)
        dist.all_gather_into_tensor(out, local.detach().contiguous())
    else:
        out = model(x)
        out.backward(grad)
    expected = single(x)
    expected.backward(grad)
    result = {
        "output": compute_error(expected, out).item(),
        "grad_up": compute_error(single[0].weight.grad, model[0].weight.grad.full_tensor()),
        "grad_down": compute_error(single[2].weight.grad, model[2].weight.grad.full_tensor()),
        "float8": isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear),
    }
    torch.save(result, f"{out_dir}/{rank}.pt")


@pytest.mark.parametrize("float8_styles", [False, True], ids=["torch-styles", "float8-styles"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_matches_one_process(tmp_path, sequence_parallel, float8_styles):
    spawn(_worker, str(tmp_path), sequence_parallel, float8_styles)
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["float8"]
        # fp32 rounding of partial sums apart, the same numbers: > 100 dB (float8 itself gives
        # about 28 dB against fp32).
        assert result["output"] > 100
        assert result["grad_up"] > 100 and result["grad_down"] > 100


class _CommLog(TorchDispatchMode):
    """The functional collectives issued outside DTensor's op dispatch, (name, dtype, numel):
    DTensor's redistributes (the styles' all-gathers and reduce-scatters) and the float8
    styles' own. Collectives that DTensor issues inside an op (the all-reduce of a sharded
    tensor's amax) run below this mode and are not seen; the compiled test reads them all
    from the traced graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _COLLECTIVES:
            self.calls.append((name, args[0].dtype, args[0].numel()))
        return func(*args, **(kwargs or {}))


_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _gathered(local: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(WORLD_SIZE)]
    dist.all_gather(parts, local.detach().contiguous())
    return torch.cat(parts, dim)


def _graph_collectives(graphs: list) -> list[tuple[str, torch.dtype, int]]:  # noqa: ANN001
    """(name, dtype, numel) of the collectives in traced FX graphs, as _CommLog records them."""
    calls = []
    for graph in graphs:
        for node in graph.graph.nodes:
            target = getattr(node.target, "__name__", "").split(".")[0]
            if node.op == "call_function" and target in _COLLECTIVES:
                value = node.args[0].meta["val"]
                calls.append((target, value.dtype, value.numel()))
    return calls


def _recording_backend(graphs: list):  # noqa: ANN001, ANN202
    """aot_eager that keeps the forward and backward graphs it compiles."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def _mlp_worker(rank: int, out_dir: str, float8_styles: bool, compiled: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model, single, col, row = _mlp_and_styles(float8_styles)
    plan = {"0": col(input_layouts=Shard(0)), "2": row(output_layouts=Shard(0))}
    parallelize_module(model, init_device_mesh("cpu", (WORLD_SIZE,)), plan)
    torch.manual_seed(1)
    x, grad = torch.randn(32, 64), torch.randn(32, 64)
    shard = slice(rank * 16, (rank + 1) * 16)
    local_x = x[shard].clone().requires_grad_()
    if compiled:
        from torch._dynamo.testing import CompileCounterWithBackend

        graphs: list = []
        counter = CompileCounterWithBackend(_recording_backend(graphs))
        local = torch.compile(model, backend=counter, fullgraph=True)(local_x)
        local.backward(grad[shard])
        calls, frames = _graph_collectives(graphs), counter.frame_count
    else:
        log = _CommLog()
        with log:
            local = model(local_x)
            local.backward(grad[shard])
        calls, frames = log.calls, None
    x_full = x.clone().requires_grad_()
    expected = single(x_full)
    expected.backward(grad)
    result = {
        "frames": frames,
        "output": compute_error(expected, _gathered(local, 0)).item(),
        "grad_input": compute_error(x_full.grad, _gathered(local_x.grad, 0)).item(),
        "grad_up": compute_error(single[0].weight.grad, model[0].weight.grad.full_tensor()),
        "grad_down": compute_error(single[2].weight.grad, model[2].weight.grad.full_tensor()),
        "calls": calls,
    }
    torch.save(result, f"{out_dir}/{rank}.pt")


@pytest.mark.parametrize(
    ("float8_styles", "compiled"),
    [(True, False), (False, False), (True, True)],
    ids=["float8-styles", "torch-styles", "float8-styles-compiled"],
)
def test_sequence_parallel_all_gathers_move_float8_bytes(tmp_path, float8_styles, compiled):
    """Float8ColwiseParallel casts its token-sharded input before the forward all-gather,
    Float8RowwiseParallel its output's gradient before the backward all-gather: 1 byte per
    element instead of 4 (fp32 here), with the results of one process. Compiled (fullgraph,
    one frame), the traced graphs hold the same collectives."""
    spawn(_mlp_worker, str(tmp_path), float8_styles, compiled)
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["frames"] == (1 if compiled else None)
        assert result["output"] > 100 and result["grad_input"] > 100
        assert result["grad_up"] > 100 and result["grad_down"] > 100
        gathers = [(dtype, n) for name, dtype, n in result["calls"] if "all_gather" in name]
        scatters = [(dtype, n) for name, dtype, n in result["calls"] if "reduce_scatter" in name]
        # One all-gather of the (16, 64) input shard, one of the (16, 64) grad shard; the
        # reduce-scatters (forward output, backward grad_input) are sums: high precision.
        gathered_dtype = torch.uint8 if float8_styles else torch.float32
        assert gathers == [(gathered_dtype, 16 * 64)] * 2
        assert scatters == [(torch.float32, 32 * 64)] * 2
        # The scale of a shard is the whole tensor's: all-reduces of scalars only (the
        # styles' own two, and compiled, also the amaxes of the sharded weights and grads).
        reductions = [n for name, _, n in result["calls"] if name == "all_reduce"]
        assert all(n == 1 for n in reductions)
        if float8_styles and not compiled:
            assert len(reductions) == 2


def _block_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from fp8train.models import ModelArgs, TransformerBlock, rotary_cos_sin

    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, ffn_dim=128, max_seq_len=16)
    block = TransformerBlock(args)
    convert_to_float8_training(block)
    single = copy.deepcopy(block)
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareFloat8ModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": Float8ColwiseParallel(),
        "attention.wk": Float8ColwiseParallel(),
        "attention.wv": Float8ColwiseParallel(),
        "attention.wo": Float8RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareFloat8ModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": Float8ColwiseParallel(),
        "feed_forward.w3": Float8ColwiseParallel(),
        "feed_forward.w2": Float8RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(block, init_device_mesh("cpu", (WORLD_SIZE,)), plan)
    torch.manual_seed(1)
    x, grad = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    cos, sin = rotary_cos_sin(16, 16, args.rope_theta, torch.device("cpu"))
    shard = slice(rank * 8, (rank + 1) * 8)
    local_x = x[:, shard].clone().requires_grad_()
    log = _CommLog()
    with log:
        local = block(local_x, cos, sin)
        local.backward(grad[:, shard])
    x_full = x.clone().requires_grad_()
    expected = single(x_full, cos, sin)
    expected.backward(grad)
    weights = {
        name: compute_error(p.grad, dict(block.named_parameters())[name].grad.full_tensor())
        for name, p in single.named_parameters()
    }
    result = {
        "output": compute_error(expected, _gathered(local, 1)).item(),
        "grad_input": compute_error(x_full.grad, _gathered(local_x.grad, 1)).item(),
        "weights": weights,
        "calls": log.calls,
    }
    torch.save(result, f"{out_dir}/{rank}.pt")


def test_a_sequence_parallel_block_casts_each_input_once_before_its_all_gather(tmp_path):
    """A LLaMA block under TP + SP: PrepareFloat8ModuleInput casts the attention's and the
    FFN's input once, all-gathered in float8 for wq/wk/wv and w1/w3; wo and w2 all-gather
    their output gradients in float8. Outputs and every gradient match one process."""
    spawn(_block_worker, str(tmp_path))
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["output"] > 100 and result["grad_input"] > 100
        for name, sqnr in result["weights"].items():
            assert sqnr > 100, name
        gathers = [(dtype, n) for name, dtype, n in result["calls"] if "all_gather" in name]
        # Forward: the attention input and the FFN input; backward: wo's and w2's grad_output;
        # each a (2, 8, 64) shard, in bytes. Nothing is all-gathered in high precision.
        assert gathers == [(torch.uint8, 2 * 8 * 64)] * 4


def test_float8_styles_refuse_what_they_cannot_cast():
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    with pytest.raises(ValueError, match="tensorwise dynamic float8 cast of input"):
        Float8ColwiseParallel()._apply(Float8Linear(64, 32, config=rowwise, fqn="w1"), None)
    with pytest.raises(ValueError, match="tensorwise dynamic float8 cast of grad_output"):
        Float8RowwiseParallel()._apply(Float8Linear(64, 32, config=rowwise), None)
    with pytest.raises(ValueError, match="has a bias"):
        Float8RowwiseParallel(output_layouts=Shard(0))._apply(Float8Linear(64, 32), None)
    with pytest.raises(TypeError, match="convert the model with convert_to_float8_training"):
        Float8ColwiseParallel()._apply(nn.Linear(64, 32), None)
    with pytest.raises(ValueError, match="no Float8Linear inside"):
        PrepareFloat8ModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())._apply(
            nn.ReLU(), None
        )


def _swiglu_worker(rank: int, out_dir: str, local_output: bool, compiled: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from fp8train import float8_swiglu
    from fp8train.models import FeedForward, ModelArgs

    torch.manual_seed(0)
    ffn = FeedForward(ModelArgs(dim=64, ffn_dim=192, float8_swiglu=True))
    convert_to_float8_training(ffn)
    single = copy.deepcopy(ffn)
    # SwiGLU with one scale per token and per rank's slice of the hidden width: what each
    # rank computes from local outputs.
    per_slice = copy.deepcopy(ffn)
    colwise = ColwiseParallel(use_local_output=local_output)
    plan = {"w1": colwise, "w3": colwise, "w2": RowwiseParallel(output_layouts=Replicate())}
    parallelize_module(ffn, init_device_mesh("cpu", (WORLD_SIZE,)), plan)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    model = torch.compile(ffn, fullgraph=True, backend="aot_eager") if compiled else ffn
    out = model(x)
    out.sum().backward()
    expected = single(x)
    expected.sum().backward()
    gate, up = per_slice.w1(x), per_slice.w3(x)
    slices = zip(gate.chunk(WORLD_SIZE, -1), up.chunk(WORLD_SIZE, -1), strict=True)
    hidden = torch.cat([float8_swiglu(g, u) for g, u in slices], -1)
    sliced = per_slice.w2(hidden)
    sliced.sum().backward()
    result = {"output": (compute_error(expected, out), compute_error(sliced, out))}
    for name in ("w1", "w2", "w3"):
        grad = getattr(ffn, name).weight.grad.full_tensor()
        result[name] = tuple(
            compute_error(getattr(reference, name).weight.grad, grad)
            for reference in (single, per_slice)
        )
    torch.save(result, f"{out_dir}/{rank}.pt")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("local_output", [False, True], ids=["dtensor", "local"])
def test_float8_swiglu_under_tensor_parallelism(tmp_path, local_output, compiled):
    """w1/w3 colwise, w2 rowwise. With DTensor outputs float8_swiglu's per-token scales are
    global (its amax reduces across the ranks), so the results match one process; with
    local outputs each rank scales its own slice of the hidden width, with no
    communication, and the results match SwiGLU applied slice by slice."""
    spawn(_swiglu_worker, str(tmp_path), local_output, compiled)
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        for name, (vs_single, vs_slices) in result.items():
            # > 100 dB: the same numbers to fp32 rounding; the other reference lies at
            # float8's distance (~25 dB), so the test tells the two apart.
            matched, other = (vs_slices, vs_single) if local_output else (vs_single, vs_slices)
            assert matched > 100, name
            assert other < 60, name
