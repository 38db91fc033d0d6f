"""FSDP2 on 2 CPU ranks over gloo: float8 all-gather gives the losses of FSDP2 without it, and
moves 1 byte per weight element."""

import copy

import pytest
import torch
from torch import nn

from fp8train import Float8LinearConfig, convert_to_float8_training
from fp8train.distributed import (
    WeightWithFloat8CastTensor,
    precompute_float8_dynamic_scale_for_fsdp,
)
from tests.conftest import Projections
from tests.distributed import WORLD_SIZE, spawn

STEPS = 5


def _worker(
    rank: int, out_dir: str, mode: str, reshard_after_forward: bool, weight_scaling: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp8train import CastConfig, sync_float8_amax_and_scale_history

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 48, bias=False))
    config = Float8LinearConfig(
        enable_fsdp_float8_all_gather=mode != "hp-all-gather",
        cast_config_weight=CastConfig(scaling_type=weight_scaling),
    )
    convert_to_float8_training(model, config=config)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    gathered = []
    original = WeightWithFloat8CastTensor.fsdp_pre_all_gather

    # The same parameters as the hook: FSDP reads its signature.
    def counting(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001, ANN202
        inputs, metadata = original(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.extend((t.dtype, t.numel(), t.element_size()) for t in inputs)
        return inputs, metadata

    WeightWithFloat8CastTensor.fsdp_pre_all_gather = counting
    torch.manual_seed(1 + rank)  # each rank its own data
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        if weight_scaling == "delayed":
            sync_float8_amax_and_scale_history(model)
        optimizer.step()
        optimizer.zero_grad()
        if mode == "float8-all-gather-precomputed":
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.detach())
    buffers = {name: b.clone() for name, b in model.named_buffers() if "fp8_" in name}
    torch.save(
        {"losses": torch.stack(losses), "gathered": gathered, "buffers": buffers},
        f"{out_dir}/{rank}.pt",
    )


def run_fsdp(  # noqa: ANN201
    tmp_path,  # noqa: ANN001
    mode: str,
    reshard_after_forward: bool = True,
    weight_scaling: str = "dynamic",
):
    out_dir = tmp_path / f"{mode}-{weight_scaling}"
    out_dir.mkdir()
    spawn(_worker, str(out_dir), mode, reshard_after_forward, weight_scaling)
    return [torch.load(out_dir / f"{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_float8_all_gather_gives_the_losses_of_hp_all_gather(tmp_path, reshard_after_forward):
    reference = run_fsdp(tmp_path, "hp-all-gather", reshard_after_forward)
    float8 = run_fsdp(tmp_path, "float8-all-gather", reshard_after_forward)
    precomputed = run_fsdp(tmp_path, "float8-all-gather-precomputed", reshard_after_forward)
    for rank in range(WORLD_SIZE):
        # The same global scale casts the shards and the whole weight: the same float8 bytes.
        torch.testing.assert_close(float8[rank]["losses"], reference[rank]["losses"])
        torch.testing.assert_close(precomputed[rank]["losses"], reference[rank]["losses"])
        assert reference[rank]["gathered"] == []
        # Every all-gather input: the rank's shard in 1-byte elements.
        gathered = float8[rank]["gathered"]
        assert gathered and all(dtype == torch.uint8 and size == 1 for dtype, _, size in gathered)
        shard_elements = {64 * 128 // WORLD_SIZE, 128 * 48 // WORLD_SIZE}
        assert {numel for _, numel, _ in gathered} == shard_elements


def test_delayed_weights_all_gather_in_float8_with_the_losses_and_history_of_hp(tmp_path):
    """A delayed weight is cast shard by shard with its history's scale, and each shard's amax
    is recorded for the step's sync, whose all-reduce makes it the global amax: the losses and
    every amax history equal those of the high-precision all-gather, which casts the whole
    weight. Step 1 (no history yet) takes the scale from the global amax."""
    reference = run_fsdp(tmp_path, "hp-all-gather", weight_scaling="delayed")
    float8 = run_fsdp(tmp_path, "float8-all-gather", weight_scaling="delayed")
    for rank in range(WORLD_SIZE):
        torch.testing.assert_close(float8[rank]["losses"], reference[rank]["losses"])
        buffers, expected = float8[rank]["buffers"], reference[rank]["buffers"]
        assert buffers.keys() == expected.keys() and "0.fp8_amax_history_weight" in buffers
        for name, tensor in expected.items():
            torch.testing.assert_close(buffers[name], tensor, msg=name)
        assert buffers["0.fp8_amax_history_weight"][STEPS - 1] > 0  # every step recorded
        gathered = float8[rank]["gathered"]
        assert gathered and all(dtype == torch.uint8 for dtype, _, _ in gathered)


def test_float8_all_gather_needs_a_tensorwise_weight_cast():
    from fp8train import CastConfig

    with pytest.raises(ValueError, match="needs a tensorwise e4m3 weight cast"):
        Float8LinearConfig(
            enable_fsdp_float8_all_gather=True,
            cast_config_input=CastConfig(scaling_granularity="rowwise"),
            cast_config_weight=CastConfig(scaling_granularity="rowwise"),
            cast_config_grad_output=CastConfig(scaling_granularity="rowwise"),
        )


def test_wrapped_weight_without_fsdp_trains_like_a_plain_one():
    """The wrapper is a plain high-precision weight to everything but FSDP's all-gather."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 32, bias=False))
    models = [
        convert_to_float8_training(
            copy.deepcopy(base), config=Float8LinearConfig(enable_fsdp_float8_all_gather=flag)
        )
        for flag in (False, True)
    ]
    assert isinstance(models[1][0].weight, WeightWithFloat8CastTensor)
    x = torch.randn(16, 64)
    for model in models:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(3):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert torch.equal(models[0](x), models[1](x))
    assert models[1].state_dict().keys() == models[0].state_dict().keys()


def _dcp_worker(rank: int, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 48))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    model, optimizer = build(0)
    torch.manual_seed(1 + rank)
    step(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{out_dir}/ckpt")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(full, f"{out_dir}/full_expected.pt")
    expected = step(model, optimizer)

    restored, restored_optimizer = build(123)
    model_state, optim_state = get_state_dict(restored, restored_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=f"{out_dir}/ckpt")
    set_state_dict(
        restored,
        restored_optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    torch.manual_seed(1 + rank)
    torch.randn(32, 64)  # the batch the first step used
    torch.save({"expected": expected, "resumed": step(restored, restored_optimizer)},
               f"{out_dir}/{rank}.pt")  # fmt: skip


def test_distributed_checkpoint_round_trip_and_reshard_to_one_process(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    spawn(_dcp_worker, str(tmp_path))
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(result["expected"], result["resumed"])
    # Resharded to world size 1: the checkpoint loads into a plain, unsharded model.
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "full.pt")
    # weights_only=True: the checkpoint holds plain tensors, no fp8train class.
    full = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    expected = torch.load(tmp_path / "full_expected.pt", weights_only=True)
    plain = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 48))
    plain.load_state_dict(full)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, expected[name])


def _fsdp1_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 48, bias=False))
    convert_to_float8_training(model)
    single = copy.deepcopy(model)
    sharded = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    losses = []
    for module in (sharded, single):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        run = []
        for step in range(STEPS):
            torch.manual_seed(10 + step)  # the same batch on every rank: one process's run
            loss = module(torch.randn(32, 64)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.append(loss.detach())
        losses.append(torch.stack(run))
    torch.save({"fsdp1": losses[0], "single": losses[1]}, f"{out_dir}/{rank}.pt")


def test_fsdp1_with_orig_params_matches_one_process(tmp_path):
    spawn(_fsdp1_worker, str(tmp_path))
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        torch.testing.assert_close(result["fsdp1"], result["single"])


def _delayed_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp8train import CastConfig, sync_float8_amax_and_scale_history

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 48))
    delayed = CastConfig(scaling_type="delayed")
    config = Float8LinearConfig(
        cast_config_input=delayed, cast_config_weight=delayed, cast_config_grad_output=delayed
    )
    convert_to_float8_training(model, config=config)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)  # each rank its own data, so its own local amaxes
    local_input_amax = []
    for _ in range(3):
        x = torch.randn(32, 64) * (1 + rank)
        local_input_amax.append(x.abs().max())
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        sync_float8_amax_and_scale_history(model)
    buffers = {name: b.clone() for name, b in model.named_buffers() if "fp8_" in name}
    torch.save({"buffers": buffers, "local": torch.stack(local_input_amax)}, f"{out_dir}/{rank}.pt")


def test_delayed_scaling_under_fsdp2_syncs_one_global_amax(tmp_path):
    spawn(_delayed_worker, str(tmp_path))
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD_SIZE)]
    for name, tensor in results[0]["buffers"].items():
        assert torch.equal(tensor, results[1]["buffers"][name]), name
    # The first layer's input history holds the max over ranks, newest first.
    expected = torch.maximum(results[0]["local"], results[1]["local"]).flip(0)
    assert torch.equal(results[0]["buffers"]["0.fp8_amax_history_input"][:3], expected)


def _tied_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp8train import CastConfig, sync_float8_amax_and_scale_history, tie_delayed_input_scales

    delayed = CastConfig(scaling_type="delayed")
    config = Float8LinearConfig(
        cast_config_input=delayed, cast_config_weight=delayed, cast_config_grad_output=delayed
    )
    results = {}
    for tie in (False, True):
        torch.manual_seed(0)
        model = convert_to_float8_training(Projections(64, 32), config=config)
        if tie:
            tie_delayed_input_scales([model.q, model.k, model.v])
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1 + rank)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(16, 64) * (1 + rank)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sync_float8_amax_and_scale_history(model)
            losses.append(loss.detach())
        weights = [p.full_tensor() for p in model.parameters()]
        results[tie] = (losses, weights, model.q.fp8_amax_history_input.clone())
    torch.save(results, f"{out_dir}/{rank}.pt")


def test_tied_delayed_inputs_under_fsdp2_train_as_untied_ones(tmp_path):
    """Under FSDP2, with one all-reduced sync: q, k and v tied to one input state give every
    rank the same losses and weights as untied layers, and the tied state holds the global
    amax history."""
    spawn(_tied_worker, str(tmp_path))
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        (untied_losses, untied_weights, untied_history) = result[False]
        (tied_losses, tied_weights, tied_history) = result[True]
        assert torch.equal(torch.stack(tied_losses), torch.stack(untied_losses))
        for tied, untied in zip(tied_weights, untied_weights, strict=True):
            assert torch.equal(tied, untied)
        assert torch.equal(tied_history, untied_history) and (tied_history[:3] > 0).all()


def _compiled_worker(rank: int, out_dir: str, compiled: bool) -> None:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 48, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    saved = []

    def record(gm, _inputs):  # noqa: ANN001, ANN202
        saved.extend(
            (
                str(n.meta["val"].dtype),
                tuple(int(s) for s in n.meta["val"].shape),
                tuple(int(s) for s in n.meta["val"].stride()),
            )
            for n in gm.graph.nodes
            if n.op == "placeholder" and not n.name.startswith("tangents")
        )
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=record,
        partition_fn=min_cut_rematerialization_partition,
    )
    if compiled:
        for layer in (model[0], model[2]):
            layer.compile(backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    torch.save({"losses": torch.stack(losses), "saved": saved}, f"{out_dir}/{rank}.pt")


def test_compiled_layers_keep_the_gathered_float8_weight_not_a_copy(tmp_path):
    """Compiled, the backward graph receives each all-gathered float8 weight itself, whose
    storage FSDP frees after forward and refills for backward, and no transposed copy made in
    forward, which would live from forward to backward (one byte per weight element per
    layer). The losses are those of eager."""
    results = {}
    for compiled in (False, True):
        out_dir = tmp_path / str(compiled)
        out_dir.mkdir()
        spawn(_compiled_worker, str(out_dir), compiled)
        results[compiled] = [torch.load(out_dir / f"{r}.pt") for r in range(WORLD_SIZE)]
    weights = {(128, 64), (48, 128)}
    for rank in range(WORLD_SIZE):
        torch.testing.assert_close(results[True][rank]["losses"], results[False][rank]["losses"])
        float8_weights = [
            (shape, stride)
            for dtype, shape, stride in results[True][rank]["saved"]
            if dtype == str(torch.float8_e4m3fn) and shape in weights
        ]
        # The second layer's weight (the first layer computes no grad_input, so backward does
        # not need its weight), row-major as gathered.
        assert float8_weights == [((48, 128), (128, 1))]
