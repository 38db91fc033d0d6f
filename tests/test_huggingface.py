"""A Hugging Face LlamaForCausalLM, built from a config (random weights, nothing downloaded),
converts with convert_to_float8_training (lm_head left out) and trains."""

import copy

import pytest
import torch

from fp8train import Float8Linear, compute_error, convert_to_float8_training
from tests.conftest import FLOAT8_GPU_REASON, train_losses

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
    tokens = torch.randint(0, 256, (4, 32))  # the same batch: the loss must fall
    losses = train_losses(lambda: model(input_ids=tokens, labels=tokens).loss, model.parameters())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5


def test_a_converted_llama_generates_one_token_at_a_time():
    """generate() runs under no_grad with one token per step after the prompt: float8 layers
    take any token count without a backward."""
    plain = tiny_llama()
    model = convert_to_float8_training(
        copy.deepcopy(plain), module_filter_fn=lambda module, fqn: fqn != "lm_head"
    )
    prompt = torch.randint(0, 256, (1, 5))
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, **settings)
    assert out.shape == (1, 9) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        logits, ref = model(out).logits, plain(out).logits
    assert compute_error(ref, logits) >= 20.0  # 25.7 dB here


def test_converted_llama_keeps_the_checkpoint_format():
    plain = tiny_llama()
    converted = convert_to_float8_training(
        tiny_llama(), module_filter_fn=lambda module, fqn: fqn != "lm_head"
    )
    assert converted.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(converted.state_dict())


@pytest.mark.parametrize(
    ("device", "backend"),
    [
        ("cpu", "aot_eager"),
        pytest.param("cuda", "inductor", marks=pytest.mark.skipif(
            FLOAT8_GPU_REASON is not None, reason=str(FLOAT8_GPU_REASON))),
    ],
)  # fmt: skip
def test_llama_for_causal_lm_trains_with_compiled_decoder_layers(device, backend):
    """Each decoder layer compiled with fullgraph=True (no graph breaks), as torchtitan compiles
    blocks: the losses and gradients of eager float8."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = convert_to_float8_training(
        tiny_llama(), module_filter_fn=lambda module, fqn: fqn != "lm_head"
    ).to(device, dtype)
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend(backend)
    for layer in model.model.layers:
        layer.compile(backend=counter, fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    tokens = torch.randint(0, 256, (4, 32), device=device)
    for _ in range(3):
        losses = []
        for m, optimizer in zip((model, eager), optimizers, strict=True):
            loss = m(input_ids=tokens, labels=tokens).loss
            loss.backward()
            losses.append(loss.detach().float())
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=0)
    assert counter.frame_count == len(model.model.layers)  # one graph per layer, no breaks
    q_compiled = model.model.layers[0].self_attn.q_proj.weight
    q_eager = eager.model.layers[0].self_attn.q_proj.weight
    assert compute_error(q_eager.float(), q_compiled.float()) > 30


def test_shared_inputs_of_a_llama_for_causal_lm_are_found_and_tied():
    """find_shared_inputs on the Hugging Face model: q, k and v (grouped-query: k and v are
    narrower) and gate and up in each decoder layer; tied, the model trains."""
    from fp8train import (
        CastConfig,
        Float8LinearConfig,
        find_shared_inputs,
        sync_float8_amax_and_scale_history,
        tie_delayed_input_scales,
    )

    delayed = CastConfig(scaling_type="delayed")
    config = Float8LinearConfig(
        cast_config_input=delayed, cast_config_weight=delayed, cast_config_grad_output=delayed
    )
    model = convert_to_float8_training(
        tiny_llama(), config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head"
    )
    tokens = torch.randint(0, 256, (4, 32))
    groups = find_shared_inputs(model, input_ids=tokens)
    assert [[layer.fqn.rsplit(".", 1)[-1] for layer in group] for group in groups] == [
        ["q_proj", "k_proj", "v_proj"],
        ["gate_proj", "up_proj"],
    ] * 2
    for group in groups:
        tie_delayed_input_scales(group)

    losses = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        value = model(input_ids=tokens, labels=tokens).loss
        value.backward()
        sync_float8_amax_and_scale_history(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(value.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
