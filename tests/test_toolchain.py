"""The check of the compiler Triton assembles fp8train's kernels with (fp8train.toolchain)."""

import os
import warnings

import pytest
from torch import nn

import fp8train.toolchain as toolchain
from fp8train import ToolchainWarning, convert_to_float8_training, toolchain_problem
from fp8train.config import Role

PTXAS_12_8 = """ptxas: NVIDIA (R) Ptx optimizing assembler
Copyright (c) 2005-2025 NVIDIA Corporation
Cuda compilation tools, release 12.8, V12.8.93
Build cuda_12.8.r12.8/compiler.35583870_0
"""


def test_ptxas_version_is_read_from_its_banner():
    assert toolchain._version(PTXAS_12_8) == (12, 8)
    assert toolchain._version("Cuda compilation tools, release 13.0, V13.0.88") == (13, 0)
    assert toolchain._version("not a ptxas") is None


def test_hopper_with_ptxas_12_is_named_with_the_fix():
    message = toolchain.describe_problem((9, 0), "/triton/bin/ptxas", (12, 8), None)
    assert "sm_90" in message and "ptxas 12.8 (/triton/bin/ptxas)" in message
    assert "triton-lang/triton#11111" in message
    assert "CUDA 13.0 toolkit or later" in message and "TRITON_PTXAS_PATH" in message
    found = toolchain.describe_problem((9, 0), "/triton/bin/ptxas", (12, 9), "/cuda/bin/ptxas")
    assert "set TRITON_PTXAS_PATH=/cuda/bin/ptxas (found here)" in found


@pytest.mark.parametrize(
    ("capability", "version"),
    [((9, 0), (13, 0)), ((9, 0), (13, 3)), ((8, 9), (12, 8)), ((10, 0), (12, 8))],
)
def test_a_fixed_ptxas_or_another_gpu_is_no_problem(capability, version):
    assert toolchain.describe_problem(capability, "ptxas", version, None) is None


def test_no_problem_without_a_cuda_gpu():
    if toolchain.torch.cuda.is_available():
        pytest.skip("checks the CPU answer; a CUDA machine answers from its GPUs")
    assert toolchain_problem() is None


def test_convert_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(toolchain, "toolchain_problem", lambda: "ptxas 12.8 miscompiles")
    toolchain.warn_once_about_toolchain.cache_clear()
    try:
        with pytest.warns(ToolchainWarning, match="ptxas 12.8 miscompiles") as caught:
            convert_to_float8_training(nn.Sequential(nn.Linear(16, 16)))
            convert_to_float8_training(nn.Sequential(nn.Linear(16, 16)))
        assert len([w for w in caught if w.category is ToolchainWarning]) == 1
        assert caught[0].filename == __file__  # points at the caller's line
    finally:
        toolchain.warn_once_about_toolchain.cache_clear()


def test_convert_is_silent_where_the_toolchain_is_fine(monkeypatch):
    monkeypatch.setattr(toolchain, "toolchain_problem", lambda: None)
    toolchain.warn_once_about_toolchain.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            convert_to_float8_training(nn.Sequential(nn.Linear(16, 16)))
    finally:
        toolchain.warn_once_about_toolchain.cache_clear()


def test_the_ptxas_in_use_is_named_for_result_headers(monkeypatch):
    own = "/site/triton/backends/nvidia/bin"
    monkeypatch.setattr(toolchain, "_triton_bin", lambda: own)
    monkeypatch.setattr(toolchain, "_ptxas_version", lambda path: (12, 8))
    monkeypatch.setattr(toolchain, "_triton_ptxas", lambda: f"{own}/ptxas")
    assert toolchain.ptxas_in_use() == "12.8 (Triton's own)"
    monkeypatch.setattr(toolchain, "_ptxas_version", lambda path: (13, 0))
    monkeypatch.setattr(toolchain, "_triton_ptxas", lambda: "/usr/local/cuda/bin/ptxas")
    assert toolchain.ptxas_in_use() == "13.0 (/usr/local/cuda/bin/ptxas)"
    monkeypatch.setattr(toolchain, "_triton_ptxas", lambda: None)
    assert toolchain.ptxas_in_use() is None


def test_auto_transpose_kernels_are_decided_from_the_problem(monkeypatch):
    monkeypatch.setattr(toolchain, "_auto_transpose_roles", frozenset())  # restored after
    monkeypatch.setattr(toolchain, "toolchain_problem", lambda: "ptxas 12.8 miscompiles")
    toolchain.resolve_auto_transpose()
    assert toolchain.auto_transpose_roles() == set(Role)
    monkeypatch.setattr(toolchain, "toolchain_problem", lambda: None)
    toolchain.resolve_auto_transpose()
    assert toolchain.auto_transpose_roles() == set()


def test_the_warning_says_what_the_default_does_meanwhile():
    message = toolchain.describe_problem((9, 0), "/triton/bin/ptxas", (12, 8), None)
    assert "compiled_transpose_kernels='auto'" in message and "sets it False" in message


@pytest.mark.parametrize("problem", ["ptxas 12.8 miscompiles", None])
def test_env_command_reports_the_toolchain_and_the_auto_choice(problem, monkeypatch, capsys):
    from fp8train.__main__ import main

    monkeypatch.setattr(toolchain, "_auto_transpose_roles", frozenset())  # restored after
    monkeypatch.setattr(toolchain, "toolchain_problem", lambda: problem)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch: {toolchain.torch.__version__}" in out
    assert f"known compiler problem: {problem or 'none'}" in out
    auto = "on (every role)" if problem else "off"
    assert f'compiled_transpose_kernels="auto": {auto}' in out


@pytest.mark.parametrize(
    ("already", "shipped", "version", "adopted"),
    [
        (None, "/site/torch/bin/ptxas", (13, 0), True),
        ("/mine/ptxas", "/site/torch/bin/ptxas", (13, 0), False),  # the user's choice stays
        (None, "/site/torch/bin/ptxas", (12, 8), False),  # not a fix: Triton's own stays
        (None, None, None, False),  # a wheel without a ptxas
    ],
)
def test_torch_ptxas_is_adopted_only_where_it_is_the_fix(
    already, shipped, version, adopted, monkeypatch
):
    monkeypatch.setenv("TRITON_PTXAS_PATH", "recorded")  # so that the test's end restores it
    if already is None:
        monkeypatch.delenv("TRITON_PTXAS_PATH")
    else:
        monkeypatch.setenv("TRITON_PTXAS_PATH", already)
    monkeypatch.setattr(toolchain.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(toolchain, "_torch_ptxas", lambda: shipped)
    monkeypatch.setattr(toolchain, "_ptxas_version", lambda path: version)
    toolchain.adopt_torch_ptxas.cache_clear()
    try:
        assert toolchain.adopt_torch_ptxas() == (shipped if adopted else None)
        assert os.environ.get("TRITON_PTXAS_PATH") == (shipped if adopted else already)
    finally:
        toolchain.adopt_torch_ptxas.cache_clear()


def test_torch_ptxas_is_looked_for_beside_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain.torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    assert toolchain._torch_ptxas() is None
    ptxas = tmp_path / "torch" / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("")
    assert toolchain._torch_ptxas() is None  # not executable
    ptxas.chmod(0o755)
    assert toolchain._torch_ptxas() == str(ptxas)
