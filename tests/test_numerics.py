import math

import pytest
import torch

from fp8train import compute_error


def test_ten_percent_error_is_twenty_db():
    x = torch.randn(1000)
    assert compute_error(x, 1.1 * x).item() == pytest.approx(20.0, abs=1e-3)


def test_one_percent_error_is_forty_db_in_any_dtype():
    x = torch.randn(64, 64)
    assert compute_error(x, (1.01 * x).to(torch.float16)).item() == pytest.approx(40.0, abs=0.5)


def test_equal_tensors_are_infinite():
    x = torch.randn(10)
    assert math.isinf(compute_error(x, x.clone()).item())


def test_equal_zero_tensors_are_infinite_not_nan():
    assert compute_error(torch.zeros(4), torch.zeros(4)).item() == math.inf
    assert compute_error(torch.zeros(4), torch.ones(4)).item() == -math.inf


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one shape"):
        compute_error(torch.randn(3), torch.randn(4))
