"""torch.compile smoke tests: a converted model compiles as one graph and one frame.

The full compile tier (every backend, the save policy in compiled graphs) belongs to the memory
work; these guard against graph breaks and per-layer recompiles.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from fp8train import Float8LinearConfig, compute_error, convert_to_float8_training
from fp8train.models import ModelArgs, Transformer
from tests.conftest import DEVICES

OLD_TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)


# Seen on the H200 with torch 2.11: dynamo raises "Unexpected type in sourceless builder" on
# the float8 matmul under fullgraph=True; torch 2.13 traces it. Fixing it is compile work.
@pytest.mark.xfail(
    OLD_TORCH, reason="graph break in the float8 matmul on torch < 2.13", strict=True
)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute_weight_cast", [True, False])
def test_llama_model_compiles_fullgraph_without_recompiles(device, recompute_weight_cast):
    torch._dynamo.reset()
    counters.clear()
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=176, max_seq_len=32)
    eager = Transformer(args).to(device)
    convert_to_float8_training(
        eager,
        config=Float8LinearConfig(recompute_weight_cast=recompute_weight_cast),
        module_filter_fn=lambda module, fqn: fqn != "lm_head",
    )
    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, args.vocab_size, (2, 32), device=device)
    for _ in range(2):
        out = compiled(tokens)
        out.float().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    assert compute_error(eager(tokens), compiled(tokens)) > 40
