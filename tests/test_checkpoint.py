"""Checkpoints of float8 training: stopping and resuming mid-run (model, optimizer, RNG) gives
bitwise the losses of an uninterrupted run. Dynamic scaling keeps no float8 state of its own;
delayed scaling's amax histories and scales are buffers, so the model's state_dict holds them."""

import pytest
import torch

from fp8train import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    sync_float8_amax_and_scale_history,
)
from fp8train.models import ModelArgs, Transformer

ARGS = ModelArgs(dim=32, n_layers=1, n_heads=4, ffn_dim=96, max_seq_len=16)
STEPS, STOP = 8, 3


DELAYED = CastConfig(scaling_type="delayed")
CONFIGS = {
    "dynamic": Float8LinearConfig(),
    "delayed": Float8LinearConfig(
        cast_config_input=DELAYED, cast_config_weight=DELAYED, cast_config_grad_output=DELAYED
    ),
}


def build(seed: int, scaling: str = "dynamic") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = convert_to_float8_training(
        Transformer(ARGS),
        config=CONFIGS[scaling],
        module_filter_fn=lambda module, fqn: fqn != "lm_head",
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optimizer, generator, steps: int) -> list[float]:  # noqa: ANN001
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=generator)
        # Noise from the global RNG as well, so that its state matters to the run.
        logits = model(tokens[:, :-1]) + 1e-3 * torch.randn(2, 16, ARGS.vocab_size)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        sync_float8_amax_and_scale_history(model)  # a no-op for dynamic scaling
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_resume_gives_bitwise_identical_losses(tmp_path, scaling):
    model, optimizer = build(seed=0, scaling=scaling)
    torch.manual_seed(1)
    uninterrupted = train(model, optimizer, torch.Generator().manual_seed(2), STEPS)

    model, optimizer = build(seed=0, scaling=scaling)
    torch.manual_seed(1)
    generator = torch.Generator().manual_seed(2)
    first = train(model, optimizer, generator, STOP)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "data_rng": generator.get_state(),
        },
        tmp_path / "checkpoint.pt",
    )
    del model, optimizer

    resumed, optimizer = build(seed=123, scaling=scaling)  # other weights until the load
    state = torch.load(tmp_path / "checkpoint.pt")
    resumed.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    generator = torch.Generator()
    generator.set_state(state["data_rng"])
    rest = train(resumed, optimizer, generator, STEPS - STOP)

    assert any(isinstance(m, Float8Linear) for m in resumed.modules())
    assert first + rest == uninterrupted


def test_float8_checkpoint_resumes_in_high_precision_and_back(tmp_path):
    """The state_dict is the plain model's: a float8 run's checkpoint continues in bf16/fp32
    training, and the reverse."""
    model, optimizer = build(seed=0)
    torch.manual_seed(0)
    train(model, optimizer, torch.Generator().manual_seed(0), 2)
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt"
    )
    state = torch.load(tmp_path / "c.pt")
    torch.manual_seed(5)
    plain = Transformer(ARGS)
    plain.load_state_dict(state["model"])
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_optimizer.load_state_dict(state["optimizer"])
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, state["model"][name])
    back, _ = build(seed=9)
    back.load_state_dict(plain.state_dict())
    train(plain, plain_optimizer, torch.Generator().manual_seed(0), 1)
