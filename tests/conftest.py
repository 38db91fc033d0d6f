"""Shared test helpers: devices with a reason when one is skipped, and seeding."""

import pytest
import torch


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
