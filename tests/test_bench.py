"""The benchmark commands' plumbing (the measurements themselves run on a GPU)."""

import pytest
import torch

from benchmarks.bench_memory import with_ratios
from fp8train.__main__ import main


def test_memory_table_shows_ratios_to_bf16():
    rows = [{"case": "c", "mode": "eager", "bf16": 2.0, "fp8 default": 1.5}]
    assert with_ratios(rows) == [
        {"case": "c", "mode": "eager", "bf16": "2.00", "fp8 default": "1.50 (0.75x)"}
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the command runs the benchmark")
def test_bench_memory_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="run it on a GPU"):
        main(["bench-memory", "--cases", "linear-4096"])
