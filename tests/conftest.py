"""Shared test helpers: devices with a reason when one is skipped, seeding, and a recorder of
the casts a layer makes."""

from typing import NamedTuple

import pytest
import torch

from fp8train import CastConfig, DelayedScalingConfig, Float8Linear, Float8LinearConfig


def _float8_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 9):
        return "needs a GPU with float8 gemms (compute capability >= 8.9)"
    return None


FLOAT8_GPU_REASON = _float8_gpu_reason()

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(FLOAT8_GPU_REASON is not None, reason=str(FLOAT8_GPU_REASON)),
    ),
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def all_roles_config(granularity: str = "tensorwise", **kwargs) -> Float8LinearConfig:
    """The same cast granularity for input, weight and grad_output."""
    cast = CastConfig(scaling_granularity=granularity)
    return Float8LinearConfig(
        cast_config_input=cast, cast_config_weight=cast, cast_config_grad_output=cast, **kwargs
    )


def one_pass_delayed_config(**kwargs) -> Float8LinearConfig:
    """Delayed scaling for every role, with the compiled one-pass cast."""
    delayed = CastConfig(scaling_type="delayed")
    return Float8LinearConfig(
        cast_config_input=delayed,
        cast_config_weight=delayed,
        cast_config_grad_output=delayed,
        delayed_scaling_config=DelayedScalingConfig(compiled_one_pass=True),
        **kwargs,
    )


def hp_grad_weight_config(**kwargs) -> Float8LinearConfig:
    """float8 output and grad_input gemms, a high-precision grad_weight gemm."""
    disabled = CastConfig(scaling_type="disabled")
    return Float8LinearConfig(
        cast_config_input_for_grad_weight=disabled,
        cast_config_grad_output_for_grad_weight=disabled,
        **kwargs,
    )


class CastCall(NamedTuple):
    data_ptr: int
    shape: tuple[int, ...]
    layouts: int


def record_casts(monkeypatch: pytest.MonkeyPatch) -> list[CastCall]:
    """Records every cast (fp8train.cast.cast_layouts) from now on: the input's data pointer
    and shape, and how many layouts it was written in."""
    import fp8train.cast

    calls: list[CastCall] = []
    original = fp8train.cast.cast_layouts

    def recording(hp, float8_dtype, granularity, layouts, **kwargs):  # noqa: ANN001, ANN202
        calls.append(CastCall(hp.data_ptr(), tuple(hp.shape), len(layouts)))
        return original(hp, float8_dtype, granularity, layouts, **kwargs)

    monkeypatch.setattr(fp8train.cast, "cast_layouts", recording)
    return calls


def train_losses(loss_fn, parameters, steps: int = 8, lr: float = 3e-3) -> list[float]:  # noqa: ANN001
    """`steps` AdamW steps on `loss_fn()` (one batch, so the loss must fall); the losses."""
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class Projections(torch.nn.Module):
    """Attention's q, k and v projections of one normed input (made in forward), summed:
    Float8Linear layers with `config`, or nn.Linear ones to convert where it is None."""

    def __init__(self, k: int, n: int, config: Float8LinearConfig | None = None) -> None:
        super().__init__()
        layers = (
            torch.nn.Linear(k, n, bias=False)
            if config is None
            else Float8Linear(k, n, bias=False, config=config)
            for _ in range(3)
        )
        self.q, self.k, self.v = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * 2
        return self.q(normed) + self.k(normed) + self.v(normed)
