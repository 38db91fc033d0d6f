"""convert_to_float8_training: the swap, the filter, and what stays the same."""

import warnings

import pytest
import torch
from torch import nn

from fp8train import (
    Float8Linear,
    Float8LinearConfig,
    ToolchainWarning,
    convert_to_float8_training,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({"wq": nn.Linear(64, 64), "wo": nn.Linear(64, 64)})
        self.ffn = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.norm = nn.LayerNorm(64)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 10)  # 10 outputs: not float8-able

    def forward(self, x):
        for block in self.blocks:
            x = block.norm(x)
            x = x + block.attn["wo"](block.attn["wq"](x))
            x = x + block.ffn(x)
        return self.head(x)


def keep_head_out(module: nn.Module, fqn: str) -> bool:
    return fqn != "head"


def linear_fqns(model: nn.Module, kind: type) -> list[str]:
    return [name for name, mod in model.named_modules() if type(mod) is kind]


def test_swaps_nested_linears_and_leaves_filtered_ones():
    model = convert_to_float8_training(Model(), module_filter_fn=keep_head_out)
    assert linear_fqns(model, Float8Linear) == [
        f"blocks.{i}.{name}" for i in range(2) for name in ("attn.wq", "attn.wo", "ffn.0", "ffn.2")
    ]
    assert linear_fqns(model, nn.Linear) == ["head"]
    assert model.blocks[1].ffn[2].fqn == "blocks.1.ffn.2"


def test_filter_sees_each_linear_with_its_fqn():
    seen = []
    convert_to_float8_training(Model(), module_filter_fn=lambda mod, fqn: seen.append(fqn) or False)
    assert "blocks.0.attn.wq" in seen and "head" in seen and len(seen) == 9


def _no_return_for_most(module: nn.Module, fqn: str) -> bool | None:
    if fqn == "head":
        return False
    return None  # a filter that forgot to return for the other layers


@pytest.mark.parametrize(
    ("module_filter_fn", "match"),
    [
        (lambda module: True, r"module_filter_fn\(module\) cannot be called as"),
        (lambda: True, "cannot be called as module_filter_fn"),
        ("head", "is not callable"),
        (_no_return_for_most, "returned None .* for 'blocks.0.attn.wq', not a bool: return True"),
        (lambda module, fqn: "False", r"returned 'False' \(str\) for 'blocks.0.attn.wq'"),
    ],
    ids=["one-parameter", "no-parameter", "not-callable", "returns-none", "returns-a-string"],
)
def test_a_filter_that_cannot_answer_gets_a_clear_error(module_filter_fn, match):
    model = Model()
    with pytest.raises(TypeError, match=match):
        convert_to_float8_training(model, module_filter_fn=module_filter_fn)


def test_filters_of_any_calling_convention_that_takes_two_arguments_work():
    def with_defaults(module, fqn, *, extra=None):  # noqa: ANN001, ANN202, ARG001
        return fqn != "head"

    class Callable_:
        def __call__(self, module, fqn):  # noqa: ANN001, ANN204
            return fqn != "head"

    for module_filter_fn in (with_defaults, Callable_(), lambda *args: args[1] != "head"):
        model = convert_to_float8_training(Model(), module_filter_fn=module_filter_fn)
        assert not isinstance(model.head, Float8Linear)
        assert isinstance(model.blocks[0].attn.wq, Float8Linear)


def test_misaligned_layer_error_names_its_fqn():
    with pytest.raises(ValueError, match=r"'head': out_features=10 .*pad_inner_dim=True.*filter"):
        convert_to_float8_training(Model())


def test_parameters_and_state_dict_are_unchanged():
    model = Model()
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_float8_training(model, module_filter_fn=keep_head_out)
    assert list(model.state_dict()) == keys_before
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[name] is params_before[name] for name in params_before)
    # The optimizer built before the swap still trains the swapped model.
    weight_before = model.blocks[0].attn["wq"].weight.detach().clone()
    model(torch.randn(16, 64)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.blocks[0].attn["wq"].weight, weight_before)


def test_float8_checkpoint_loads_into_the_original_model_and_back():
    fp8_model = convert_to_float8_training(Model(), module_filter_fn=keep_head_out)
    plain = Model()
    plain.load_state_dict(fp8_model.state_dict())
    x = torch.randn(16, 64)
    again = convert_to_float8_training(Model(), module_filter_fn=keep_head_out)
    again.load_state_dict(plain.state_dict())
    assert torch.equal(again(x), fp8_model(x))


def test_root_linear_is_returned_swapped():
    layer = nn.Linear(32, 16)
    swapped = convert_to_float8_training(layer)
    assert type(swapped) is Float8Linear and swapped.fqn == ""
    assert swapped.weight is layer.weight


def test_converting_twice_changes_nothing():
    model = convert_to_float8_training(Model(), module_filter_fn=keep_head_out)
    layers = [mod for mod in model.modules() if isinstance(mod, Float8Linear)]
    convert_to_float8_training(model, module_filter_fn=keep_head_out)
    assert [mod for mod in model.modules() if isinstance(mod, Float8Linear)] == layers


