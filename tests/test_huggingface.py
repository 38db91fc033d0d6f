"""A Hugging Face LlamaForCausalLM, built from a config (random weights, nothing downloaded),
converts with convert_to_float8_training (lm_head left out) and trains."""

import pytest
import torch

from fp8train import Float8Linear, convert_to_float8_training

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")


def tiny_llama():  # noqa: ANN201
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_llama_for_causal_lm_converts_and_trains():
    model = convert_to_float8_training(
        tiny_llama(), module_filter_fn=lambda module, fqn: fqn != "lm_head"
    )
    float8 = [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
    # q, k, v, o and gate, up, down in each of the 2 layers; lm_head stays high precision.
    assert len(float8) == 14 and "lm_head" not in float8
    assert not isinstance(model.lm_head, Float8Linear)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 32))  # the same batch: the loss must fall
    losses = []
    for _ in range(8):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5


def test_converted_llama_keeps_the_checkpoint_format():
    plain = tiny_llama()
    converted = convert_to_float8_training(
        tiny_llama(), module_filter_fn=lambda module, fqn: fqn != "lm_head"
    )
    assert converted.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(converted.state_dict())
