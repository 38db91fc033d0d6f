import dataclasses

import pytest
import torch

from fp8train import (
    CastConfig,
    DelayedScalingConfig,
    Float8GemmConfig,
    Float8LinearConfig,
    Gemm,
    Role,
    ScalingGranularity,
    ScalingType,
)


def test_defaults_are_tensorwise_dynamic_with_e5m2_gradients():
    config = Float8LinearConfig()
    for gemm, roles in {
        Gemm.OUTPUT: (Role.INPUT, Role.WEIGHT),
        Gemm.GRAD_INPUT: (Role.GRAD_OUTPUT, Role.WEIGHT),
        Gemm.GRAD_WEIGHT: (Role.GRAD_OUTPUT, Role.INPUT),
    }.items():
        for role in roles:
            cast = config.cast_config(role, gemm)
            assert cast.scaling_type is ScalingType.DYNAMIC
            assert cast.scaling_granularity is ScalingGranularity.TENSORWISE
            expected = torch.float8_e5m2 if role is Role.GRAD_OUTPUT else torch.float8_e4m3fn
            assert cast.target_dtype == expected
    assert config.gemm_config(Gemm.OUTPUT).use_fast_accum
    assert not config.gemm_config(Gemm.GRAD_INPUT).use_fast_accum
    assert not config.gemm_config(Gemm.GRAD_WEIGHT).use_fast_accum
    assert config.recompute_weight_cast and config.recompute_input_cast is None


def test_configs_are_frozen_and_hashable():
    config = Float8LinearConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.emulate = True
    assert hash(config) == hash(Float8LinearConfig())


def test_strings_are_parsed_and_axiswise_is_rowwise():
    cast = CastConfig(scaling_type="dynamic", scaling_granularity="rowwise")
    assert cast.scaling_type is ScalingType.DYNAMIC
    assert cast.scaling_granularity is ScalingGranularity.ROWWISE
    assert ScalingGranularity.AXISWISE is ScalingGranularity.ROWWISE


def test_bad_enum_string_names_the_choices():
    with pytest.raises(ValueError, match=r"'colwise' is not a ScalingGranularity.*'tensorwise'"):
        CastConfig(scaling_granularity="colwise")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cast_config_input": "dynamic"}, r"cast_config_input='dynamic' is not a CastConfig"),
        ({"cast_config_weight_for_grad_input": 3}, "is not a CastConfig: give CastConfig"),
        ({"gemm_config_output": None}, r"gemm_config_output=None is not a Float8GemmConfig"),
        ({"delayed_scaling_config": {}}, r"delayed_scaling_config=\{\} is not a Delayed"),
        ({"emulate": "yes"}, r"emulate='yes': give True or False$"),
        ({"recompute_input_cast": 0}, r"recompute_input_cast=0: give True or False, or None"),
    ],
)
def test_sub_configs_of_the_wrong_type_are_refused_by_field(kwargs, match):
    with pytest.raises(TypeError, match=match):
        Float8LinearConfig(**kwargs)
    # The per-gemm overrides may be None: the role's config applies; so may
    # recompute_input_cast (the partitioner decides).
    assert Float8LinearConfig(cast_config_weight_for_grad_input=None)
    assert Float8LinearConfig(recompute_input_cast=None)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Float8GemmConfig(use_fast_accum="no"), "use_fast_accum='no': give True or"),
        (lambda: DelayedScalingConfig(compiled_one_pass=1), "compiled_one_pass=1: give True"),
        (lambda: DelayedScalingConfig(history_len=2.5), "history_len=2.5: give an int$"),
        (lambda: DelayedScalingConfig(history_len=True), "history_len=True: give an int$"),
    ],
)
def test_sub_config_options_of_the_wrong_type_are_refused_by_field(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_target_dtype_must_be_float8():
    with pytest.raises(ValueError, match="not a float8 dtype"):
        CastConfig(target_dtype=torch.bfloat16)


def test_per_gemm_override_applies_to_its_gemm_only():
    rowwise = CastConfig(scaling_granularity="rowwise")
    config = Float8LinearConfig(
        cast_config_input_for_grad_weight=rowwise,
        cast_config_grad_output_for_grad_weight=rowwise,
    )
    assert config.cast_config(Role.INPUT, Gemm.GRAD_WEIGHT).scaling_granularity == "rowwise"
    assert config.cast_config(Role.INPUT, Gemm.OUTPUT).scaling_granularity == "tensorwise"
    assert config.cast_config(Role.GRAD_OUTPUT, Gemm.GRAD_INPUT).scaling_granularity == (
        "tensorwise"
    )


def test_gemm_half_disabled_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="grad_weight gemm.*set both operands' scaling_type"):
        Float8LinearConfig(cast_config_input_for_grad_weight=CastConfig(scaling_type="disabled"))