def test_converting_again_with_another_config_is_refused():
    model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)))
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    with pytest.raises(ValueError, match="'0' is a Float8Linear already, with another config"):
        convert_to_float8_training(model, config=rowwise)
    # An equal config (not the same object) is this call's config: nothing to do.
    convert_to_float8_training(model, config=Float8LinearConfig())
    assert all(layer.config == Float8LinearConfig() for layer in model)


def test_the_new_layer_keeps_the_hooks_training_flag_and_subclass_state():
    class Adapter(nn.Linear):  # a subclass without a forward of its own
        def __init__(self) -> None:
            super().__init__(32, 32)
            self.rank = 4
            self.extra = nn.Linear(32, 4, bias=False)
            self.register_buffer("mask", torch.ones(32))

    layer = Adapter().eval()
    calls = []
    pre = layer.register_forward_pre_hook(lambda module, args: (args[0] * 0,))
    layer.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    layer.register_full_backward_hook(lambda module, gi, go: calls.append("backward"))
    layer.register_state_dict_post_hook(lambda module, sd, prefix, local: calls.append("sd"))
    model = convert_to_float8_training(nn.Sequential(layer))
    new = model[0]
    assert type(new) is Float8Linear and not new.training
    assert new.rank == 4 and new.extra is layer.extra and new.mask is layer.mask
    assert set(new.state_dict()) == set(layer.state_dict()) == {
        "weight", "bias", "mask", "extra.weight",
    }  # fmt: skip
    calls.clear()
    x = torch.randn(16, 32, requires_grad=True)
    out = new(x)
    assert torch.equal(out, new.bias.detach().expand(16, 32))  # the pre-hook zeroed the input
    out.sum().backward()
    assert calls == ["Float8Linear", "backward"]
    pre.remove()  # the handle from before the swap still removes the hook
    assert not torch.equal(new(torch.randn(16, 32)), new.bias.detach().expand(16, 32))


def test_a_parametrized_linear_is_refused_with_the_way_out():
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(32, 32)))
    with pytest.raises(ValueError, match=r"'0' is parametrized .*remove_parametrizations"):
        convert_to_float8_training(model)
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "0")


def test_from_float_refuses_what_is_not_a_linear():
    with pytest.raises(TypeError, match="takes an nn.Linear, got a Conv1d"):
        Float8Linear.from_float(nn.Conv1d(32, 32, 1))


def test_config_reaches_every_layer_and_repr_shows_it():
    config = Float8LinearConfig(recompute_weight_cast=False, emulate=True)
    model = convert_to_float8_training(Model(), config=config)  # emulate: head allowed
    assert all(m.config is config for m in model.modules() if isinstance(m, Float8Linear))
    text = repr(model.head)
    assert "in_features=64, out_features=10" in text
    assert "recompute_weight_cast=False" in text and "emulate" in text


def test_converted_model_trains():
    model = convert_to_float8_training(Model(), module_filter_fn=keep_head_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, target = torch.randn(32, 64), torch.randint(0, 10, (32,))
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_a_linear_subclass_with_its_own_forward_is_refused_not_swapped():
    class Scaled(nn.Linear):
        def forward(self, x):  # noqa: ANN001, ANN202
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(32, 32), Scaled(32, 32))
    with pytest.raises(ValueError, match=r"'1': Scaled subclasses nn.Linear with a forward"):
        convert_to_float8_training(model)
    # Left out by the filter, it stays as it is and the rest converts.
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "1")
    assert type(model[0]) is Float8Linear and type(model[1]) is Scaled


def test_multihead_attention_stays_high_precision_with_a_warning():
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    with pytest.warns(UserWarning, match="'self_attn' is an nn.MultiheadAttention"):
        convert_to_float8_training(layer)
    assert type(layer.self_attn.out_proj) is not Float8Linear
    assert type(layer.linear1) is Float8Linear and type(layer.linear2) is Float8Linear
    assert layer(torch.randn(2, 16, 32)).shape == (2, 16, 32)
    # No warning when the filter leaves attention out anyway.
    other = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # (A GPU machine's compiler warning, fp8train.toolchain, is not this test's subject.)
        warnings.simplefilter("ignore", ToolchainWarning)
        convert_to_float8_training(other, module_filter_fn=lambda m, fqn: "self_attn" not in fqn)


@pytest.mark.parametrize(
    ("module", "config", "match"),
    [
        ("model", None, "takes an nn.Module, got a str"),
        (nn.Linear(32, 32), {"emulate": True}, r"config=\{'emulate': True\} is not a Float8"),
        (nn.Linear(32, 32), "rowwise", "from_recipe_name"),
        (nn.Linear(32, 32), {}, "is not a Float8LinearConfig"),  # not taken as the default
    ],
)
def test_what_is_not_a_module_or_a_config_is_refused(module, config, match):
    with pytest.raises(TypeError, match=match):
        convert_to_float8_training(module, config=config)
