"""Numerics helpers shared by tests, benchmarks and monitoring."""

from __future__ import annotations

import torch


def compute_error(reference: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Signal-to-quantization-noise ratio in dB: 20 * log10(|ref| / |ref - actual|).

    Higher is better: 20 dB is an error of 10% of the signal's norm, 40 dB 1%; equal tensors
    give inf. Computed in fp32 whatever the inputs' dtypes.
    """
    if reference.shape != actual.shape:
        raise ValueError(
            f"compute_error needs tensors of one shape, got {tuple(reference.shape)} and "
            f"{tuple(actual.shape)}"
        )
    reference, actual = reference.float(), actual.float()
    signal = torch.linalg.vector_norm(reference)
    noise = torch.linalg.vector_norm(reference - actual)
    # Equal tensors: no noise, inf (0 / 0 would be NaN where both are zero).
    return torch.where(noise == 0, torch.inf, 20 * torch.log10(signal / noise))