def test_high_precision_grad_weight_gemm_is_allowed():
    disabled = CastConfig(scaling_type="disabled")
    config = Float8LinearConfig(
        cast_config_input_for_grad_weight=disabled,
        cast_config_grad_output_for_grad_weight=disabled,
    )
    assert not config.cast_config(Role.INPUT, Gemm.GRAD_WEIGHT).enabled


def test_mixed_granularity_in_one_gemm_is_rejected():
    with pytest.raises(ValueError, match="output gemm casts input rowwise but weight tensorwise"):
        Float8LinearConfig(cast_config_input=CastConfig(scaling_granularity="rowwise"))


def test_two_e5m2_operands_are_rejected():
    e5m2 = CastConfig(target_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="two float8_e5m2 operands.*float8_e4m3fn"):
        Float8LinearConfig(cast_config_weight=e5m2)


def test_compiled_cast_kernels_names_roles():
    from fp8train.cast import uses_cast_kernels

    assert Float8LinearConfig().compiled_cast_kernels == frozenset()
    assert Float8LinearConfig(compiled_cast_kernels=True).compiled_cast_kernels == set(Role)
    some = Float8LinearConfig(compiled_cast_kernels=("weight", Role.GRAD_OUTPUT))
    assert some.compiled_cast_kernels == {Role.WEIGHT, Role.GRAD_OUTPUT}
    assert [uses_cast_kernels(some, role) for role in Role] == [False, True, True]
    # A float8 weight kept for backward is cast on the torch path whatever the roles say.
    kept = dataclasses.replace(some, recompute_weight_cast=False)
    assert [uses_cast_kernels(kept, role) for role in Role] == [False, False, True]
    assert some == Float8LinearConfig(compiled_cast_kernels=["grad_output", "weight"])
    hash(some)


@pytest.mark.parametrize("bad", ["weight", 1, ("weights",)])
def test_compiled_cast_kernels_rejects_what_is_not_a_collection_of_roles(bad):
    with pytest.raises(ValueError, match="compiled_cast_kernels|is not a Role.*'grad_output'"):
        Float8LinearConfig(compiled_cast_kernels=bad)


def test_compiled_transpose_kernels_names_roles():
    assert Float8LinearConfig().compiled_transpose_kernels == "auto"  # fp8train.toolchain
    assert Float8LinearConfig(compiled_transpose_kernels=False).compiled_transpose_kernels == set()
    assert Float8LinearConfig(compiled_transpose_kernels=True).compiled_transpose_kernels == set(
        Role
    )
    some = Float8LinearConfig(compiled_transpose_kernels=["grad_output"])
    assert some.compiled_transpose_kernels == {Role.GRAD_OUTPUT}
    assert some == Float8LinearConfig(compiled_transpose_kernels=(Role.GRAD_OUTPUT,))
    assert some.compiled_cast_kernels == frozenset()
    hash(some)


@pytest.mark.parametrize("bad", ["grad_output", "Auto", 2.0, ("gradient",)])
def test_compiled_transpose_kernels_rejects_what_is_not_a_collection_of_roles(bad):
    message = (
        r"compiled_transpose_kernels=.*give \"auto\", True, False .*\('grad_output',\)"
        r"|is not a Role.*'grad_output'"
    )
    with pytest.raises(ValueError, match=message):
        Float8LinearConfig(compiled_transpose_kernels=bad)


def test_cast_config_rejects_a_role_outside_the_gemm():
    with pytest.raises(ValueError, match="weight is not an operand of the grad_weight gemm"):
        Float8LinearConfig().cast_config(Role.WEIGHT, Gemm.GRAD_WEIGHT)


def test_cast_config_lists_the_roles_and_gemms_for_a_misspelt_name():
    with pytest.raises(ValueError, match="'inpt' is not a Role: choose one of 'input'"):
        Float8LinearConfig().cast_config("inpt", "output")
    with pytest.raises(ValueError, match="'out' is not a Gemm: choose one of 'output'"):
        Float8LinearConfig().cast_config("input", "out")


def test_gemm_config_default():
    assert Float8GemmConfig().use_fast_accum is False
